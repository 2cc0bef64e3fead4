"""Triton kernel of engine/gdn_step.py (imported only where Triton is)."""

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20): x above the threshold, else log(1 + exp(x))
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def gdn_step(x_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, h_ptr, o_ptr, x_stride, ab_stride, qdiv, eps,
             H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """One token of the gated delta rule for one (row, value head, block of BV value columns), in place.

    x (rows, 2*H*K + HV*V): the conv's output, q | k | v heads side by side (row stride x_stride); a, b (rows, HV): the
    raw gate projections (row stride ab_stride); h (rows, HV, K, V) FP32: the state, read and written here; o (rows,
    HV, V) BF16: the output (rounded to nearest even, as PyTorch rounds; also under the interpreter). The arithmetic of transformers' module + torch_recurrent_gated_delta_rule, in FP32:
        beta = bf16(sigmoid(b))           g = -exp(A_log) * softplus(a + dt_bias)
        q, k = l2norm (x * rsqrt(sum x^2 + eps)), q /= sqrt(K); key head of value head hv: hv // (HV // H)
        h *= exp(g);  delta = (v - sum_k h * k) * beta;  h += k delta^T;  o = sum_k h * q
    """
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    iv = pid % NV
    nh = pid // NV
    n = nh // HV
    hv = nh % HV
    hk = hv // (HV // H)
    ok = tl.arange(0, K)
    ov = iv * BV + tl.arange(0, BV)
    row = x_ptr + n.to(tl.int64) * x_stride
    q = tl.load(row + hk * K + ok).to(tl.float32)
    k = tl.load(row + H * K + hk * K + ok).to(tl.float32)
    v = tl.load(row + 2 * H * K + hv * V + ov).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    q = q / qdiv
    bb = tl.load(b_ptr + n.to(tl.int64) * ab_stride + hv).to(tl.float32)
    beta = bf16_rtne(1.0 / (1.0 + tl.exp(-bb)))
    aa = tl.load(a_ptr + n.to(tl.int64) * ab_stride + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * _softplus(aa)
    hp = h_ptr + ((n.to(tl.int64) * HV + hv) * K + ok[:, None]) * V + ov[None, :]
    h = tl.load(hp) * tl.exp(g)
    delta = (v - tl.sum(h * k[:, None], 0)) * beta
    h = h + k[:, None] * delta[None, :]
    o = tl.sum(h * q[:, None], 0)
    tl.store(hp, h)
    tl.store(o_ptr + (n.to(tl.int64) * HV + hv) * V + ov, bf16_rtne(o).to(o_ptr.dtype.element_ty))
