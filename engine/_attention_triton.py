"""Triton kernels of engine/attention_kernels.py (imported only when the fused decode attention is used: Triton is
optional). Split-key attention of short queries over a long static K/V cache, grouped by KV head: pass 1 gives each
(batch, KV head, key split, block of query rows) an unnormalized partial result with its running max and sum; pass 2
combines the splits. Scores are BF16 x BF16 products accumulated in FP32 (exact products, as the FP32 matmul of the
BF16 values); softmax and P @ V in FP32; masked scores are FP32's lowest finite value, like the PyTorch path's
masked_fill, so a row with no visible key averages all keys there as here."""

import triton
import triton.language as tl

from engine._adapter_triton import bf16_rtne


@triton.jit
def split_pass(q_ptr, k_ptr, v_ptr, m_ptr, po_ptr, pm_ptr, pl_ptr,
               R, Q, L, G, KVH, S, scaling, fmin,
               sqb, sqh, sqq, skb, skh, skl, svb, svh, svl, smb, smq, sml,
               HD: tl.constexpr, HDP: tl.constexpr, BR: tl.constexpr, BL: tl.constexpr, BLOCKS: tl.constexpr,
               DOT_F32: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    rb = tl.program_id(2)
    b = bh // KVH
    h = bh % KVH
    rows = rb * BR + tl.arange(0, BR)  # row r of this KV head's group: query head h*G + r // Q, query token r % Q
    rmask = rows < R
    head = h * G + rows // Q
    qi = rows % Q
    d = tl.arange(0, HDP)
    dmask = d < HD
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head[:, None].to(tl.int64) * sqh + qi[:, None] * sqq + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full((BR,), float("-inf"), tl.float32)
    l_i = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, HDP), tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    m_base = m_ptr + b.to(tl.int64) * smb
    for i in range(BLOCKS):
        cols = (split * BLOCKS + i) * BL + tl.arange(0, BL)
        cmask = cols < L
        k = tl.load(k_base + cols[:, None].to(tl.int64) * skl + d[None, :], mask=cmask[:, None] & dmask[None, :],
                    other=0.0)
        if DOT_F32:  # the interpreter's BF16 dot is wrong; the same exact products and FP32 sums, in FP32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee", out_dtype=tl.float32)
        else:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
        s = s * scaling  # (BR, BL)
        vis = tl.load(m_base + qi[:, None] * smq + cols[None, :] * sml, mask=rmask[:, None] & cmask[None, :],
                      other=0)
        s = tl.where(vis != 0, s, fmin)
        s = tl.where(cmask[None, :], s, float("-inf"))  # beyond the cache: no key at all
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block wholly past the cache end: no NaN
        alpha = tl.exp(m_i - m_exp)
        p = tl.exp(s - m_exp[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * svl + d[None, :], mask=cmask[:, None] & dmask[None, :],
                    other=0.0)
        # P = p1 + p2 + p3 exactly (three BF16 pieces hold FP32's 24 significant bits; each difference is exact)
        p1 = bf16_rtne(p)  # FP32 holding a BF16 value (the interpreter truncates on a cast; this rounds)
        r1 = p - p1
        p2 = bf16_rtne(r1)
        p3 = r1 - p2
        if DOT_F32:  # the same exact products and FP32 sums, in FP32 (the interpreter's BF16 dot is wrong)
            vf = v.to(tl.float32)
            pv = tl.dot(p1, vf, input_precision="ieee", out_dtype=tl.float32)
            pv += tl.dot(p2, vf, input_precision="ieee", out_dtype=tl.float32)
            pv += tl.dot(p3, vf, input_precision="ieee", out_dtype=tl.float32)
        else:
            pv = tl.dot(p1.to(tl.bfloat16), v, out_dtype=tl.float32)
            pv += tl.dot(p2.to(tl.bfloat16), v, out_dtype=tl.float32)
            pv += tl.dot(p3.to(tl.bfloat16), v, out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    part = (bh * S + split) * R + rows  # (B*KVH, S, R) rows of the partials
    tl.store(pm_ptr + part, m_i, mask=rmask)
    tl.store(pl_ptr + part, l_i, mask=rmask)
    tl.store(po_ptr + part[:, None].to(tl.int64) * HDP + d[None, :], acc, mask=rmask[:, None])


@triton.jit
def combine_pass(po_ptr, pm_ptr, pl_ptr, out_ptr, R, Q, G, KVH, S, sob, soq, soh,
                 HD: tl.constexpr, HDP: tl.constexpr, BR: tl.constexpr):
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    rows = rb * BR + tl.arange(0, BR)
    rmask = rows < R
    d = tl.arange(0, HDP)
    m = tl.full((BR,), float("-inf"), tl.float32)
    for s in range(S):
        ms = tl.load(pm_ptr + (bh * S + s) * R + rows, mask=rmask, other=float("-inf"))
        m = tl.maximum(m, ms)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, HDP), tl.float32)
    for s in range(S):
        part = (bh * S + s) * R + rows
        ms = tl.load(pm_ptr + part, mask=rmask, other=float("-inf"))
        w = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))  # a split with no key (past the cache end)
        l += w * tl.load(pl_ptr + part, mask=rmask, other=0.0)
        o = tl.load(po_ptr + part[:, None].to(tl.int64) * HDP + d[None, :], mask=rmask[:, None], other=0.0)
        acc += w[:, None] * o
    out = acc / l[:, None]
    head = h * G + rows // Q
    qi = rows % Q
    dst = out_ptr + b.to(tl.int64) * sob + qi[:, None] * soq + head[:, None].to(tl.int64) * soh + d[None, :]
    tl.store(dst, bf16_rtne(out).to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < HD)[None, :])
