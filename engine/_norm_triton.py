"""Triton kernels of engine/norm_kernels.py (imported only when the fused norms are used: Triton is optional).

One program normalizes BR rows of width N (<= BN, a power of two); every row is reduced by the same tl.sum over BN
lanes whatever the batch, so a row's result does not depend on which rows run beside it. Rounding points are
PyTorch's (see engine/norm_kernels.py); launched with enable_fp_fusion=False (no multiply-add contraction)."""

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne


@triton.jit
def _rows(n_rows, n_cols, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    cols = tl.arange(0, BN)[None, :]
    cmask = cols < n_cols
    return rows.to(tl.int64), cols, cmask, (rows < n_rows) & cmask


@triton.jit
def _rstd(xf, n_cols, inv_n, eps):
    """rsqrt(mean(x^2) + eps) per row, as (BR, 1): mean = sum * (1/N) as ATen's mean computes it."""
    ms = tl.sum(xf * xf, axis=1)[:, None] * inv_n
    return tl.math.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def _silu(z):
    """z / (1 + exp(-z)) (ATen's silu, FP32; IEEE division)."""
    return tl.math.div_rn(z, 1.0 + tl.exp(-z))


@triton.jit
def rms_fwd(x_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_x, inv_n, eps,
            BR: tl.constexpr, BN: tl.constexpr):
    """out = bf16(x * rstd * (1 + w))  (Qwen3_5RMSNorm: weight stored as an offset from 1)."""
    rows, cols, cmask, mask = _rows(n_rows, n_cols, BR, BN)
    xf = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w1 = 1.0 + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xf * _rstd(xf, n_cols, inv_n, eps)
    tl.store(out_ptr + rows * n_cols + cols, bf16_rtne(y * w1).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_bwd(x_ptr, w_ptr, g_ptr, dx_ptr, n_rows, n_cols, stride_x, inv_n, eps,
            BR: tl.constexpr, BN: tl.constexpr):
    """dx = bf16(rstd * dy - x * rstd^3 * mean(dy * x)),  dy = g * (1 + w)."""
    rows, cols, cmask, mask = _rows(n_rows, n_cols, BR, BN)
    xf = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w1 = 1.0 + tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    r = _rstd(xf, n_cols, inv_n, eps)
    dy = g * w1
    c = tl.sum(dy * xf, axis=1)[:, None] * inv_n
    dx = r * dy - xf * (r * r * r * c)
    tl.store(dx_ptr + rows * n_cols + cols, bf16_rtne(dx).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_fwd(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_x, stride_z, inv_n, eps,
              ROUND_HW: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """out = bf16(hw * silu(z)),  hw = w * bf16(x * rstd) (rounded to BF16 when w is BF16: ROUND_HW)."""
    rows, cols, cmask, mask = _rows(n_rows, n_cols, BR, BN)
    xf = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(z_ptr + rows * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    nb = bf16_rtne(xf * _rstd(xf, n_cols, inv_n, eps))
    hw = w * nb
    if ROUND_HW:
        hw = bf16_rtne(hw)
    tl.store(out_ptr + rows * n_cols + cols, bf16_rtne(hw * _silu(zf)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_bwd(x_ptr, z_ptr, w_ptr, g_ptr, dx_ptr, dz_ptr, n_rows, n_cols, stride_x, stride_z, inv_n, eps,
              ROUND_HW: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """Input gradients of gated_fwd, rounded where autograd casts them (to the BF16 of hw, nb, x and z)."""
    rows, cols, cmask, mask = _rows(n_rows, n_cols, BR, BN)
    xf = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(z_ptr + rows * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    r = _rstd(xf, n_cols, inv_n, eps)
    nb = bf16_rtne(xf * r)
    hw = w * nb
    if ROUND_HW:
        hw = bf16_rtne(hw)
    e1 = 1.0 + tl.exp(-zf)
    sig = tl.math.div_rn(tl.full(e1.shape, 1.0, tl.float32), e1)
    sg = tl.math.div_rn(zf, e1)
    d_hw = g * sg
    if ROUND_HW:
        d_hw = bf16_rtne(d_hw)
    d_n = bf16_rtne(d_hw * w)
    c = tl.sum(d_n * xf, axis=1)[:, None] * inv_n
    dx = r * d_n - xf * (r * r * r * c)
    tl.store(dx_ptr + rows * n_cols + cols, bf16_rtne(dx).to(dx_ptr.dtype.element_ty), mask=mask)
    dz = (g * hw) * (sig * (1.0 + zf * (1.0 - sig)))
    tl.store(dz_ptr + rows * n_cols + cols, bf16_rtne(dz).to(dz_ptr.dtype.element_ty), mask=mask)
