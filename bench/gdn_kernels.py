"""Qualification table of the Gated DeltaNet kernels the trainer and samplers use, on this GPU and these versions.

    python bench/gdn_kernels.py --tokens 1024 4096 8192 32768 --out bench/results/h200-gdn-kernels.json

Per kernel and length, with the 27B head layout (16 key heads, 48 value heads, dims 128, qk l2-norm in kernel):
relative L2 error of fla in BF16 and of the PyTorch reference in BF16, each against the PyTorch reference in FP32
(output, final state, and for the chunk kernel every input gradient), the worst of them, and the median time
(forward+backward for chunk and conv, one step for recurrent and conv_update) of fla and of the PyTorch reference.
The causal conv1d (fla's Triton causal_conv1d against transformers' F.conv1d path) gets the same: errors of the
output and the input and weight gradients, or of the output and the in-place updated state for one token.
Qualification rule: engine/gdn.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_ms(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from engine import gdn

    dev = torch.device("cuda")
    layout = {"hk": 16, "hv": 48, "dk": 128, "dv": 128}
    res = {"versions": gdn.versions(), "layout": layout, "rule": {"rel_l2_max": gdn.QUALIFY_REL_L2,
                                                                  "vs_torch_bf16_max": gdn.QUALIFY_VS_TORCH},
           "rows": []}
    try:
        fla = gdn.fla_functions()
    except ImportError as e:
        fla = {}
        res["fla_import_error"] = str(e)
    for name, Ts in (("chunk", a.tokens), ("recurrent", [1])):
        ref = gdn.reference(name)
        for T in Ts:
            row = {"kernel": name, "T": T}
            if name in fla:
                row.update(gdn.qualify_one(name, fla[name], T, layout, dev, seed=T))
            q, k, v, g, beta, h0 = gdn._inputs(T, 16, 48, 128, 128, dev, 1, state=name == "recurrent")
            grad = name == "chunk"
            for label, fn in (("torch", ref), ("fla", fla.get(name))):
                if fn is None or (label == "fla" and not row.get("passed") and "error" in row):
                    continue
                row[f"{label}_ms"] = round(median_ms(lambda: gdn._run(fn, q, k, v, g, beta, h0, torch.bfloat16, grad)), 3)
            if "rel_l2" in row:
                row["fla_worst_rel_l2"] = max(row["rel_l2"].values())
                row["torch_bf16_worst_rel_l2"] = max(row["torch_bf16_rel_l2"].values())
            res["rows"].append(row)
            torch.cuda.empty_cache()
    # causal conv1d + SiLU: sequence (forward+backward, as replay runs it) and one-token update (in place)
    conv_layout = {**layout, "w": 4}
    C = 2 * 16 * 128 + 48 * 128
    w = torch.randn(C, 4, device=dev, dtype=torch.bfloat16)
    for name, Ts in (("conv", a.tokens), ("conv_update", [1])):
        for T in Ts:
            row = {"kernel": name, "T": T}
            if name in fla:
                row.update(gdn.qualify_conv(name, fla[name], T, conv_layout, dev, seed=T))
            B = 1 if name == "conv" else 4
            x = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16).requires_grad_(name == "conv")
            st = torch.randn(B, C, 4, device=dev, dtype=torch.bfloat16)
            for label, fn in (("torch", gdn.reference(name)), ("fla", fla.get(name))):
                if fn is None:
                    continue
                if name == "conv":
                    def call(fn=fn):
                        fn(x.transpose(1, 2), w, None, activation="silu").float().sum().backward()
                else:
                    def call(fn=fn):
                        fn(x.transpose(1, 2), st, w, None, "silu")
                row[f"{label}_ms"] = round(median_ms(call), 3)
            if "rel_l2" in row:
                row["fla_worst_rel_l2"] = max(row["rel_l2"].values())
                row["torch_bf16_worst_rel_l2"] = max(row["torch_bf16_rel_l2"].values())
            res["rows"].append(row)
            torch.cuda.empty_cache()

    print(f"\nGDN kernels on {res['versions'].get('gpu')} (torch {res['versions']['torch']}, triton "
          f"{res['versions'].get('triton')}, fla {res['versions'].get('fla-core')}, tilelang {res['versions'].get('tilelang')})")
    print(f"{'kernel':<12}{'T':>7} {'qualified':>10} {'fla err':>9} {'torch bf16 err':>15} {'fla ms':>9} {'torch ms':>9}")
    for r in res["rows"]:
        q = "" if "passed" not in r else ("yes" if r["passed"] else "NO")
        fe = f"{r['fla_worst_rel_l2']:.4f}" if "fla_worst_rel_l2" in r else r.get("error", "")[:9]
        te = f"{r['torch_bf16_worst_rel_l2']:.4f}" if "torch_bf16_worst_rel_l2" in r else ""
        print(f"{r['kernel']:<12}{r['T']:>7} {q:>10} {fe:>9} {te:>15} {r.get('fla_ms', ''):>9} {r.get('torch_ms', ''):>9}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
