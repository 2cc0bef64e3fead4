"""One decode step's token draw at the 27B vocabulary: probabilities copied to the host and sampled there (the
draw before eeba1ec) against engine.rng.RowRandom.multinomial on the probabilities' device (q ~ Exp(1) drawn on the
CPU, p / q and argmax on the GPU), both per row from the row's own CPU generator -- and whether they choose the
same tokens.

    python bench/sampling_draw.py --out bench/results/h200-sampling-draw.json     # on the GPU
    python bench/sampling_draw.py --device cpu                                      # CPU flow check

Each draw waits for a (B, V) log-softmax that a GPU kernel has just produced (as the decode loop does after a graph
replay), so the timing includes the host-device synchronization either way; then again after --step-ms of queued
GPU matmuls (a decode step's replay): the host way waits for it and then draws, the device way draws meanwhile.
Printed and written as JSON: ms per draw of each way, their ratios, and token agreement over the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--vocab", type=int, default=248_320)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--step-ms", type=float, default=45.0, help="GPU work queued before each draw (the graphed "
                   "decode step of the 27B shape: ~45 ms)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from engine.rng import RowRandom

    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = [torch.randn(a.rows, a.vocab, generator=g, device=dev) * 4 for _ in range(a.steps)]
    seeds = list(range(10, 10 + a.rows))

    def host_draw(gens, lg):
        pr = torch.log_softmax(lg / 1.3, -1).exp().cpu()
        return torch.stack([torch.multinomial(pr[i], 1, generator=gi)[0] for i, gi in enumerate(gens)])

    def device_draw(rr, lg):
        return rr.multinomial(torch.log_softmax(lg / 1.3, -1).exp()).cpu()

    def run(fn, state):
        toks = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for lg in logits:
            toks.append(fn(state, lg))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / a.steps * 1e3, (torch.stack(toks) if toks[0] is not None else None)

    # a stand-in for the decode step's graph replay that the draw follows: ~--step-ms of GPU work queued first
    a_ = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy():
        for _ in range(max(0, round(a.step_ms / per_mm))):
            a_ @ a_

    per_mm = 1.0
    if dev.type == "cuda":
        busy_n = 20
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(busy_n):
            a_ @ a_
        torch.cuda.synchronize(dev)
        per_mm = (time.perf_counter() - t) * 1e3 / busy_n

    def overlapped(fn):
        def f(state, lg):
            busy()
            return fn(state, lg)
        return f

    run(host_draw, [torch.Generator().manual_seed(s) for s in seeds])  # warm-up
    run(device_draw, RowRandom(seeds))
    host_ms, host_toks = run(host_draw, [torch.Generator().manual_seed(s) for s in seeds])
    dev_ms, dev_toks = run(device_draw, RowRandom(seeds))
    host_ov, _ = run(overlapped(host_draw), [torch.Generator().manual_seed(s) for s in seeds])
    dev_ov, _ = run(overlapped(device_draw), RowRandom(seeds))
    gpu_only, _ = run(lambda state, lg: busy(), None)
    res = {"args": vars(a), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "host_draw_ms": round(host_ms, 3), "device_draw_ms": round(dev_ms, 3),
           "ratio": round(host_ms / dev_ms, 2), "tokens_equal": bool(torch.equal(host_toks, dev_toks)),
           "tokens_compared": int(host_toks.numel()),
           "after_a_gpu_step": {"gpu_step_ms": round(gpu_only, 3), "host_draw_ms": round(host_ov, 3),
                                "device_draw_ms": round(dev_ov, 3), "ratio": round(host_ov / dev_ov, 2)}}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"draw of {a.rows} rows x {a.vocab} vocabulary: host {host_ms:.2f} ms, on device {dev_ms:.2f} ms "
          f"({res['ratio']}x); tokens equal: {res['tokens_equal']} ({res['tokens_compared']})")
    print(f"after {gpu_only:.1f} ms of queued GPU work (a decode step's replay): wall per step host {host_ov:.2f} ms, "
          f"on device {dev_ov:.2f} ms ({res['after_a_gpu_step']['ratio']}x)")
    return res


if __name__ == "__main__":
    main()
