"""Peak GPU memory of building the 27B-shape random NF4 base (engine.nf4.load_base_nf4 on a random-base recipe), alone
and as a second engine beside a first one -- what verify-checkpoint does at the end of a run.

    python bench/build_memory.py --out bench/results/h100-build-memory-27b-nf4.json
    python bench/build_memory.py --walk modules ...     # the walk before the fix: torch's Module.modules()

engine.model.build_random_on materializes one module at a time and the NF4 build quantizes each decoder layer as soon
as it is complete. With `--walk modules` the build walks the model with Module.modules(), whose memo keeps every
module it yielded until the walk ends: each layer's replaced BF16 Linear modules stayed alive to the end of the build.
Printed and written as JSON: per build, seconds, the memory allocated before and after, the peak, and whether it
ran out of memory (caught: the error's first line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GB = 1e9


def recipe_dir(config: str, seed: int) -> Path:
    """A random-base recipe directory (random_base.json) of the preset's arch, as the bootstrap writes it."""
    from configs.schema import load_config
    from engine import model as M

    cfg = load_config(config)
    arch = dict(cfg.model.arch)
    d = Path(tempfile.mkdtemp(prefix="build-memory-"))
    (d / M.RANDOM_BASE).write_text(json.dumps({"arch": arch, "vocab_size": arch["vocab_size"], "pad_id": 0,
                                               "eos_id": 1, "seed": seed, "std": 0.02}))
    return d


def build(path: Path, label: str, walk: str):
    import torch

    from engine import model as M
    from engine import nf4

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    saved = M._preorder
    if walk == "modules":
        M._preorder = lambda module: module.modules()
    t = time.perf_counter()
    out = {"build": label, "walk": walk, "allocated_before_gb": round(before / GB, 2)}
    model = None
    try:
        model = nf4.load_base_nf4(path, device="cuda")
        torch.cuda.synchronize()
        out["out_of_memory"] = None
    except torch.OutOfMemoryError as e:
        out["out_of_memory"] = str(e).splitlines()[0][:200]
    finally:
        M._preorder = saved
    out.update(seconds=round(time.perf_counter() - t, 2), peak_gb=round(torch.cuda.max_memory_allocated() / GB, 2),
               allocated_after_gb=round(torch.cuda.memory_allocated() / GB, 2))
    print(json.dumps(out), flush=True)
    return model, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen35-27b-step")
    ap.add_argument("--walk", nargs="+", default=["preorder", "modules"], choices=["preorder", "modules"],
                    help="the build walks to measure (each: alone, then a second engine beside a first)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import gc

    import torch

    path = recipe_dir(a.config, seed=0)
    res = {"config": a.config, "gpu": torch.cuda.get_device_name(), "total_gb": round(
        torch.cuda.get_device_properties(0).total_memory / GB, 2), "torch": torch.__version__, "builds": []}
    for walk in a.walk:
        first, r = build(path, "first (alone)", walk)
        res["builds"].append(r)
        if first is None:
            continue
        second, r = build(path, "second (beside the first, as verify-checkpoint)", walk)
        res["builds"].append(r)
        del first, second
        gc.collect()
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
