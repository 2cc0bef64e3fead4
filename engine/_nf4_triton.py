"""Triton kernels of engine/nf4_kernels.py (imported only when the NF4 small-batch kernel is used: Triton is optional).

y = x W^T for a handful of rows x (BF16) and an NF4 weight W packed by bitsandbytes: byte j of the flattened
(out, in) weight holds element 2j in its high nibble and 2j+1 in its low one; one absmax per BLOCKSIZE consecutive
elements. The absmax arrive as FP32 values already decoded from a nested (double-quantized) state exactly as
dequantize_4bit decodes them (engine.nf4_kernels.NF4Weight.absmax32), so no weight waits on a chain of dependent
gathers. Each weight is dequantized in registers exactly as dequantize_4bit does it -- w = BF16(nf4[c] * absmax),
one FP32 product rounded to nearest even -- so the products with x are those of the dequantize-then-matmul path and
only the order of the FP32 sums differs.

`nf4_small_gemm` splits the input dimension over SPLITS programs per block of output features (enough programs to
keep HBM busy: a 4-row step is a matrix-vector product) and writes FP32 partial sums; `nf4_reduce` adds the splits
in a fixed order, the bias, and rounds once to BF16. With one split the first kernel rounds and writes the output
itself. The layout (and so the order of the sums) depends on the shape and engine.nf4_kernels.CONFIG only."""

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne


@triton.jit
def _nf4_levels(packed, lut_ptr, LUT: tl.constexpr):
    """The NF4 levels (FP32) of a packed byte's two codes: (even element's = high nibble, odd element's = low).
    LUT "pairs": one 8-byte gather per byte from the 256-entry table of both levels' FP32 bits (L1-resident);
    "gather": one 4-byte gather per code from the 16-entry table; "select": a tree of selects over each code's bits
    among the 16 values held in registers."""
    if LUT == "pairs":
        v = tl.load(lut_ptr + packed.to(tl.int32))
        hi = v.to(tl.int32).to(tl.float32, bitcast=True)
        lo = (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        return hi, lo
    else:
        sel: tl.constexpr = LUT == "select"
        return _nf4_value((packed >> 4) & 15, lut_ptr, sel), _nf4_value(packed & 15, lut_ptr, sel)


@triton.jit
def _nf4_value(c, lut_ptr, LUT_SELECT: tl.constexpr):
    """The NF4 level of 4-bit codes c: a gather from the 16-entry table (L1-resident), or a tree of selects over the
    code's bits among the 16 values held in registers."""
    if LUT_SELECT:
        b0 = (c & 1) != 0
        b1 = (c & 2) != 0
        b2 = (c & 4) != 0
        b3 = (c & 8) != 0
        v01 = tl.where(b0, tl.load(lut_ptr + 1), tl.load(lut_ptr + 0))
        v23 = tl.where(b0, tl.load(lut_ptr + 3), tl.load(lut_ptr + 2))
        v45 = tl.where(b0, tl.load(lut_ptr + 5), tl.load(lut_ptr + 4))
        v67 = tl.where(b0, tl.load(lut_ptr + 7), tl.load(lut_ptr + 6))
        v89 = tl.where(b0, tl.load(lut_ptr + 9), tl.load(lut_ptr + 8))
        vab = tl.where(b0, tl.load(lut_ptr + 11), tl.load(lut_ptr + 10))
        vcd = tl.where(b0, tl.load(lut_ptr + 13), tl.load(lut_ptr + 12))
        vef = tl.where(b0, tl.load(lut_ptr + 15), tl.load(lut_ptr + 14))
        v03 = tl.where(b1, v23, v01)
        v47 = tl.where(b1, v67, v45)
        v8b = tl.where(b1, vab, v89)
        vcf = tl.where(b1, vef, vcd)
        v07 = tl.where(b2, v47, v03)
        v8f = tl.where(b2, vcf, v8b)
        return tl.where(b3, v8f, v07)
    else:
        return tl.load(lut_ptr + c)


@triton.jit
def _to_bf16(x, SOFT_ROUND: tl.constexpr):
    """FP32 -> BF16, round to nearest even: the hardware conversion, or written out (Triton's interpreter truncates)."""
    if SOFT_ROUND:
        return bf16_rtne(x).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _dot2(acc, x_even, x_odd, w_hi, w_lo, MMA: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + x_even w_hi^T + x_odd w_lo^T, FP32 sums of exact products: on tensor cores (MMA), or as FP32 products
    summed along the input in registers (a few rows: no operand shuffle through shared memory)."""
    if not MMA:
        acc += tl.sum(x_even.to(tl.float32)[:, None, :] * w_hi.to(tl.float32)[None, :, :], axis=2)
        acc += tl.sum(x_odd.to(tl.float32)[:, None, :] * w_lo.to(tl.float32)[None, :, :], axis=2)
    elif DOT_F32:  # the interpreter's BF16 dot is wrong; the same exact products and FP32 sums, in FP32
        acc += tl.dot(x_even.to(tl.float32), tl.trans(w_hi.to(tl.float32)), input_precision="ieee",
                      out_dtype=tl.float32)
        acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_lo.to(tl.float32)), input_precision="ieee",
                      out_dtype=tl.float32)
    else:
        acc += tl.dot(x_even, tl.trans(w_hi), out_dtype=tl.float32)
        acc += tl.dot(x_odd, tl.trans(w_lo), out_dtype=tl.float32)
    return acc


@triton.jit
def _accumulate(acc, packed, a, lut_ptr, x_ptr, m, mmask, sx, kk, kmask, LUT: tl.constexpr, MMA: tl.constexpr,
                DOT_F32: tl.constexpr):
    """acc + the products of rows m with the weights of packed bytes kk (absmax a): dequantized as dequantize_4bit
    does -- BF16(level * absmax) -- then the even elements with x's even columns, the odd ones with its odd columns.
    LUT "shuffle" (a is one absmax per row): the 16 dequantized values of each row's block are computed once and
    each weight gathers its own from that per-row table in registers (tl.gather); the same products, rounded the
    same way, so the weights are the same bits."""
    if LUT == "shuffle":
        levels = tl.load(lut_ptr + tl.arange(0, 16))
        tab = _to_bf16(levels[None, :] * a, DOT_F32)  # (rows, 16): BF16(nf4[c] * absmax) for every code c
        w_hi = tl.gather(tab, ((packed >> 4) & 15).to(tl.int32), axis=1)
        w_lo = tl.gather(tab, (packed & 15).to(tl.int32), axis=1)
    else:
        v_hi, v_lo = _nf4_levels(packed, lut_ptr, LUT)
        w_hi = _to_bf16(v_hi * a, DOT_F32)
        w_lo = _to_bf16(v_lo * a, DOT_F32)
    xmask = mmask[:, None] & kmask[None, :]
    x_row = x_ptr + m[:, None].to(tl.int64) * sx + 2 * kk[None, :]
    x_even = tl.load(x_row, mask=xmask, other=0.0)
    x_odd = tl.load(x_row + 1, mask=xmask, other=0.0)
    return _dot2(acc, x_even, x_odd, w_hi, w_lo, MMA, DOT_F32)


@triton.jit
def nf4_small_gemm(x_ptr, w_ptr, am_ptr, lut_ptr, bias_ptr, out_ptr, part_ptr,
                   M, N, K, sx, so, KS,
                   HAS_BIAS: tl.constexpr, BLOCKSIZE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, FINAL: tl.constexpr, LUT: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                   MMA: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (p, s, r): output features [p*BN, (p+1)*BN) for rows [r*BM, (r+1)*BM), input elements [s*KS, (s+1)*KS)
    in steps of BK (even elements x_even with the high nibbles, odd ones with the low nibbles). ROW_BLOCKS (the width
    is a multiple of the absmax block): each step is BK / BLOCKSIZE blocks, one absmax load per row and block,
    broadcast in registers; else one absmax gather per packed byte. FINAL (one split):
    add the bias, round and store the output; else store FP32 partials (splits, M, N)."""
    pid_s = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    mmask = m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    KH = K // 2
    k_lo = pid_s * KS
    k_hi = tl.minimum(k_lo + KS, K)
    if ROW_BLOCKS:  # K % BLOCKSIZE == 0: every absmax block lies in one row; one absmax load per (row, block)
        HB: tl.constexpr = BLOCKSIZE // 2
        jb = tl.arange(0, HB)
        wrow = w_ptr + n.to(tl.int64) * KH
        arow = am_ptr + n.to(tl.int64) * (K // BLOCKSIZE)
        for k0 in range(k_lo, k_hi, BK):
            for b in tl.static_range(BK // BLOCKSIZE):
                kb0 = k0 + b * BLOCKSIZE  # the block's first element
                kk = kb0 // 2 + jb
                ok = kk < k_hi // 2  # (HB,): the whole block is in the split or none of it
                packed = tl.load(wrow[:, None] + kk[None, :], mask=nmask[:, None] & ok[None, :], other=0)
                a = tl.load(arow + kb0 // BLOCKSIZE, mask=nmask & (n * 0 + kb0 < k_hi), other=0.0)[:, None]
                acc = _accumulate(acc, packed, a, lut_ptr, x_ptr, m, mmask, sx, kk, ok, LUT, MMA, DOT_F32)
    else:  # blocks straddle rows: each weight's absmax by its flattened index
        j = tl.arange(0, BK // 2)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 // 2 + j  # packed byte within the row
            kmask = kk < k_hi // 2
            wmask = nmask[:, None] & kmask[None, :]
            packed = tl.load(w_ptr + n[:, None].to(tl.int64) * KH + kk[None, :], mask=wmask, other=0)
            a = tl.load(am_ptr + (n[:, None].to(tl.int64) * K + 2 * kk[None, :]) // BLOCKSIZE, mask=wmask,
                        other=0.0)
            acc = _accumulate(acc, packed, a, lut_ptr, x_ptr, m, mmask, sx, kk, kmask, LUT, MMA, DOT_F32)
    if FINAL:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + m[:, None].to(tl.int64) * so + n[None, :]
        tl.store(dst, bf16_rtne(acc).to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
    else:
        dst = part_ptr + (pid_s * M + m[:, None]).to(tl.int64) * N + n[None, :]
        tl.store(dst, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def nf4_reduce(part_ptr, bias_ptr, out_ptr, M, N, S, so, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """Program (row, p): the sum of the splits' partials in split order, plus the bias, rounded once to BF16."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + n, mask=nmask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * so + n, bf16_rtne(acc).to(out_ptr.dtype.element_ty), mask=nmask)
