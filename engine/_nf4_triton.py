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

import struct

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne
from engine.nf4_kernels import NF4_TABLE


def _f32(v: float) -> str:
    """A Python float as PTX's exact FP32 immediate (0fXXXXXXXX, the value rounded to FP32)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


# LUT "prmt" (CUDA only; NF4 weights whose table is NF4_TABLE, checked by engine.nf4_kernels): per row and absmax
# block, the 16 dequantized values BF16(nf4[c] * absmax) are computed once (16 FP32 products, rounded as
# dequantize_4bit rounds them) and laid out as two byte planes of four 32-bit registers (low bytes L0..L3, high bytes
# H0..H3; entry c in byte c % 4 of register c // 4); then every packed 32-bit word (8 codes) is looked up with byte
# permutes: per plane one prmt over entries 0-7, one over 8-15 and one choosing between them by the code's bit 3,
# and two prmt interleave the planes into BF16 pairs -- 12 integer instructions per 4 weights, no shuffles or selects.
TABLE_ASM = tl.constexpr("{\n.reg .f32 f<16>;\n.reg .b32 p<8>;\n" + "".join(
    f"mul.rn.f32 f{c}, $8, {_f32(v)};\n" for c, v in enumerate(NF4_TABLE)) + "".join(
    f"cvt.rn.bf16x2.f32 p{j}, f{2 * j + 1}, f{2 * j};\n" for j in range(8)) + "".join(
    f"prmt.b32 ${i}, p{2 * i}, p{2 * i + 1}, 0x6420;\n" for i in range(4)) + "".join(
    f"prmt.b32 ${4 + i}, p{2 * i}, p{2 * i + 1}, 0x7531;\n" for i in range(4)) + "}")

# pack=2 (two consecutive elements of a row: in every layout Triton gives these tiles, including the MMA operand
# layouts, a thread's element pairs lie along the input; four may span two rows): $0 the two even elements' BF16
# pair, $1 the odd ones'; $2 two packed bytes (low 16 bits); then each plane register as two operands (one per
# element, equal: one row and block) -- the first is used.
LOOKUP_CONSTRAINTS = tl.constexpr("=r,=r," + ",".join(["r"] * 17))
_L = [f"${3 + 2 * i}" for i in range(4)]
_H = [f"${11 + 2 * i}" for i in range(4)]
LOOKUP_ASM = tl.constexpr(
    "{\n.reg .b32 s, m, x, y, zl, zh;\n"
    "and.b32 s, $2, 0x7777;\nshr.b32 m, $2, 1;\nand.b32 m, m, 0x4444;\nor.b32 m, m, 0x3210;\n"
    f"prmt.b32 x, {_L[0]}, {_L[1]}, s;\nprmt.b32 y, {_L[2]}, {_L[3]}, s;\nprmt.b32 zl, x, y, m;\n"
    f"prmt.b32 x, {_H[0]}, {_H[1]}, s;\nprmt.b32 y, {_H[2]}, {_H[3]}, s;\nprmt.b32 zh, x, y, m;\n"
    "prmt.b32 $0, zl, zh, 0x7351;\nprmt.b32 $1, zl, zh, 0x6240;\n}")


@triton.jit
def _prmt_weights(packed, a):
    """The BF16 weights of packed bytes (BN, HB) of one absmax block per row (a: (BN, 1) FP32), even elements (high
    nibbles) and odd ones, through the per-row table and byte permutes of TABLE_ASM / LOOKUP_ASM."""
    t = tl.inline_asm_elementwise(TABLE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [a],
                                  dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    args = [packed, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]]  # the planes broadcast along the block
    return tl.inline_asm_elementwise(LOOKUP_ASM, LOOKUP_CONSTRAINTS, args,
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


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
def _weights(packed, a, lut_ptr, LUT: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """The BF16 weights of packed bytes (rows, bytes) with their absmax a -- one per row and block ((rows, 1): every
    lookup) or one per byte (the level-then-product lookups) -- even elements (high nibbles) and odd ones (low
    nibbles), each BF16(nf4[c] * absmax) as dequantize_4bit rounds it. "prmt": byte permutes in inline PTX (the
    interpreter runs no PTX: it takes "shuffle", the same weights); "shuffle": each row's 16 values computed once and
    gathered in registers; otherwise the level first ("gather", "pairs", "select"), then the product."""
    if LUT == "prmt" and not SOFT_ROUND:
        w_hi, w_lo = _prmt_weights(packed, a)
    elif LUT == "shuffle" or LUT == "prmt":
        levels = tl.load(lut_ptr + tl.arange(0, 16))
        tab = _to_bf16(levels[None, :] * a, SOFT_ROUND)  # (rows, 16): BF16(nf4[c] * absmax) for every code c
        w_hi = tl.gather(tab, ((packed >> 4) & 15).to(tl.int32), axis=1)
        w_lo = tl.gather(tab, (packed & 15).to(tl.int32), axis=1)
    else:
        v_hi, v_lo = _nf4_levels(packed, lut_ptr, LUT)
        w_hi = _to_bf16(v_hi * a, SOFT_ROUND)
        w_lo = _to_bf16(v_lo * a, SOFT_ROUND)
    return w_hi, w_lo


@triton.jit
def _program_rows(w_ptr, am_ptr, N, K, KS, BN: tl.constexpr, BLOCKSIZE: tl.constexpr):
    """Program (p, s, ...) of the row-block forms: split s, output features n = [p*BN, (p+1)*BN) and their mask, the
    split's end k_hi (it starts at s*KS), each row's packed bytes and absmax."""
    pid_s = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k_hi = tl.minimum(pid_s * KS + KS, K)
    return (pid_s, n, n < N, k_hi, w_ptr + n.to(tl.int64) * (K // 2),
            am_ptr + n.to(tl.int64) * (K // BLOCKSIZE))


@triton.jit
def _row_block(wrow, arow, n, nmask, kb0, k_hi, HB: tl.constexpr, BLOCKSIZE: tl.constexpr):
    """One absmax block of every row of the tile (widths a multiple of the block): the packed bytes' indices kk (HB,),
    whether the block lies in this split (ok: uniform along the block, so the loads stay vectorized), the packed
    bytes (rows, HB) and the rows' absmax (rows, 1)."""
    kk = kb0 // 2 + tl.arange(0, HB)
    ok = tl.full((HB,), 1, tl.int1) & (kb0 < k_hi)  # the whole block is in the split or none of it
    packed = tl.load(wrow[:, None] + kk[None, :], mask=nmask[:, None] & ok[None, :], other=0)
    a = tl.load(arow + kb0 // BLOCKSIZE, mask=nmask & (n * 0 + kb0 < k_hi), other=0.0)[:, None]
    return kk, ok, packed, a


@triton.jit
def _accumulate(acc, packed, a, lut_ptr, x_ptr, m, mmask, sx, kk, kmask, LUT: tl.constexpr, MMA: tl.constexpr,
                DOT_F32: tl.constexpr):
    """acc + the products of rows m with the weights of packed bytes kk (absmax a): dequantized as dequantize_4bit
    does -- BF16(level * absmax) -- then the even elements with x's even columns, the odd ones with its odd columns.
    LUT "shuffle" (a is one absmax per row): the 16 dequantized values of each row's block are computed once and
    each weight gathers its own from that per-row table in registers (tl.gather); the same products, rounded the
    same way, so the weights are the same bits."""
    w_hi, w_lo = _weights(packed, a, lut_ptr, LUT, DOT_F32)
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
        wrow = w_ptr + n.to(tl.int64) * KH
        arow = am_ptr + n.to(tl.int64) * (K // BLOCKSIZE)
        for k0 in range(k_lo, k_hi, BK):
            for b in tl.static_range(BK // BLOCKSIZE):
                kk, ok, packed, a = _row_block(wrow, arow, n, nmask, k0 + b * BLOCKSIZE, k_hi, BLOCKSIZE // 2,
                                               BLOCKSIZE)
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


@triton.jit
def _row_fma(acc, x_row_ptr, kk, ok, w_hi, w_lo):
    """acc (BN, HB) + w_hi * x[2kk] + w_lo * x[2kk+1] for one row: FP32 products of BF16 values (exact), one FP32
    sum per weight, summed along the input only at the end (no cross-thread reduction per step)."""
    xe = tl.load(x_row_ptr + 2 * kk, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(x_row_ptr + 2 * kk + 1, mask=ok, other=0.0).to(tl.float32)
    return acc + w_hi * xe[None, :] + w_lo * xo[None, :]


@triton.jit
def nf4_gemv(x_ptr, w_ptr, am_ptr, lut_ptr, bias_ptr, out_ptr, part_ptr,
             M, N, K, sx, so, KS,
             HAS_BIAS: tl.constexpr, BLOCKSIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             FINAL: tl.constexpr, LUT: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """The "fma" form for widths that are a multiple of the absmax block (every 27B shape): a
    matrix-vector product written as one. Program (p, s, g): output features [p*BN, (p+1)*BN) of rows 4g..4g+3, input
    elements [s*KS, (s+1)*KS). Each weight is dequantized once and multiplied into four FP32 accumulators of the
    tile's shape (one per row: a row's sums never see another row's values), reduced along the input once at the
    end -- where the tensor-core form pads 4 rows to 16 and moves each dequantized tile into the operand layout."""
    pid_s, n, nmask, k_hi, wrow, arow = _program_rows(w_ptr, am_ptr, N, K, KS, BN, BLOCKSIZE)
    HB: tl.constexpr = BLOCKSIZE // 2
    acc0 = tl.zeros((BN, HB), dtype=tl.float32)
    acc1 = tl.zeros((BN, HB), dtype=tl.float32)
    acc2 = tl.zeros((BN, HB), dtype=tl.float32)
    acc3 = tl.zeros((BN, HB), dtype=tl.float32)
    r0 = tl.program_id(2) * 4  # rows r0..r0+3 (more rows: more programs, each row's arithmetic the same)
    x0 = x_ptr + r0.to(tl.int64) * sx
    x1 = x_ptr + tl.minimum(r0 + 1, M - 1).to(tl.int64) * sx  # rows past M read row M-1 and are never stored
    x2 = x_ptr + tl.minimum(r0 + 2, M - 1).to(tl.int64) * sx
    x3 = x_ptr + tl.minimum(r0 + 3, M - 1).to(tl.int64) * sx
    for k0 in range(pid_s * KS, k_hi, BK):
        for b in tl.static_range(BK // BLOCKSIZE):
            kk, ok, packed, a = _row_block(wrow, arow, n, nmask, k0 + b * BLOCKSIZE, k_hi, HB, BLOCKSIZE)
            w_hi, w_lo = _weights(packed, a, lut_ptr, LUT, SOFT_ROUND)
            w_hi, w_lo = w_hi.to(tl.float32), w_lo.to(tl.float32)  # exact
            acc0 = _row_fma(acc0, x0, kk, ok, w_hi, w_lo)
            acc1 = _row_fma(acc1, x1, kk, ok, w_hi, w_lo)
            acc2 = _row_fma(acc2, x2, kk, ok, w_hi, w_lo)
            acc3 = _row_fma(acc3, x3, kk, ok, w_hi, w_lo)
    _store_row(tl.sum(acc0, axis=1), r0 + 0, n, nmask, M, N, so, pid_s, bias_ptr, out_ptr, part_ptr, HAS_BIAS, FINAL)
    _store_row(tl.sum(acc1, axis=1), r0 + 1, n, nmask, M, N, so, pid_s, bias_ptr, out_ptr, part_ptr, HAS_BIAS, FINAL)
    _store_row(tl.sum(acc2, axis=1), r0 + 2, n, nmask, M, N, so, pid_s, bias_ptr, out_ptr, part_ptr, HAS_BIAS, FINAL)
    _store_row(tl.sum(acc3, axis=1), r0 + 3, n, nmask, M, N, so, pid_s, bias_ptr, out_ptr, part_ptr, HAS_BIAS, FINAL)


@triton.jit
def _store_row(y, r, n, nmask, M, N, so, pid_s, bias_ptr, out_ptr, part_ptr, HAS_BIAS: tl.constexpr,
               FINAL: tl.constexpr):
    """Row r's sums (BN,): FINAL adds the bias, rounds and stores the output; else stores the FP32 partials."""
    keep = nmask & (n * 0 + r < M)
    if FINAL:
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * so + n, bf16_rtne(y).to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(part_ptr + (pid_s * M + r).to(tl.int64) * N + n, y, mask=keep)


@triton.jit
def nf4_wdot(x_ptr, w_ptr, am_ptr, lut_ptr, bias_ptr, out_ptr, part_ptr,
             M, N, K, sx, so, KS,
             HAS_BIAS: tl.constexpr, BLOCKSIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             FINAL: tl.constexpr, LUT: tl.constexpr, DOT_F32: tl.constexpr):
    """The "wdot" form (widths a multiple of the absmax block): the transposed product on tensor cores, out^T (BN, 16)
    = W (BN, BK) x^T (BK, 16), so the dequantized weights are the MMA's first operand (taken from registers) and the
    few rows, padded to 16, the second -- where nf4_small_gemm makes the weights the second operand. Same weights,
    exact products, FP32 sums; rows are columns of the MMA, so a row's sums never see another row's values."""
    pid_s, n, nmask, k_hi, wrow, arow = _program_rows(w_ptr, am_ptr, N, K, KS, BN, BLOCKSIZE)
    m = tl.arange(0, 16)
    mmask = m < M
    HB: tl.constexpr = BLOCKSIZE // 2
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in range(pid_s * KS, k_hi, BK):
        for b in tl.static_range(BK // BLOCKSIZE):
            kk, ok, packed, a = _row_block(wrow, arow, n, nmask, k0 + b * BLOCKSIZE, k_hi, HB, BLOCKSIZE)
            w_hi, w_lo = _weights(packed, a, lut_ptr, LUT, DOT_F32)
            xm = ok[:, None] & mmask[None, :]
            xcol = x_ptr + m[None, :].to(tl.int64) * sx + 2 * kk[:, None]
            xe = tl.load(xcol, mask=xm, other=0.0)  # (HB, 16): x^T's even inputs
            xo = tl.load(xcol + 1, mask=xm, other=0.0)
            if DOT_F32:
                acc += tl.dot(w_hi.to(tl.float32), xe.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
                acc += tl.dot(w_lo.to(tl.float32), xo.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(w_hi, xe, out_dtype=tl.float32)
                acc += tl.dot(w_lo, xo, out_dtype=tl.float32)
    # acc (BN, 16): column r is row r's sums
    if FINAL:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        dst = out_ptr + m[None, :].to(tl.int64) * so + n[:, None]
        tl.store(dst, bf16_rtne(acc).to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])
    else:
        dst = part_ptr + (pid_s * M + m[None, :]).to(tl.int64) * N + n[:, None]
        tl.store(dst, acc, mask=nmask[:, None] & mmask[None, :])
