"""NF4 projections of single-token steps on CUDA: one Triton kernel reads the 4-bit weights and dequantizes them in
registers, instead of bitsandbytes writing the whole BF16 weight out and reading it back for a GEMM.

Why: a latent step or a decoded token runs each projection on a handful of rows (one per sequence). bitsandbytes'
Linear4bit has a fused kernel only for one row; for 2-16 rows it dequantizes the full weight (BF16, twice the bytes
of the model's BF16 copy in traffic) and multiplies. Measured on one H200 at the 27B shape, batch 4
(bench/results/h200-recipe-27b-nf4-kernels-2026-12-02.json): bitsandbytes' 4-bit path took 35.2 of 50.8 ms of a
latent step's kernel time, 0.4 TB/s on 13.5 GB of NF4. Read at HBM speed, the NF4 weights (~4.3 bits per
parameter with the absmax) take ~3 ms -- a quarter of the BF16 copy's 10.8 ms floor.

What: `nf4_small_gemm` (engine/_nf4_triton.py): programs over blocks of output features x splits of the input
dimension (enough programs to keep HBM busy: a 4-row step is a matrix-vector product), FP32 partials summed in
split order by `nf4_reduce`, rounded once to BF16. Each packed byte's two weights are dequantized exactly as
bitsandbytes.functional.dequantize_4bit does it -- absmax = code2[q] * absmax2 + offset for a nested
(double-quantized) state, decoded once per weight into FP32 beside the packed codes (NF4Weight.absmax32, ~0.5 bit
per weight), then BF16(nf4[c] * absmax), every step rounded in FP32 as its kernels round -- and multiplied with the
BF16 rows (exact products) on tensor cores or in registers, summed in FP32. So the products are those of the
dequantize-then-matmul path and only the order of the sums differs from cuBLAS's: not bit for bit bitsandbytes'
result, as accurate (the qualification checks both: the in-register weights equal dequantize_4bit's bit for bit,
and the outputs against FP64 are within 1.25x of the dequantize-then-matmul path's error). A row's result does not
depend on the other rows (fixed per-shape layout). CONFIG holds the launch layout; bench/kernel_sweep.py times the
alternatives.

Status: **16.4 ms per step** on one H100 at CONFIG's layout (4 rows through the 496 projections of the 27B model,
timed inside CUDA graphs; `python3 bench/kernel_sweep.py --only nf4 --forms wdot --luts prmt`,
bench/results/h100-kernel-sweep-nf4-prmt-2026-12-07.json), against 24.95 ms for the previous layout in the same run,
bitsandbytes' 34.7 ms and cuBLAS on the BF16 copy 18.9 ms (H100 floors: NF4 4.1 ms, BF16 14.5 ms). Qualified: the
in-register weights equal dequantize_4bit's bit for bit, rows alone bit for bit. What made it faster (read from the
compiled loop's SASS, compiled ahead of time on the CPU for sm_90): every earlier layout was bound by instructions,
not memory -- the "shuffle" lookup (tl.gather over each row's 16 values) costs 15.5 instructions per weight (shuffles
plus selects), the select tree 25. The "prmt" lookup (engine/_nf4_triton.py TABLE_ASM / LOOKUP_ASM, inline PTX):
each row's 16 BF16 values per absmax block as two byte planes in 8 registers, each pair of packed bytes looked up
with byte permutes -- 7.4 instructions per weight in the loop, no shuffles. The "wdot" form makes the weights the
MMA's first operand (taken from registers). Still instruction bound (4x the NF4 floor): each row's table is built by
the four threads that share the row in the MMA operand layout. Earlier measurements: H200 2026-12-03 shuffle 24.7 ms
(bench/results/h200-kernel-sweep-nf4-shuffle-2026-12-03.json), select 39.4-41.0, gathers from memory 90-95, products
in registers 106-111; the "fma" form (four FP32 accumulators, no tensor cores) 28 ms at best on the H100
(bench/results/h100-kernel-sweep-nf4-forms-2026-12-07.json).

Use: `install(mode, device)` once per process before a static decoder captures a graph (engine.runtime does;
model.nf4_kernels). It patches bitsandbytes' Linear4bit.forward: inputs of at most STEP_ROWS rows, BF16, not
needing a gradient, on a device where the kernel qualified, take the kernel; everything else (prefill, replay with
gradients, CPU) keeps bitsandbytes' forward. On a CPU bitsandbytes' NF4 does not run; the kernel runs under
TRITON_INTERPRET=1 on weights packed by `pack_nf4_reference` (tests/test_nf4_kernels.py).
"""

from __future__ import annotations

import logging

import torch

from engine.kernel_choice import as_accurate, choose, error_stats, interpret, qualification

log = logging.getLogger("lgrpo.nf4")

_STATE: dict = {"devices": set(), "launches": 0, "orig": None}
_K: dict = {}
STEP_ROWS = 16  # at most this many rows (batch x tokens) take the kernel
# The launch layout: output features per program, input elements per step, the number of programs a projection aims
# for (the input dimension is split until cdiv(N, block_n) x splits reaches it: a 4-row step is a matrix-vector
# product and needs many programs in flight to keep HBM busy), warps, pipeline stages, and how the 16 NF4 levels are
# looked up (lut: "gather" from the 16-entry table per element, "pairs" from a 256-entry table of both levels of a
# byte, "select" in registers, "shuffle": each row's 16 dequantized values per block computed once and gathered in
# registers, "prmt": the same per-row values looked up with byte permutes in inline PTX (CUDA, NF4_TABLE's levels;
# else "shuffle") -- widths that are not a multiple of the absmax block use "select"), how the products are
# summed (mma: on tensor cores, 16 rows per program; else FP32 products summed in registers, 4 rows per program), and
# the form: "gemm" (rows x weights^T, the weights the MMA's second operand), "wdot" (weights x rows^T: the weights
# the first operand, from registers), "fma" (four FP32 accumulators per program, summed once at the end; no tensor
# cores). The layout fixes the order of the sums for a shape;
# bench/kernel_sweep.py times the alternatives on the GPU and every choice is qualified as it is installed.
CONFIG = {"block_n": 128, "block_k": 64, "programs": 512, "warps": 4, "stages": 3, "lut": "prmt",
          "mma": True, "form": "wdot"}  # the H100 sweep's best (bench/results/h100-kernel-sweep-nf4-prmt-2026-12-07.json)


class NF4Weight:
    """The tensors of one bitsandbytes NF4 weight the kernel reads (views, no copies): packed uint8 (N*K/2,), the
    absmax (uint8 when nested, else FP32), the NF4 table (16 FP32), and for a nested state absmax2 (FP32), code2
    (256 FP32), its block size and the offset (an FP32 value)."""

    def __init__(self, packed, shape, absmax, lut, blocksize: int, absmax2=None, code2=None, blocksize2: int = 256,
                 offset: float = 0.0):
        self.packed, self.shape, self.absmax, self.lut = packed.reshape(-1), tuple(shape), absmax, lut
        self.blocksize, self.absmax2, self.code2 = int(blocksize), absmax2, code2
        self.blocksize2, self.offset = int(blocksize2), float(offset)
        self.nested = absmax2 is not None
        self._absmax32 = None
        self._pairs = None
        self._nf4_table = None

    @property
    def pairs(self) -> torch.Tensor:
        """The two levels of every packed byte as one int64 (256,): low 32 bits the FP32 bits of nf4[byte >> 4] (the
        even element), high 32 bits those of nf4[byte & 15] -- one 8-byte load decodes both weights of a byte."""
        if self._pairs is None:
            bits = self.lut.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
            b = torch.arange(256, device=self.lut.device)
            self._pairs = bits[b >> 4] | (bits[b & 15] << 32)
        return self._pairs

    def table_is_nf4(self) -> bool | None:
        """Whether the weight's 16 levels are NF4_TABLE bit for bit (the "prmt" lookup computes with NF4_TABLE's
        values as PTX immediates). Checked once (one device-to-host copy); None while a CUDA graph is being captured
        before the first check (the caller then takes the table lookup, which gives the same weights)."""
        if self._nf4_table is None:
            if self.lut.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            self._nf4_table = bool(torch.equal(self.lut.detach().float().cpu(),
                                               torch.tensor(NF4_TABLE, dtype=torch.float32)))
        return self._nf4_table

    @property
    def absmax32(self) -> torch.Tensor:
        """The FP32 absmax of every block, decoded once from a nested state exactly as dequantize_4bit decodes it
        (code2[q] * absmax2, rounded, then + offset, rounded: two separate FP32 operations) -- 4 bytes per 64 weights
        (~0.5 bit per weight) kept beside the packed weight so the kernel reads each block's absmax directly."""
        if self._absmax32 is None:
            if self.nested:
                nb = self.absmax.numel()
                a2 = self.absmax2.repeat_interleave(self.blocksize2)[:nb]
                am = self.code2[self.absmax.long()] * a2
                self._absmax32 = am + torch.tensor(self.offset, dtype=torch.float32, device=am.device)
            else:
                self._absmax32 = self.absmax.float()
        return self._absmax32

    @classmethod
    def of(cls, mod) -> "NF4Weight":
        """From a bitsandbytes Linear4bit (quant_type nf4)."""
        qs = mod.weight.quant_state
        if qs.quant_type != "nf4":
            raise ValueError(f"the NF4 kernel reads nf4 weights, this one is {qs.quant_type}")
        if qs.nested:
            s2 = qs.state2
            return cls(mod.weight.data, qs.shape, qs.absmax, qs.code, qs.blocksize, s2.absmax, s2.code, s2.blocksize,
                       float(qs.offset))
        return cls(mod.weight.data, qs.shape, qs.absmax, qs.code, qs.blocksize)


def _kernels() -> dict:
    if not _K:
        from engine import _nf4_triton as T

        _K.update(gemm=T.nf4_small_gemm, reduce=T.nf4_reduce, fma=T.nf4_gemv, wdot=T.nf4_wdot)
    return _K


def nf4_linear(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) BF16 with at most STEP_ROWS rows -> (..., N) BF16."""
    N, K = w.shape
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the NF4 kernel multiplies BF16 rows, got {x.dtype}")
    if x.shape[-1] != K or K % 2:
        raise ValueError(f"the NF4 kernel: input width {x.shape[-1]} for a weight {w.shape} (even widths only)")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > STEP_ROWS:
        raise ValueError(f"the NF4 kernel takes at most {STEP_ROWS} rows, got {M}")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    import triton

    cfg = CONFIG
    BN, BK = cfg["block_n"], cfg["block_k"]
    n_blocks = triton.cdiv(N, BN)
    splits = max(1, min(triton.cdiv(cfg["programs"], n_blocks), triton.cdiv(K, BK)))
    ks = triton.cdiv(triton.cdiv(K, splits), BK) * BK  # input elements per split: whole steps
    splits = triton.cdiv(K, ks)
    final = splits == 1
    part = out if final else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _STATE["launches"] += 1  # counted (tests check the kernel really ran)
    extra = {} if interpret() else {"enable_fp_fusion": False, "num_warps": cfg["warps"], "num_stages": cfg["stages"]}
    k = _kernels()
    mma = bool(cfg["mma"])
    row_blocks = K % w.blocksize == 0 and BK % w.blocksize == 0  # one absmax per row and block (every 27B shape)
    lut = cfg["lut"] if (cfg["lut"] not in ("shuffle", "prmt") or row_blocks) else "select"  # per-row tables need row blocks
    form = cfg.get("form", "gemm") if row_blocks else "gemm"  # the fma / wdot forms read one absmax per row block
    if lut == "prmt" and not w.table_is_nf4():
        lut = "shuffle"  # byte permutes compute with NF4_TABLE's levels (the same weights either way)
    args = (x2, w.packed, w.absmax32, w.pairs if lut == "pairs" else w.lut, bias if bias is not None else out, out,
            part, M, N, K, x2.stride(0), out.stride(0), ks)
    common = dict(HAS_BIAS=bias is not None, BLOCKSIZE=w.blocksize, BN=BN, BK=BK, FINAL=final, LUT=lut, **extra)
    if form == "fma":  # 4 rows per program, FP32 products in registers summed along the input once
        k["fma"][(n_blocks, splits, triton.cdiv(M, 4))](*args, SOFT_ROUND=interpret(), **common)
    elif form == "wdot":  # the weights as the MMA's first operand, up to 16 rows as its columns
        k["wdot"][(n_blocks, splits)](*args, DOT_F32=interpret(), **common)
    else:
        bm = STEP_ROWS if mma else 4  # rows per program: tensor cores take 16; register products take 4 per program
        k["gemm"][(n_blocks, splits, triton.cdiv(M, bm))](*args, BM=bm, ROW_BLOCKS=row_blocks, MMA=mma,
                                                          DOT_F32=interpret(), **common)
    if not final:
        RN = 1024
        k["reduce"][(M, triton.cdiv(N, RN))](part, bias if bias is not None else out, out, M, N, splits,
                                             out.stride(0), HAS_BIAS=bias is not None, BN=RN,
                                             **({} if interpret() else {"num_warps": 4}))
    return out.view(*x.shape[:-1], N)


# -- the reference: bitsandbytes' arithmetic written out in PyTorch (CPU tests; the GPU checks against bitsandbytes) --

def dequantize_reference(w: NF4Weight, dtype=torch.bfloat16) -> torch.Tensor:
    """dequantize_4bit's values: absmax = code2[q] * absmax2 + offset (nested), w = dtype(nf4[c] * absmax)."""
    N, K = w.shape
    n = N * K
    if w.nested:
        nb = w.absmax.numel()
        a2 = w.absmax2.repeat_interleave(w.blocksize2)[:nb]
        am = w.code2[w.absmax.long()] * a2
        am = am + torch.tensor(w.offset, dtype=torch.float32, device=am.device)
    else:
        am = w.absmax
    p = w.packed.long()
    codes = torch.stack([(p >> 4) & 15, p & 15], 1).reshape(-1)[:n]
    vals = w.lut[codes] * am.repeat_interleave(w.blocksize)[:n]
    return vals.to(dtype).view(N, K)


def pack_nf4_reference(weight: torch.Tensor, lut: torch.Tensor, blocksize: int = 64, nested: bool = True,
                       code2: torch.Tensor | None = None, blocksize2: int = 256) -> NF4Weight:
    """A weight quantized and packed the way bitsandbytes lays NF4 out (nearest table entry per element, FP32 absmax
    per block, nested: absmax - mean quantized to the nearest entry of `code2` per blocksize2 absmax values): for
    tests where bitsandbytes' CUDA quantizer is not available. Only the layout matters to the kernel."""
    N, K = weight.shape
    flat = weight.float().reshape(-1)
    pad = (-flat.numel()) % blocksize
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(1).clamp_min(1e-12)
    codes = ((blocks / absmax[:, None])[..., None] - lut).abs().argmin(-1).reshape(-1)[: flat.numel()]
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8)
    if not nested:
        return NF4Weight(packed, (N, K), absmax, lut, blocksize)
    if code2 is None:
        code2 = torch.linspace(-1, 1, 256)
    offset = float(absmax.mean())
    c = absmax - offset
    pad2 = (-c.numel()) % blocksize2
    b2 = torch.nn.functional.pad(c, (0, pad2)).view(-1, blocksize2)
    absmax2 = b2.abs().amax(1).clamp_min(1e-12)
    q8 = ((b2 / absmax2[:, None])[..., None] - code2).abs().argmin(-1).reshape(-1)[: c.numel()].to(torch.uint8)
    return NF4Weight(packed, (N, K), q8, lut, blocksize, absmax2, code2.float(), blocksize2,
                     float(torch.tensor(offset, dtype=torch.float32)))


NF4_TABLE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
             1.0)  # the NF4 levels of QLoRA, for pack_nf4_reference only: a Linear4bit carries bitsandbytes' own table


# -- the choice -----------------------------------------------------------------------------------------------------------

def enabled(x: torch.Tensor, mod) -> bool:
    """Use the kernel for this call of a Linear4bit: BF16 rows, at most STEP_ROWS of them, no gradient needed, an nf4
    weight, on a device where install qualified the kernel."""
    if not (x.dtype == torch.bfloat16 and (x.is_cuda or interpret()) and str(x.device) in _STATE["devices"]):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    qs = getattr(mod.weight, "quant_state", None)
    return (qs is not None and qs.quant_type == "nf4" and x.shape[-1] % 2 == 0
            and x.numel() <= STEP_ROWS * x.shape[-1] and qs.dtype == torch.bfloat16)


def _patch() -> None:
    """Route bitsandbytes' Linear4bit.forward through `enabled` (once per process; removed by `reset`)."""
    if _STATE["orig"] is not None:
        return
    import bitsandbytes as bnb

    cls = bnb.nn.Linear4bit
    orig = cls.forward

    def forward(self, x):
        if enabled(x, self):
            w = self.__dict__.get("_lgrpo_nf4")
            if w is None or w.packed.data_ptr() != self.weight.data.data_ptr():
                w = self.__dict__["_lgrpo_nf4"] = NF4Weight.of(self)
            return nf4_linear(x, w, self.bias)
        return orig(self, x)

    cls.forward = forward
    _STATE["orig"] = (cls, orig)


TOLERANCE = (1.25, 1e-6)  # relative L2 vs FP64 <= 1.25 x the dequantize-then-matmul path's error + 1e-6
MAX_ABS_FACTOR = 2.0

# (rows, out features, in features, nested): the 27B shapes (MLP gate/up, down, GDN qkv, attention k/v, the GDN
# gates' 48 outputs), an odd row count, a width not a multiple of a step
CASES = ((4, 17408, 5120, True), (4, 5120, 17408, True), (1, 10240, 5120, True), (16, 1024, 5120, False),
         (3, 48, 5120, True), (7, 300, 1000, True))


def _quantized(N: int, K: int, nested: bool, device, gen):
    """(NF4Weight, dequantized BF16 reference): bitsandbytes' quantizer where it runs, else pack_nf4_reference."""
    w = (torch.randn(N, K, generator=gen) * 0.02).to(torch.bfloat16)
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    if bnb is not None and torch.device(device).type == "cuda":
        packed, qs = bnb.functional.quantize_4bit(w.to(device), blocksize=64, compress_statistics=nested,
                                                  quant_type="nf4", quant_storage=torch.uint8)

        class _Mod:  # the attributes NF4Weight.of reads
            weight = type("P", (), {"data": packed, "quant_state": qs})()

        return NF4Weight.of(_Mod), bnb.functional.dequantize_4bit(packed, qs).to(torch.bfloat16)
    lut = torch.tensor(NF4_TABLE, dtype=torch.float32)
    nw = pack_nf4_reference(w.float(), lut, nested=nested)
    for name in ("packed", "absmax", "lut", "absmax2", "code2"):
        t = getattr(nw, name)
        if t is not None:
            setattr(nw, name, t.to(device))
    return nw, dequantize_reference(nw)


def qualify(device, cases=CASES) -> dict:
    """The kernel on random NF4 weights (bitsandbytes' quantizer on CUDA): (1) the weights it dequantizes in
    registers equal dequantize_4bit's bit for bit (one-hot rows pick single columns: a sum of one exact product);
    (2) its outputs against FP64 of x @ W^T (W the dequantized weight) within TOLERANCE of the dequantize-then-matmul
    path's error and MAX_ABS_FACTOR of its largest error; (3) a row alone equals the same row among others."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def check(M, N, K, nested) -> dict:
        nw, wref = _quantized(N, K, nested, device, gen)
        x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
        y, t = nf4_linear(x, nw), torch.nn.functional.linear(x, wref)
        e = error_stats(y, t, x.double() @ wref.double().T)
        cols = torch.randint(0, K, (min(STEP_ROWS, K),), generator=gen)
        onehot = torch.zeros(len(cols), K, dtype=torch.bfloat16)
        onehot[torch.arange(len(cols)), cols] = 1.0
        picked = nf4_linear(onehot.to(device), nw)  # row i: column cols[i] of the in-register weights
        deq_bitwise = bool(torch.equal(picked, wref[:, cols.to(wref.device)].T.contiguous()))
        alone = bool(torch.equal(nf4_linear(x[-1:], nw)[0], y[-1]))
        case = {"rows": M, "out": N, "in": K, "nested": nested, **e, "dequant_bitwise": deq_bitwise,
                "row_alone_bitwise": alone,
                "equal_to_torch": float((y == t).float().mean())}
        case["passed"] = (as_accurate(e, TOLERANCE, MAX_ABS_FACTOR) and deq_bitwise and alone
                          and bool(torch.isfinite(y).all()))
        return case

    return qualification(cases, check, tolerance=list(TOLERANCE))


def install(mode: str, device) -> str:
    """Choose the NF4 projection path of single-token steps for `device` in this process: torch (bitsandbytes'
    forward) or auto (the kernel where it qualifies; one log line says which runs and why). Returns "fused" or
    "torch". Needs bitsandbytes for "fused" (nothing to patch without it)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        if mode not in ("auto", "torch"):
            raise ValueError(f"model.nf4_kernels={mode!r}: one of auto, torch")
        return "torch"

    def qualify_and_keep(dev):
        _STATE["qualification"] = q = qualify(dev)
        return q

    return choose("model.nf4_kernels", "NF4 single-token projections", "bitsandbytes' forward", mode, device,
                  _STATE["devices"], qualify_and_keep, lambda q: [c for c in q["cases"] if not c.get("passed", True)],
                  log, f"dequantization bit for bit, outputs within {TOLERANCE} of dequantize-then-matmul's error",
                  on_pass=_patch)


def reset() -> None:
    """Forget every choice and restore bitsandbytes' forward (tests)."""
    _STATE["devices"].clear()
    if _STATE["orig"] is not None:
        cls, orig = _STATE["orig"]
        cls.forward = orig
        _STATE["orig"] = None
