"""Seconds to write one step's adapter and AdamW state at the 27B shape: one file after the other (the layout before
stages.optimize.write_step_state) against side by side on two threads (what optimize does now).

    python bench/checkpoint_write.py [--preset qwen35-27b] [--reps 3] [--device cpu|cuda] [--dir D] [--json F]

The adapter's shapes come from the preset's model built on the meta device with its adapter attached (DoRA r16 on
the 10 default targets at the 27B shape: 1,200 tensors, 451 MB in FP32); the AdamW state is two FP32 moments per
adapter tensor plus its step count (~900 MB), as `_optimizer_tensors` lays it out. Tensors live on --device, so on
a GPU the device-to-host copies are part of each write, as in optimize. Each rep writes both layouts into fresh
directories under --dir (default: a temporary directory beside the run directories, same file system), in
alternating order, and deletes them; the medians and their ratio are printed. Every write is atomic with its sha256
sidecar and fsync (artifacts.store): the figures include hashing and fsync, which is where the time goes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def shaped_state(preset: str, device: str):
    """(meta PEFT model, [(name, meta param)], adapter state on device, AdamW-like state on device)."""
    import torch

    from configs.schema import load_config
    from engine import model as M

    cfg = load_config(preset)
    arch = dict(cfg.model.arch)
    with torch.device("meta"):
        model = M.attach_adapter(M.build_random_model(arch, arch["vocab_size"], 0, 1, seed=0, dtype="bfloat16"),
                                 cfg.adapter)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(shape):
        return torch.randn(shape, generator=gen).to(device)

    by_saved = {}
    from peft import get_peft_model_state_dict

    for k, v in get_peft_model_state_dict(model).items():  # PEFT's saved names, in its order (meta tensors)
        by_saved[k] = rand(v.shape)
    opt = types.SimpleNamespace(state={p: {"step": torch.tensor(1.0), "exp_avg": rand(p.shape),
                                            "exp_avg_sq": rand(p.shape).abs()} for _, p in params})
    return model, params, by_saved, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen35-27b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory under runs/)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from artifacts import RunDir, write_adapter_dir, write_tensors
    from engine import model as M
    from stages import optimize as O

    model, params, adapter, opt = shaped_state(a.preset, a.device)
    engine = types.SimpleNamespace(model=model)
    config = M.adapter_config_dict(model)
    mb = (sum(t.numel() * t.element_size() for t in adapter.values()),
          sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()))
    root = Path(a.dir) if a.dir else Path(__file__).resolve().parents[1] / "runs"
    root.mkdir(parents=True, exist_ok=True)

    def sequential(rd: RunDir):
        write_adapter_dir(rd.adapter(0), config, adapter)
        tensors, meta = O._optimizer_tensors(opt, params)
        write_tensors(rd.optimizer(0), tensors, meta)

    def side_by_side(rd: RunDir):
        O.write_step_state(rd, 0, engine, opt, params, adapter)

    times: dict[str, list[float]] = {"sequential": [], "side_by_side": []}
    layouts = {"sequential": sequential, "side_by_side": side_by_side}
    for rep in range(a.reps):
        order = list(layouts) if rep % 2 == 0 else list(layouts)[::-1]
        for name in order:
            d = Path(tempfile.mkdtemp(prefix="ckpt-write-", dir=root))
            try:
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                layouts[name](RunDir(d))
                times[name].append(time.perf_counter() - t0)
            finally:
                shutil.rmtree(d)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"preset": a.preset, "device": a.device, "adapter_mb": round(mb[0] / 1e6, 1),
           "optimizer_mb": round(mb[1] / 1e6, 1), "tensors": len(adapter), "reps": a.reps,
           "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
           "median_s": {k: round(v, 3) for k, v in med.items()},
           "side_by_side_vs_sequential": round(med["side_by_side"] / med["sequential"], 3)}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
