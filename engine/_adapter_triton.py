"""Triton kernels of engine/adapter_kernels.py (imported only when the fused epilogue is used: Triton is optional)."""

import triton
import triton.language as tl


@triton.jit
def bf16_rtne(x):
    """x (FP32) rounded to the nearest BF16 value, ties to even, returned as FP32 (exactly representable in BF16,
    so the final cast is exact). Written out with integer operations: Triton's interpreter truncates on a cast,
    the GPU rounds to nearest even -- this makes both equal PyTorch's rounding. NaN stays NaN."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _tile(n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """This program's (BR, BC) tile of a row-major (n_rows, n_cols) tensor: its columns (BC,) and (1, BC), the
    column mask, the element mask and the element offsets."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    cols1 = tl.program_id(1) * BC + tl.arange(0, BC)
    cols = cols1[None, :]
    cmask = cols < n_cols
    return cols1, cols, cmask, (rows < n_rows) & cmask, rows.to(tl.int64) * n_cols + cols


@triton.jit
def _combine(r_ptr, ms_ptr, bias_ptr, out_ptr, lo, cols, cmask, mask, off, s,
             DORA: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_LORA: tl.constexpr):
    """out = the base output r combined with the FP32 LoRA term lo (PEFT's expressions, module docstring of
    engine/adapter_kernels.py), rounded once, stored at off."""
    r_lp = tl.load(r_ptr + off, mask=mask, other=0.0)
    r = r_lp.to(tl.float32)
    if DORA:
        ms = tl.load(ms_ptr + cols, mask=cmask, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            base = bf16_rtne(r - bias)
        else:
            base = r
        out = r + ((ms - 1.0) * base + (ms * lo) * s)
    elif ROUND_LORA:
        out = r + bf16_rtne(lo * s)
    else:
        out = r + lo * s
    tl.store(out_ptr + off, bf16_rtne(out).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fwd(r_ptr, l_ptr, ms_ptr, bias_ptr, out_ptr, n_rows, n_cols, s,
        DORA: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_LORA: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr):
    _, cols, cmask, mask, off = _tile(n_rows, n_cols, BR, BC)
    lo = tl.load(l_ptr + off, mask=mask, other=0.0)
    _combine(r_ptr, ms_ptr, bias_ptr, out_ptr, lo, cols, cmask, mask, off, s, DORA, HAS_BIAS, ROUND_LORA)


@triton.jit
def step_h(x_ptr, a_ptr, part_ptr, n_rows, n_in, n_rank, K_CHUNK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Single-token steps, part 1: partial h = A x over one chunk of the input dimension, for every row at once.
    Program (j, c): rank j, input chunk c; x (n_rows, n_in) in its own dtype, A (n_rank, n_in) FP32 ->
    part[c, row, j] in FP32 (products and sums in FP32, a fixed order: per row independent of the other rows)."""
    j = tl.program_id(0)
    c = tl.program_id(1)
    rows = tl.arange(0, BM)[:, None]
    rmask = rows < n_rows
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    k0 = c * K_CHUNK
    for k in range(0, K_CHUNK, BK):
        ks = k0 + k + tl.arange(0, BK)[None, :]
        km = ks < n_in
        xv = tl.load(x_ptr + rows.to(tl.int64) * n_in + ks, mask=rmask & km, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + j.to(tl.int64) * n_in + ks, mask=km, other=0.0)
        acc += xv * av
    h = tl.sum(acc, axis=1)
    m1 = tl.arange(0, BM)
    tl.store(part_ptr + (c * BM + m1) * n_rank + j, h, mask=m1 < n_rows)


@triton.jit
def step_out(part_ptr, b_ptr, r_ptr, ms_ptr, bias_ptr, out_ptr, n_rows, n_cols, n_rank, part_off, part_stride, s,
             N_CHUNKS: tl.constexpr, DORA: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_LORA: tl.constexpr,
             BM: tl.constexpr, BC: tl.constexpr, RP: tl.constexpr):
    """Single-token steps, part 2: h = the chunks' partials summed in order, the LoRA term B h (FP32) of this
    program's BC output columns for every row, combined with the base output as `fwd` does. The partials of this
    projection are ranks [part_off, part_off + n_rank) of rows part_stride wide (sibling projections' ranks side
    by side when one step_h served them all)."""
    m1 = tl.arange(0, BM)
    rk = tl.arange(0, RP)
    hmask = (m1[:, None] < n_rows) & (rk[None, :] < n_rank)
    h = tl.load(part_ptr + part_off + m1[:, None] * part_stride + rk[None, :], mask=hmask, other=0.0)
    for c in tl.static_range(1, N_CHUNKS):
        h += tl.load(part_ptr + part_off + (c * BM + m1[:, None]) * part_stride + rk[None, :], mask=hmask,
                     other=0.0)
    cols1 = tl.program_id(0) * BC + tl.arange(0, BC)
    b = tl.load(b_ptr + cols1[:, None].to(tl.int64) * n_rank + rk[None, :],
                mask=(cols1[:, None] < n_cols) & (rk[None, :] < n_rank), other=0.0)
    lo = tl.sum(h[:, None, :] * b[None, :, :], axis=2)  # (BM, BC)
    cols = cols1[None, :]
    cmask = cols < n_cols
    mask = (m1[:, None] < n_rows) & cmask
    off = m1[:, None].to(tl.int64) * n_cols + cols
    _combine(r_ptr, ms_ptr, bias_ptr, out_ptr, lo, cols, cmask, mask, off, s, DORA, HAS_BIAS, ROUND_LORA)


@triton.jit
def bwd_dora(g_ptr, ms_ptr, base_ptr, gr_ptr, part_ptr, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """DoRA backward, the elementwise part: g_result = bf16(g * ms), and per block of rows the partial column sums
    of g * base (FP32). The LoRA term's share of the magnitude gradient and every adapter GEMM run outside."""
    cols1, cols, cmask, mask, off = _tile(n_rows, n_cols, BR, BC)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    ms = tl.load(ms_ptr + cols, mask=cmask, other=0.0)
    tl.store(gr_ptr + off, bf16_rtne(g * ms).to(gr_ptr.dtype.element_ty), mask=mask)
    base = tl.load(base_ptr + off, mask=mask, other=0.0).to(tl.float32)
    p = tl.sum(g * base, axis=0)
    tl.store(part_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols1, p, mask=cols1 < n_cols)
