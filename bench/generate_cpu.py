"""generate-turn with the prefix cache on vs off, side by side, on the stored turn states of a finished run.

    python bench/generate_cpu.py --from-run runs/tiny [--steps 0 2 4 6 8] [--repeats 2]

For each mode (generation.prefix_cache true / false, alternating, `--repeats` times) the run directory is copied
(steps up to the last one asked for), its config switched, the engines dropped, and generate-turn re-run for every
stored turn of the given fresh steps from the same input states (tasks.arrow, gym-TT.arrow) with the adapter the
step used. Prints the stage's own latent-loop and answer seconds per mode, and the ratio. Absolute seconds depend
on the machine; compare the side-by-side ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _copy_run(src: Path, dst: Path, last_step: int, prefix_cache: bool) -> Path:
    import yaml

    from artifacts import RunDir, atomic_write

    keep = {f"step-{s:04d}" for s in range(last_step + 1)}
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if Path(d) == src and n.startswith("step-")
                                                       and n not in keep])
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["run_dir"] = str(dst)
    cfg["generation"] = {**cfg.get("generation", {}), "prefix_cache": prefix_cache}
    text = yaml.safe_dump(cfg, sort_keys=True)
    atomic_write(RunDir(dst).config(), lambda tmp: tmp.write_text(text))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-run", required=True)
    ap.add_argument("--steps", type=int, nargs="*", default=[0, 2, 4, 6, 8])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from artifacts import read_json
    from engine import runtime
    from stages.generate import generate_turn

    src = Path(args.from_run).resolve()
    prep = read_json(src / "prepared.json")
    export = str(sorted(p for p in (src / "export").iterdir() if p.is_dir())[0])
    steps = [s for s in args.steps if (src / f"step-{s:04d}" / "tasks.arrow").exists()]
    if not steps:
        raise SystemExit(f"{src}: none of the fresh steps {args.steps} has stored turn states")
    results: dict[str, list[dict]] = {"cache": [], "no cache": []}
    for _ in range(args.repeats):
        for mode in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                rd = _copy_run(src, Path(tmp) / "run", max(steps), mode)
                runtime.clear()
                t = {"latent_s": 0.0, "answers_s": 0.0, "turns": 0}
                for step in steps:
                    sd = rd / f"step-{step:04d}"
                    adapter = prep["adapter_init"] if step == 0 else str(rd / f"step-{step - 1:04d}" / "adapter")
                    states = [sd / "tasks.arrow"] + sorted(sd.glob("gym-*.arrow"))[:-1]
                    for turn, st in enumerate(states):
                        o = generate_turn(str(rd), step, turn, str(st), adapter, export, prep["base"],
                                          out_path=str(Path(tmp) / f"out-{step}-{turn}.arrow"))
                        t["latent_s"] += o["latent_s"]
                        t["answers_s"] += o["answers_s"]
                        t["turns"] += 1
                results["cache" if mode else "no cache"].append(t)
                print(f"{'prefix cache' if mode else 'no cache    '}: latent {t['latent_s']:.2f} s, answers "
                      f"{t['answers_s']:.2f} s over {t['turns']} generate-turn calls", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("latent_s", "answers_s")} for m, rs in results.items()}
    for k in ("latent_s", "answers_s"):
        print(f"median {k[:-2]}: no cache {med['no cache'][k]:.2f} s / prefix cache {med['cache'][k]:.2f} s = "
              f"{med['no cache'][k] / med['cache'][k]:.2f}x")
    tot = {m: v["latent_s"] + v["answers_s"] for m, v in med.items()}
    print(f"generation (latent + answers): {tot['no cache'] / tot['cache']:.2f}x with the prefix cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
