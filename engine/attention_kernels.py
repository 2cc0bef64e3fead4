"""Decode attention on CUDA: short queries over the long static K/V cache in two Triton kernels, reading K and V in
BF16 where they lie.

Why: engine.cuda_graphs.gqa_attention (the PyTorch path) computes scores, softmax and P @ V in FP32, so every step
casts each attention layer's whole K and V buffers (batch x KV heads x capacity x head_dim) to FP32 copies and then
runs cuBLAS's FP32 batched GEMV over them. Measured on one H200 at the 27B shape (batch 4, 4k-position cache,
bench/results/h200-recipe-27b-nf4-step-kernels-2026-12-02.json): ~3.3 ms of a 26.7 ms latent step in the FP32
GEMVs (gemmSN 2.4 ms, xmma 0.9 ms) plus the K/V casts inside 1.7 ms of cast copies -- for ~1 GB of BF16 K/V that
HBM reads in ~0.2 ms.

What: pass 1 (`split_pass`) runs one program per (batch row, KV head, key split of CONFIG["split_keys"] positions,
block of CONFIG["rows"] query rows): the query heads of a KV head are one block of rows (no repeat_kv), scores are
BF16 x BF16 products accumulated in FP32 -- the same exact products the PyTorch path's FP32 matmul forms from the
same BF16 values -- softmax runs online in FP32, and P @ V runs on tensor cores as three BF16 dots: P is split
exactly into P1 = BF16(P), P2 = BF16(P - P1), P3 = P - P1 - P2 (a 24-bit FP32 mantissa in three 8-bit parts), so
each product with a BF16 V value is exact and only the FP32 sums differ. Pass 2 (`combine_pass`) merges the splits
and rounds once to BF16 (round to nearest even, like `.to(bfloat16)`). Masked scores take FP32's lowest finite value
as masked_fill does there, so even a row that sees no key gives the PyTorch path's answer (the mean of V). Only the
order of the sums differs, so the result is as accurate as the PyTorch path, not bit for bit equal; the split layout
depends on the cache length only and the rows of a block do not mix, so a row's output does not depend on the batch
size or the number of query tokens around it. Graphed and eager static steps run the same kernels, so their bitwise
contract (engine/cuda_graphs.py) holds.

Status (one H200, bench/results/h200-kernel-sweep-2026-12-03.json, `python3 bench/kernel_sweep.py --only
attention`; batch 4, 24/4 heads, head dim 256, timed inside CUDA graphs): the layout sweep's best (256-key splits of
32-key blocks, 4 warps, 3 stages; CONFIG) takes 0.030 ms per layer at 4k positions and 0.059 ms at 8k -- 16 layers
0.48 / 0.94 ms against 5.13 / 9.77 ms on the PyTorch path (10.7x / 10.4x), 2.1x the HBM floor of reading the BF16
K/V once (0.22 / 0.45 ms) -- and qualifies at that layout (errors equal to the PyTorch path's to 7 digits; a row
alone and a token alone bit for bit). The first version (IEEE FP32 dot for P @ V) took 0.86 ms per layer.

Use: `install(mode, device)` once per process before a static decoder captures a graph (engine.runtime does, beside
the norm and adapter choices; model.attention_kernels). mode auto qualifies the kernels on the device against an
FP64 evaluation (relative L2 within 1.25x of the PyTorch path's error plus 1e-6, largest error within 2x; and a row
alone equal bit for bit to the same row in a batch) and uses them only if they pass, with one log line otherwise;
torch keeps the PyTorch path. On a CPU the PyTorch path runs; the kernels also run under TRITON_INTERPRET=1
(tests/test_attention_kernels.py).
"""

from __future__ import annotations

import logging

import torch

from engine.kernel_choice import as_accurate, choose, error_stats, interpret, qualification

log = logging.getLogger("lgrpo.attention")

_STATE: dict = {"devices": set(), "launches": 0}
_K: dict = {}
# The launch layout: key positions per program of pass 1 (split_keys = block_keys x blocks; the split layout depends on
# the cache length only), query rows (query heads of one KV head x query tokens) per program, warps and pipeline
# stages. bench/kernel_sweep.py times the alternatives on the GPU; the order of the sums follows split_keys and
# block_keys, so every choice is qualified as it is installed.
CONFIG = {"split_keys": 256, "block_keys": 32, "rows": 16, "warps": 4, "stages": 3}  # the H200 sweep's best
MAX_HEAD_DIM = 256


def _kernels() -> dict:
    if not _K:
        from engine import _attention_triton as T

        _K.update(split=T.split_pass, combine=T.combine_pass)
    return _K


def gqa_torch(query, key, value, attention_mask, scaling: float):
    """The PyTorch path (engine.cuda_graphs.gqa_attention's arithmetic): query (B, H, q, hd), key/value
    (B, kvh, L, hd), mask (B, 1, q, L) bool (True = attend), additive, or None. Returns (B, q, H, hd)."""
    B, H, q, hd = query.shape
    kvh, L = key.shape[1], key.shape[2]
    g = H // kvh
    qf = query.reshape(B, kvh, g * q, hd).float()
    w = torch.matmul(qf, key.transpose(-1, -2).float()) * scaling  # (B, kvh, g*q, L) fp32
    if attention_mask is not None:
        w = w.view(B, kvh, g, q, L)
        m = attention_mask[:, :, None]  # (B, 1, 1, q, L)
        w = w.masked_fill(~m, torch.finfo(w.dtype).min) if m.dtype == torch.bool else w + m.float()
        w = w.view(B, kvh, g * q, L)
    p = torch.softmax(w, dim=-1)
    out = torch.matmul(p, value.float()).to(query.dtype)  # (B, kvh, g*q, hd)
    return out.view(B, H, q, hd).transpose(1, 2).contiguous()


def gqa_fused(query, key, value, attention_mask, scaling: float):
    """The kernels: same arguments and result as gqa_torch, for BF16 query/key/value with unit last stride and a
    bool mask (or None)."""
    _need(query, key, value, attention_mask)
    import triton

    B, H, q, hd = query.shape
    kvh, L = key.shape[1], key.shape[2]
    g = H // kvh
    R = g * q
    HDP = max(16, triton.next_power_of_2(hd))
    cfg = CONFIG
    split, bl, rows = cfg["split_keys"], cfg["block_keys"], cfg["rows"]
    if split % bl:
        raise ValueError(f"attention_kernels.CONFIG: split_keys {split} is not a multiple of block_keys {bl}")
    blocks = split // bl
    S = triton.cdiv(L, split)
    rb = triton.cdiv(R, rows)
    dev = query.device
    if attention_mask is None:
        mask = torch.ones(1, dtype=torch.bool, device=dev)
        smb = smq = sml = 0
    else:
        mask = attention_mask
        if mask.shape[-1] != L:
            raise ValueError(f"attention mask covers {mask.shape[-1]} keys, the cache {L}")
        mask = mask.expand(B, 1, q, L)
        smb, smq, sml = mask.stride(0), mask.stride(2), mask.stride(3)
    po = torch.empty(B * kvh * S * R, HDP, dtype=torch.float32, device=dev)
    pm = torch.empty(B * kvh * S * R, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    out = torch.empty(B, q, H, hd, dtype=query.dtype, device=dev)
    k = _kernels()
    _STATE["launches"] += 1  # counted (tests check the fused path really ran)
    extra = {} if interpret() else {"num_warps": cfg["warps"], "num_stages": cfg["stages"]}
    k["split"][(B * kvh, S, rb)](
        query, key, value, mask, po, pm, pl, R, q, L, g, kvh, S, float(scaling), torch.finfo(torch.float32).min,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), smb, smq, sml,
        HD=hd, HDP=HDP, BR=rows, BL=bl, BLOCKS=blocks, DOT_F32=interpret(), **extra)
    k["combine"][(B * kvh, rb)](po, pm, pl, out, R, q, g, kvh, S, out.stride(0), out.stride(1), out.stride(2),
                                HD=hd, HDP=HDP, BR=rows, **({} if interpret() else {"num_warps": 4}))
    return out


def _need(query, key, value, mask) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"fused decode attention reads BF16; {name} is {t.dtype} (use the PyTorch path)")
        if t.stride(-1) != 1:
            raise ValueError(f"fused decode attention: {name} needs unit stride in its last dim, got {t.stride()}")
    if query.shape[-1] > MAX_HEAD_DIM or key.shape[-1] != query.shape[-1] or value.shape != key.shape:
        raise ValueError(f"fused decode attention: head dims {query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]} "
                         f"(equal, at most {MAX_HEAD_DIM})")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} KV heads")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"fused decode attention takes a bool mask, got {mask.dtype} (use the PyTorch path)")


def enabled(query: torch.Tensor, key: torch.Tensor, attention_mask) -> bool:
    """Use the kernels for this call: BF16 tensors on a device where install qualified them, a bool mask or none,
    head dim at most MAX_HEAD_DIM, not under autograd (decode only)."""
    return (query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16 and (query.is_cuda or interpret())
            and str(query.device) in _STATE["devices"] and query.shape[-1] <= MAX_HEAD_DIM
            and (attention_mask is None or attention_mask.dtype == torch.bool)
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)))


def attention(query, key, value, attention_mask, scaling: float):
    """(B, q, H, hd): the kernels where enabled, else the PyTorch path."""
    if (enabled(query, key, attention_mask) and query.stride(-1) == 1 and key.stride(-1) == 1
            and value.stride(-1) == 1):
        return gqa_fused(query, key, value, attention_mask, scaling)
    return gqa_torch(query, key, value, attention_mask, scaling)


# -- qualification -------------------------------------------------------------------------------------------------------

def _ref64(query, key, value, mask, scaling: float):
    B, H, q, hd = query.shape
    kvh, L = key.shape[1], key.shape[2]
    g = H // kvh
    w = torch.matmul(query.double().reshape(B, kvh, g * q, hd), key.double().transpose(-1, -2)) * scaling
    w = w.view(B, kvh, g, q, L)
    if mask is not None:
        w = w.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    p = torch.softmax(w.view(B, kvh, g * q, L), dim=-1)
    return torch.matmul(p, value.double()).view(B, H, q, hd).transpose(1, 2)


TOLERANCE = (1.25, 1e-6)  # the kernels' relative L2 error vs FP64 <= 1.25 x the PyTorch path's + 1e-6
MAX_ABS_FACTOR = 2.0  # and their largest elementwise error <= 2 x the PyTorch path's (+ 1e-6)

# (batch, query heads, KV heads, query tokens, keys, head dim): the 27B shape's decode and a short prefill, the tiny
# model's, an odd cache length (a split past its end), odd head dim, many splits
CASES = ((4, 24, 4, 1, 4096, 256), (4, 24, 4, 5, 1000, 256), (2, 8, 2, 1, 300, 64), (3, 4, 1, 64, 129, 32),
         (1, 6, 2, 1, 77, 96), (2, 16, 4, 2, 2100, 128))


def qualify(device, cases=CASES) -> dict:
    """The kernels against gqa_torch on random data, measured against FP64: causal masks with left padding, a row
    that sees no key, queries as the model lays them out (a transposed view), keys from a larger static buffer.
    Passed: within TOLERANCE / MAX_ABS_FACTOR of the PyTorch path's error, finite, and a batch row alone (and the
    last query token alone) equal bit for bit to the same row (token) computed among the others."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)

    def check(B, H, kvh, q, L, hd) -> dict:
        query = rnd(B, q, H, hd, scale=2.0).transpose(1, 2)  # the model's layout: a view of (B, q, H, hd)
        kbuf, vbuf = rnd(B, kvh, L + 7, hd, scale=2.0), rnd(B, kvh, L + 7, hd)
        key, value = kbuf[:, :, :L], vbuf[:, :, :L]  # strided rows, like a view of a longer buffer
        pad = torch.randint(0, max(1, L // 3), (B,), generator=gen)
        cols = torch.arange(L)
        last = L - q + torch.arange(q)  # query token i sits at position L - q + i
        mask = (cols[None, None, :] >= pad[:, None, None]) & (cols[None, None, :] <= last[None, :, None])
        mask = mask[:, None].to(device)  # (B, 1, q, L)
        if B > 1:
            mask[1, 0, 0] = False  # a query that sees no key: the mean of V on both paths
        scaling = hd ** -0.5
        k_out = gqa_fused(query, key, value, mask, scaling)
        t_out = gqa_torch(query, key, value, mask, scaling)
        e = error_stats(k_out, t_out, _ref64(query, key, value, mask, scaling).to(k_out.device))
        one = gqa_fused(query[-1:], key[-1:], value[-1:], mask[-1:], scaling)
        tok = gqa_fused(query[:, :, -1:], key, value, mask[:, :, -1:], scaling)  # the last query token alone
        case = {"batch": B, "heads": H, "kv_heads": kvh, "queries": q, "keys": L, "head_dim": hd, **e,
                "equal_to_torch": float((k_out == t_out).float().mean()),
                "row_alone_bitwise": bool(torch.equal(one[0], k_out[-1])),
                "token_alone_bitwise": bool(torch.equal(tok[:, 0], k_out[:, -1]))}
        case["passed"] = (as_accurate(e, TOLERANCE, MAX_ABS_FACTOR) and case["row_alone_bitwise"]
                          and bool(torch.isfinite(k_out).all()) and case["token_alone_bitwise"])
        return case

    return qualification(cases, check, tolerance=list(TOLERANCE))


def install(mode: str, device) -> str:
    """Choose the decode attention for `device` in this process: torch (the FP32 PyTorch path) or auto (the kernels
    where they qualify; one log line says which runs and why). Returns "fused" or "torch"."""
    def qualify_and_keep(dev):
        _STATE["qualification"] = q = qualify(dev)  # the table, for benchmarks' JSON
        return q

    return choose("model.attention_kernels", "decode attention", "the FP32 PyTorch path", mode, device,
                  _STATE["devices"], qualify_and_keep, lambda q: [c for c in q["cases"] if not c.get("passed", True)], log,
                  f"against FP64, within {TOLERANCE} of the PyTorch path's error", allow_interpreter=True)


def reset() -> None:
    """Forget every choice (tests)."""
    _STATE["devices"].clear()
