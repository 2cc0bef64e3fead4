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
    backward, DoRA      g_r = bf16(g * ms), and per block of rows sum(g * base)

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

_STATE: dict = {"devices": set(), "step_devices": set(), "launches": 0}
_K: dict = {}
BLOCK_R, BLOCK_C = 32, 128


def _kernels() -> dict:
    if not _K:
        from engine import _adapter_triton as T

        _K.update(fwd=T.fwd, bwd_dora=T.bwd_dora, step_h=T.step_h, step_out=T.step_out)
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


def dora_backward_torch(g, ms, base):
    """(g_result, sum over rows of g * base) as engine/adapter_grad.py computes them: the elementwise part of the
    DoRA backward (the LoRA term's share of the magnitude gradient comes from the rank-r GEMMs there)."""
    gf = g.float()
    out_dim = g.shape[-1]
    return (gf * ms).to(base.dtype), (gf * base.float()).reshape(-1, out_dim).sum(0)


def dora_backward_fused(g, ms, base):
    _need_bf16(base)
    k = _kernels()
    shape = g.shape
    out_dim = shape[-1]
    g2 = g.reshape(-1, out_dim).contiguous()
    n_rows = g2.shape[0]
    gr = torch.empty_like(g2, dtype=base.dtype)
    grid = _grid(n_rows, out_dim)
    part = torch.empty(grid[0], out_dim, dtype=torch.float32, device=g.device)
    _launch(k["bwd_dora"], grid, g2, ms.reshape(-1).contiguous(), base.reshape(-1, out_dim).contiguous(), gr, part,
            n_rows, out_dim, BR=BLOCK_R, BC=BLOCK_C)
    return gr.reshape(shape), part.sum(0)


# -- single-token steps: the whole adapter term in two kernels ----------------------------------------------------------
#
# A latent step or a decoded token runs every adapted projection on a handful of rows (one per sequence). There the
# PyTorch path is five kernels per projection, each a few microseconds of launch and latency for almost no work:
# x cast to FP32, the FP32 GEMM A x (cuBLAS picks split-K: a GEMM and a reduce), B h, and the epilogue -- measured on
# one H200 at the 27B shape, ~10 of the 30 ms of a graphed decode step go to the 400 adapted projections' FP32 path
# (bench/results/h200-recipe-27b-nf4-latent-sampler-2026-12-02.json). Here: step_h (partial h = A x per input chunk,
# x read in its own dtype) and step_out (h summed over the chunks in order, B h and the epilogue of `fwd`). The
# arithmetic is FP32 throughout, as PyTorch's; only the order of the sums differs from cuBLAS's, so the outputs agree
# within one BF16 unit in the last place, not bit for bit (the qualification checks that, and that the result is as
# close to an FP64 reference as PyTorch's). A row's result does not depend on the other rows of the batch.

STEP_ROWS = 16  # at most this many rows (batch x tokens) take the step kernels
# step_h's launch layout: each program sums one rank's products over k_chunk inputs, bk at a time (k_chunk / bk
# dependent loads in a row: the latency of the call), then step_out sums the chunks' partials in order. The order of
# the FP32 sums depends on k_chunk and bk (not on the rows): change them only before graphs are captured, and qualify
# again (bench/adapter_step.py times the layouts at the 27B widths). 512/256/4: the 400 adapted projections of one
# 27B model step in 2.59 ms at 4 rows and 2.92 ms at 16 (1024/128/4 before: 3.42 and 4.00; one H100, in a CUDA graph,
# bench/results/h100-adapter-step-2026-12-07.json); one layout for every row count, so a row's bits do not depend on
# how many rows share its batch.
STEP = {"k_chunk": 512, "bk": 256, "warps": 4}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def step_torch(result, x, A, B, ms, bias, s: float, dora: bool, round_lora: bool):
    """The PyTorch path of engine/cuda_graphs.FrozenAdapter: the reference of `step_fused`."""
    xf = x.to(A.dtype) if x.dtype != A.dtype else x
    lo = torch.nn.functional.linear(torch.nn.functional.linear(xf, A), B)
    return (epilogue_fused if enabled(result) else epilogue_torch)(result, lo, ms, bias, s, dora, round_lora)


def step_h(x, A):
    """Part 1 alone: the FP32 partials of h = A x per input chunk, (n_chunks, BM, rank), for x (.., in) of at most
    STEP_ROWS rows. A may stack sibling projections' A matrices (same input): each rank row is computed exactly as
    it would be alone, so `step_fused(..., part=...)` of each sibling gives its own result bit for bit."""
    k = _kernels()
    n_in = x.shape[-1]
    x2 = x.reshape(-1, n_in).contiguous()
    n_rows, rank = x2.shape[0], A.shape[0]
    if n_rows > STEP_ROWS:
        raise ValueError(f"step kernels take at most {STEP_ROWS} rows, got {n_rows}")
    BM = _pow2(n_rows)
    kc = STEP["k_chunk"]
    n_chunks = (n_in + kc - 1) // kc
    part = torch.empty(n_chunks, BM, rank, dtype=torch.float32, device=x2.device)
    _launch(k["step_h"], (rank, n_chunks), x2, A.contiguous(), part, n_rows, n_in, rank, K_CHUNK=kc,
            BM=BM, BK=min(STEP["bk"], kc), num_warps=STEP["warps"])
    return part


def step_fused(result, x, A, B, ms, bias, s: float, dora: bool, round_lora: bool, part=None, part_off: int = 0):
    """result: the base output (.., out) BF16; x: the input (.., in); A (r, in), B (out, r) FP32; ms (1, out) or
    None. Rows (the product of the leading dims) at most STEP_ROWS. part: step_h's partials already computed for
    x (with this projection's ranks at part_off; from a stacked sibling A), or None to compute them here."""
    _need_bf16(result)
    k = _kernels()
    shape = result.shape
    n_out, n_in = shape[-1], x.shape[-1]
    r2 = result.reshape(-1, n_out).contiguous()
    n_rows, rank = r2.shape[0], A.shape[0]
    if part is None:
        part = step_h(x, A)
    n_chunks, BM, stride = part.shape
    if n_rows > STEP_ROWS or BM != _pow2(n_rows) or n_chunks != (n_in + STEP["k_chunk"] - 1) // STEP["k_chunk"]:
        raise ValueError(f"step kernels: partials {tuple(part.shape)} do not fit {n_rows} rows of width {n_in}")
    RP = _pow2(rank)
    BC = max(16, min(128, 4096 // (BM * RP)))
    out = torch.empty_like(r2)
    ms_ = ms.reshape(-1).contiguous() if dora else r2
    bias_ = bias.contiguous() if (dora and bias is not None) else r2
    _launch(k["step_out"], ((n_out + BC - 1) // BC,), part, B.contiguous(), r2, ms_, bias_, out, n_rows, n_out, rank,
            int(part_off), int(stride), float(s), N_CHUNKS=n_chunks, DORA=bool(dora),
            HAS_BIAS=bool(dora and bias is not None), ROUND_LORA=bool(round_lora and not dora), BM=BM, BC=BC, RP=RP)
    return out.reshape(shape)


def step_enabled(result: torch.Tensor) -> bool:
    """Use the step kernels for this base output: BF16, at most STEP_ROWS rows, on a device where they qualified."""
    return (result.dtype == torch.bfloat16 and result.numel() <= STEP_ROWS * result.shape[-1]
            and (result.is_cuda or interpret()) and str(result.device) in _STATE["step_devices"])


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of BF16 at the larger magnitude (both BF16 tensors)."""
    a, b = a.double(), b.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(mag)) - 7)


def qualify_step(device, dtype=torch.bfloat16) -> dict:
    """The step kernels against `step_torch` on random data of awkward shapes (rows 1-16, ranks not powers of two,
    input and output widths not multiples of the blocks), DoRA with and without bias, LoRA, bnb-rounded LoRA.
    Passed: every output within 1 BF16 ulp of PyTorch's, and as close to an FP64 evaluation of the same expression
    as PyTorch's (relative L2 at most 1.25x PyTorch's + 1e-7)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    res = {"passed": True, "cases": []}
    try:
        for n_rows, n_in, n_out, rank in ((1, 300, 7, 16), (4, 2500, 257, 16), (13, 1030, 130, 5), (16, 640, 96, 8)):
            def rnd(*shape, dt=torch.float32, scale=1.0):
                return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

            x = rnd(n_rows, 1, n_in, dt=dtype)
            W = rnd(n_out, n_in, dt=dtype, scale=n_in ** -0.5)
            A, B = rnd(rank, n_in, scale=n_in ** -0.5), rnd(n_out, rank, scale=0.05)
            r = torch.nn.functional.linear(x, W)
            ms = 1.0 + rnd(1, n_out, scale=1e-2)
            bias = rnd(n_out, dt=dtype)
            s = 2.0
            lo64 = torch.nn.functional.linear(torch.nn.functional.linear(x.double(), A.double()), B.double())
            for dora, b, rl in ((True, None, False), (True, bias, False), (False, None, False), (False, None, True)):
                ref = step_torch(r, x, A, B, ms if dora else None, b, s, dora, rl)
                got = step_fused(r, x, A, B, ms if dora else None, b, s, dora, rl)
                exact = epilogue_torch(r.double(), lo64, ms.double() if dora else None,
                                       None if b is None else b.double(), s, dora, False)
                err = lambda t: float((t.double() - exact).norm() / exact.norm().clamp_min(1e-30))  # noqa: E731
                ulps = float(_ulps_bf16(ref, got).max())
                ok = ulps <= 1.0 and err(got) <= 1.25 * err(ref) + 1e-7
                res["cases"].append({"kernel": "step", "dora": dora, "bias": b is not None, "round_lora": rl,
                                     "shape": [n_rows, n_in, n_out, rank], "max_ulps": ulps,
                                     "bitwise_share": float((ref == got).float().mean()),
                                     "fp64_rel_l2": err(got), "fp64_rel_l2_torch": err(ref), "passed": ok})
                res["passed"] &= ok
    except kernel_errors() as e:  # a kernel that does not build or run here is not qualified: the reason is logged
        res.update(passed=False, error=f"{type(e).__name__}: {e}")
    return res


# -- the choice ---------------------------------------------------------------------------------------------------------

def enabled(t: torch.Tensor) -> bool:
    """Use the fused kernels for t (a BF16 base output on a device where install qualified them)."""
    return t.dtype == torch.bfloat16 and (t.is_cuda or interpret()) and str(t.device) in _STATE["devices"]


def qualify(device, dtype=torch.bfloat16) -> dict:
    """Run every kernel against the PyTorch expressions on random data of awkward shapes (rows and columns not
    multiples of the blocks), with and without bias, DoRA / LoRA / bnb-rounded LoRA. Passed: forward outputs and
    g_result equal bit for bit; the row sum of g * base within 1e-5 relative L2 (summation order)."""
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
            ga, sa = dora_backward_torch(g, ms.view(1, -1), r)
            gf, sf = dora_backward_fused(g, ms, r)
            rel = float((sa - sf).norm() / sa.norm().clamp_min(1e-30))
            ok = torch.equal(ga, gf) and rel <= 1e-5
            res["cases"].append({"kernel": "backward-dora", "shape": [n_rows, n_cols], "bitwise": torch.equal(ga, gf),
                                 "magnitude_rel_l2": rel})
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


def install_step(mode: str, device) -> str:
    """Choose the single-token step path for `device` (model.adapter_step_kernels): torch (the PyTorch path) or auto
    (the step kernels where they qualify: within 1 BF16 ulp of PyTorch, as close to FP64). Returns "fused"/"torch"."""
    return choose("model.adapter_step_kernels", "adapter single-token steps", "the PyTorch path", mode, device,
                  _STATE["step_devices"], qualify_step, lambda q: [c for c in q["cases"] if not c.get("passed", True)],
                  log, "within 1 BF16 ulp of PyTorch")


def reset() -> None:
    """Forget every choice (tests)."""
    _STATE["devices"].clear()
    _STATE["step_devices"].clear()
