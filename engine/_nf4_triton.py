"""Triton kernel of engine/nf4_kernels.py (imported only when the NF4 small-batch kernel is used: Triton is optional).

y = x W^T for a handful of rows x (BF16) and an NF4 weight W packed by bitsandbytes: byte j of the flattened
(out, in) weight holds element 2j in its high nibble and 2j+1 in its low one; one absmax per BLOCKSIZE consecutive
elements, itself 8-bit quantized per BLOCKSIZE2 absmax values when nested ("double quantization"). Each weight is
dequantized in registers exactly as bitsandbytes' dequantize_4bit does it -- absmax = code2[q] * absmax2 + offset
(two FP32 roundings), w = BF16(nf4[c] * absmax) -- so the products are those of the dequantize-then-matmul path;
only the order of the FP32 sums differs. Launched with enable_fp_fusion=False (no multiply-add contraction)."""

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne


@triton.jit
def nf4_small_gemm(x_ptr, w_ptr, am_ptr, am2_ptr, code2_ptr, lut_ptr, bias_ptr, out_ptr,
                   M, N, K, sx, so, offset,
                   NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCKSIZE: tl.constexpr,
                   BLOCKSIZE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """Program p: output features [p*BN, (p+1)*BN) for every row (at most BM), the whole input dimension in steps
    of BK (even elements x_even with the high nibbles, odd ones with the low nibbles)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    m = tl.arange(0, BM)
    mmask = m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    KH = K // 2
    j = tl.arange(0, BK // 2)
    for k0 in range(0, K, BK):
        kk = k0 // 2 + j  # packed byte within the row
        kmask = kk < KH
        wmask = nmask[:, None] & kmask[None, :]
        packed = tl.load(w_ptr + n[:, None].to(tl.int64) * KH + kk[None, :], mask=wmask, other=0)
        hi = (packed >> 4) & 15
        lo = packed & 15
        blk = (n[:, None].to(tl.int64) * K + 2 * kk[None, :]) // BLOCKSIZE
        if NESTED:
            q8 = tl.load(am_ptr + blk, mask=wmask, other=0)
            a2 = tl.load(am2_ptr + blk // BLOCKSIZE2, mask=wmask, other=0.0)
            a = tl.load(code2_ptr + q8, mask=wmask, other=0.0) * a2 + offset
        else:
            a = tl.load(am_ptr + blk, mask=wmask, other=0.0)
        w_hi = bf16_rtne(tl.load(lut_ptr + hi, mask=wmask, other=0.0) * a)
        w_lo = bf16_rtne(tl.load(lut_ptr + lo, mask=wmask, other=0.0) * a)
        xmask = mmask[:, None] & kmask[None, :]
        x_row = x_ptr + m[:, None].to(tl.int64) * sx + 2 * kk[None, :]
        x_even = tl.load(x_row, mask=xmask, other=0.0)
        x_odd = tl.load(x_row + 1, mask=xmask, other=0.0)
        if DOT_F32:  # the interpreter's BF16 dot is wrong; the same exact products and FP32 sums, in FP32
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_hi), input_precision="ieee", out_dtype=tl.float32)
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_lo), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x_even, tl.trans(w_hi.to(tl.bfloat16)), out_dtype=tl.float32)
            acc += tl.dot(x_odd, tl.trans(w_lo.to(tl.bfloat16)), out_dtype=tl.float32)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + m[:, None].to(tl.int64) * so + n[None, :]
    tl.store(dst, bf16_rtne(acc).to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
