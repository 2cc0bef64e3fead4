"""The LoRA/DoRA epilogue on one GPU: the fused Triton kernels (engine/adapter_kernels.py) against the PyTorch
expressions they replace -- qualification (bitwise) and milliseconds per call at the 27B widths.

    python bench/adapter_epilogue.py --tokens 7281 --out F.json

Shapes: tokens x out for the 27B's adapted projections (out 5120, 6144, 12288, 17408). Forward: DoRA and LoRA
epilogues; backward: DoRA (g_result, g_lora, magnitude row sum) and LoRA. Each timed as the median of --reps calls
after a warm-up, CUDA-synchronized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=7281)
    p.add_argument("--outs", type=int, nargs="+", default=[5120, 6144, 12288, 17408])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from engine import adapter_kernels as AK

    dev = torch.device("cuda")
    res: dict = {"args": vars(a), "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    t0 = time.perf_counter()
    res["qualify"] = AK.qualify(dev)
    res["qualify_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({"qualified": res["qualify"]["passed"], "error": res["qualify"].get("error"),
                      "seconds": res["qualify_s"]}), flush=True)

    def ms(fn) -> float:
        fn()
        torch.cuda.synchronize(dev)
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            ts.append((time.perf_counter() - t) * 1e3)
        return round(statistics.median(ts), 3)

    res["shapes"] = []
    for out in a.outs:
        g = torch.Generator(device=dev).manual_seed(0)
        r = torch.randn(a.tokens, out, device=dev, generator=g).bfloat16()
        lo = torch.randn(a.tokens, out, device=dev, generator=g) * 1e-2
        m = 1.0 + 1e-2 * torch.randn(out, device=dev, generator=g)
        gr = torch.randn(a.tokens, out, device=dev, generator=g).bfloat16()
        row = {"tokens": a.tokens, "out": out}
        row["fwd_dora_torch_ms"] = ms(lambda: AK.epilogue_torch(r, lo, m.view(1, -1), None, 2.0, True, False))
        row["fwd_dora_fused_ms"] = ms(lambda: AK.epilogue_fused(r, lo, m, None, 2.0, True, False))
        row["fwd_lora_torch_ms"] = ms(lambda: AK.epilogue_torch(r, lo, None, None, 2.0, False, False))
        row["fwd_lora_fused_ms"] = ms(lambda: AK.epilogue_fused(r, lo, None, None, 2.0, False, False))
        row["bwd_dora_torch_ms"] = ms(lambda: AK.dora_backward_torch(gr, m.view(1, -1), r))
        row["bwd_dora_fused_ms"] = ms(lambda: AK.dora_backward_fused(gr, m, r))
        row["fwd_dora_bitwise"] = torch.equal(AK.epilogue_torch(r, lo, m.view(1, -1), None, 2.0, True, False),
                                              AK.epilogue_fused(r, lo, m, None, 2.0, True, False))
        for k in ("fwd_dora", "fwd_lora", "bwd_dora"):
            row[f"{k}_speedup"] = round(row[f"{k}_torch_ms"] / max(row[f"{k}_fused_ms"], 1e-6), 2)
        res["shapes"].append(row)
        print(json.dumps(row), flush=True)
        del r, lo, gr
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
