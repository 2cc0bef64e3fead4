"""Fused FP32 epilogues of the LoRA/DoRA adapter term on CUDA: one pass over the layer's output instead of six.

Why: the adapter term is combined with the base output in FP32 and rounded once (PEFT's arithmetic, the design's
"compute separately, combine in FP32, round once"). Written as PyTorch expressions that is a chain of elementwise
kernels over the whole (tokens x out) output, each reading and writing FP32: measured on one H200 at the 27B width
(bench/results/h200-replay-profile-nf4-2026-12-01.json, NF4 + DoRA r16, 7,281 tokens, 8 layers), FP32 elementwise
kernels took 45 % of replay's kernel time, the BF16 GEMMs 28 %.

What: Triton kernels computing exactly the same FP32 operations in the same order, each rounded as PyTorch rounds
it (launched with enable_fp_fusion=False: no multiply-add contraction), so the outputs are equal bit for bit to the
PyTorch expressions in engine/adapter_grad.py and engine/cuda_graphs.py:

    forward, DoRA       out = bf16(r + ((ms - 1) * base + (ms * l) * s))     base = r, or bf16(r - bias)
    forward, LoRA       out = bf16(r + l * s), or (bnb 4-bit) bf16(r + bf16(l * s))
    backward, DoRA      g_r = bf16(g * ms), g_l = g * (ms * s), and per block of rows sum(g * (base + l * s))
    backward, LoRA      g_l = g * s

(r: the base layer's output, l = B(A x) in FP32, ms = m / ||W + s BA|| detached, s: the scaling.) The DoRA
magnitude's gradient sums per-block partials in a fixed order: deterministic, within FP32 rounding of PyTorch's sum.

Use: `install(mode, device)` once per process before the first forward (engine.runtime does, beside the GDN
choice): mode auto qualifies the kernels on the device against the PyTorch expressions (bitwise) and uses them
only where they pass, with one log line otherwise; torch keeps the PyTorch expressions. On a CPU the PyTorch
expressions always run. The kernels also run under TRITON_INTERPRET=1 on a CPU (tests/test_adapter_kernels.py).
"""

from __future__ import annotations

import logging

import torch

from engine.kernel_choice import choose, interpret, kernel_errors

log = logging.getLogger("lgrpo.adapter")

_STATE: dict = {"devices": set(), "launches": 0}
_K: dict = {}
BLOCK_R, BLOCK_C = 32, 128


def _kernels() -> dict:
    if not _K:
        from engine import _adapter_triton as T

        _K.update(fwd=T.fwd, bwd_dora=T.bwd_dora, bwd_lora=T.bwd_lora)
    return _K


def _launch(kernel, grid, *args, **meta):
    _STATE["launches"] += 1  # counted (tests check the fused path really ran)
    if interpret():
        return kernel[grid](*args, **meta)
    return kernel[grid](*args, enable_fp_fusion=False, **meta)


def _grid(n_rows: int, n_cols: int):
    return ((n_rows + BLOCK_R - 1) // BLOCK_R, (n_cols + BLOCK_C - 1) // BLOCK_C)


# -- the two sides, each with the same signature ----------------------------------------------------------------------

def epilogue_torch(r, lo, ms, bias, s: float, dora: bool, round_lora: bool):
    """The PyTorch expressions (engine/adapter_grad.py, engine/cuda_graphs.py): the reference."""
    dt = r.dtype
    if not dora:
        return r + (lo * s).to(dt) if round_lora else (r + lo * s).to(dt)
    base = r if bias is None else r - bias
    return (r + ((ms - 1) * base + ms * lo * s)).to(dt)


def _need_bf16(t: torch.Tensor) -> None:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"the fused adapter epilogue rounds to BF16; got {t.dtype} (use the PyTorch expressions)")


def epilogue_fused(r, lo, ms, bias, s: float, dora: bool, round_lora: bool):
    _need_bf16(r)
    k = _kernels()
    shape = r.shape
    r2, l2 = r.reshape(-1, shape[-1]).contiguous(), lo.reshape(-1, shape[-1]).contiguous()
    n_rows, n_cols = r2.shape
    out = torch.empty_like(r2)
    ms_ = ms.reshape(-1).contiguous() if dora else l2
    bias_ = bias.contiguous() if (dora and bias is not None) else l2
    _launch(k["fwd"], _grid(n_rows, n_cols), r2, l2, ms_, bias_, out, n_rows, n_cols, float(s),
            DORA=bool(dora), HAS_BIAS=bool(dora and bias is not None), ROUND_LORA=bool(round_lora and not dora),
            BR=BLOCK_R, BC=BLOCK_C)
    return out.reshape(shape)


def dora_backward_torch(g, ms, base, lo, s: float):
    """(g_result, g_lora (FP32), sum over rows of g * (base + lo * s)) as engine/adapter_grad.py computes them."""
    gf = g.float()
    out_dim = g.shape[-1]
    g_result = (gf * ms).to(base.dtype)
    gl = gf * (ms * s)
    u = base.float() + lo * s
    return g_result, gl, (gf * u).reshape(-1, out_dim).sum(0)


def dora_backward_fused(g, ms, base, lo, s: float):
    _need_bf16(base)
    k = _kernels()
    shape = g.shape
    out_dim = shape[-1]
    g2 = g.reshape(-1, out_dim).contiguous()
    n_rows = g2.shape[0]
    ms_ = ms.reshape(-1).contiguous()
    mss = ms_ * s  # as the reference's (ms * s)
    gr = torch.empty_like(g2, dtype=base.dtype)
    gl = torch.empty(g2.shape, dtype=torch.float32, device=g.device)
    grid = _grid(n_rows, out_dim)
    part = torch.empty(grid[0], out_dim, dtype=torch.float32, device=g.device)
    _launch(k["bwd_dora"], grid, g2, ms_, mss, base.reshape(-1, out_dim).contiguous(),
            lo.reshape(-1, out_dim).contiguous(), gr, gl, part, n_rows, out_dim, float(s), BR=BLOCK_R, BC=BLOCK_C)
    return gr.reshape(shape), gl.reshape(shape), part.sum(0)


def lora_grad_torch(g, s: float):
    return g.float() * s


def lora_grad_fused(g, s: float):
    k = _kernels()
    g2 = g.contiguous()
    gl = torch.empty(g2.shape, dtype=torch.float32, device=g.device)
    n = g2.numel()
    _launch(k["bwd_lora"], ((n + 1023) // 1024,), g2, gl, n, float(s), B=1024)
    return gl


# -- the choice ---------------------------------------------------------------------------------------------------------

def enabled(t: torch.Tensor) -> bool:
    """Use the fused kernels for t (a BF16 base output on a device where install qualified them)."""
    return t.dtype == torch.bfloat16 and (t.is_cuda or interpret()) and str(t.device) in _STATE["devices"]


def qualify(device, dtype=torch.bfloat16) -> dict:
    """Run every kernel against the PyTorch expressions on random data of awkward shapes (rows and columns not
    multiples of the blocks), with and without bias, DoRA / LoRA / bnb-rounded LoRA. Passed: forward outputs,
    g_result and g_lora equal bit for bit; the magnitude's row sum within 1e-5 relative L2 (summation order)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    res = {"passed": True, "cases": []}
    try:
        for n_rows, n_cols in ((1, 7), (37, 300), (130, 257)):
            def rnd(*shape, dt=torch.float32, scale=1.0):
                return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

            r, lo = rnd(2, n_rows, n_cols, dt=dtype), rnd(2, n_rows, n_cols, scale=1e-2)
            ms = 1.0 + rnd(n_cols, scale=1e-2)
            bias = rnd(n_cols, dt=dtype)
            s = 2.0
            for dora, b, rl in ((True, None, False), (True, bias, False), (False, None, False), (False, None, True)):
                a = epilogue_torch(r, lo, ms.view(1, -1), b, s, dora, rl)
                f = epilogue_fused(r, lo, ms, b, s, dora, rl)
                ok = torch.equal(a, f)
                res["cases"].append({"kernel": "forward", "dora": dora, "bias": b is not None, "round_lora": rl,
                                     "shape": [n_rows, n_cols], "bitwise": ok})
                res["passed"] &= ok
            g = rnd(2, n_rows, n_cols, dt=dtype)
            ga, la, sa = dora_backward_torch(g, ms.view(1, -1), r, lo, s)
            gf, lf, sf = dora_backward_fused(g, ms, r, lo, s)
            rel = float((sa - sf).norm() / sa.norm().clamp_min(1e-30))
            ok = torch.equal(ga, gf) and torch.equal(la, lf) and rel <= 1e-5
            res["cases"].append({"kernel": "backward-dora", "shape": [n_rows, n_cols], "bitwise": torch.equal(ga, gf)
                                 and torch.equal(la, lf), "magnitude_rel_l2": rel})
            res["passed"] &= ok
            ok = torch.equal(lora_grad_torch(g, s), lora_grad_fused(g, s))
            res["cases"].append({"kernel": "backward-lora", "shape": [n_rows, n_cols], "bitwise": ok})
            res["passed"] &= ok
    except kernel_errors() as e:  # a kernel that does not build or run here is not qualified: the reason is logged
        res.update(passed=False, error=f"{type(e).__name__}: {e}")
    return res


def install(mode: str, device) -> str:
    """Choose the adapter epilogue for `device` in this process: torch (the PyTorch expressions) or auto (the fused
    kernels where they qualify; one log line says which runs and why). Returns "fused" or "torch"."""
    return choose("model.adapter_kernels", "adapter epilogue", "the PyTorch expressions", mode, device,
                  _STATE["devices"], qualify, lambda q: [c for c in q["cases"] if not c.get("bitwise", True)], log,
                  "bitwise")


def reset() -> None:
    """Forget every choice (tests)."""
    _STATE["devices"].clear()
