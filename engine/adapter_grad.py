"""Adapter forwards for replay with gradients: PEFT's arithmetic forward, a lean backward.

PEFT's LoRA/DoRA forward (measured, peft 0.21) casts each adapted layer's input to the FP32 of the master weights
and lets autograd keep that FP32 copy (and, for DoRA, the FP32 products (m/||W+sBA|| - 1)·base and the LoRA
term) until backward; DoRA also rebuilds the dense weight W + s·BA in FP32 (and an in x in identity matrix) on
every forward to take its row norms. At the 27B shape that is ~70 MB of kept graph per replayed token and 340 MiB
to 1.2 GiB of transient dense FP32 per layer.

`ReplayAdapter` keeps the forward expression for expression (FP32 LoRA term from the FP32 masters, combined with the
base output in FP32, rounded once -- the design's "compute separately, combine in FP32, round once", equal bit for
bit to PEFT's forward and to engine.cuda_graphs.FrozenAdapter, so replay scores exactly what generation sampled
from; with `replay.lora_product: split` the rank-r product h = A x runs on tensor cores instead, within ~1e-5 of
it, see `lora_h`) and replaces what autograd keeps:

    kept per layer      x in its own dtype (BF16 on the GPU; often the same tensor the next op keeps anyway),
                        h = A x in FP32 (rank r per token: 64 bytes at r 16), and for DoRA the base output in its
                        own dtype. Nothing FP32 of the layer's width, no dense weight.
    DoRA scale          ||W + s·BA||_row once per adapter version (one layer's dense FP32 at a time, freed before
                        the next), detached as in PEFT and the DoRA paper.
    backward            input gradient through the base layer in its own dtype (BF16 GEMM) plus the LoRA term's
                        input gradient rounded once to x's dtype; weight gradients of A, B and the magnitude with
                        FP32 accumulation into the FP32 masters' .grad. The LoRA term's output gradient is never
                        formed (it is g scaled per column: the scale goes to the rank-r side), and on CUDA the
                        rank-r products run on BF16 tensor cores with the FP32 side split in two BF16 halves
                        (mm_exact_lhs: ~1e-5 relative of the FP32 product).

Use as a context manager around replay scoring (re-entrant; installs instance forwards on PEFT's LoRA layers and
removes them on exit). Gradients match PEFT's own autograd (tests/test_replay_memory.py: FP32 to 1e-6, and the
gradient-equivalence gate in BF16).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine import adapter_kernels as AK

log = logging.getLogger("lgrpo.adapter")


def adapter_layers(model) -> dict[str, torch.nn.Module]:
    """PEFT LoRA layers (plain Linear and bitsandbytes Linear4bit) of a model, by name."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def single_adapter_layers(model) -> dict[str, tuple[torch.nn.Module, str]]:
    """{name: (layer, adapter name)} of the PEFT LoRA layers with exactly one active, unmerged adapter."""
    out = {}
    for name, mod in adapter_layers(model).items():
        active = list(getattr(mod, "active_adapters", ["default"]))
        if len(active) == 1 and active[0] in mod.lora_A and not getattr(mod, "merged", False):
            out[name] = (mod, active[0])
    return out


def adapter_params(layers: dict[str, tuple[torch.nn.Module, str]]):
    """The adapter tensors of `layers` (A, B, and the DoRA magnitude), in a fixed order."""
    for mod, a in layers.values():
        yield mod.lora_A[a].weight
        yield mod.lora_B[a].weight
        if a in getattr(mod, "lora_magnitude_vector", {}):
            yield mod.lora_magnitude_vector[a].weight


@torch.no_grad()
def dora_weight_norm(mod, a: str) -> torch.Tensor:
    """PEFT's ||W + s·BA||_row in the LoRA dtype (DoraLinearLayer.forward without autocast), detached: (out,)."""
    from peft.utils.integrations import dequantize_module_weight

    dl = mod.lora_magnitude_vector[a]
    A, B = mod.lora_A[a], mod.lora_B[a]
    xdt = A.weight.dtype
    lora_weight = dl.get_lora_weight(lora_A=A, lora_B=B, adapter_name=a).to(xdt)
    weight = dequantize_module_weight(mod.get_base_layer()).to(xdt)
    norm = dl.get_weight_norm(weight=weight, lora_weight=lora_weight.detach(), scaling=mod.scaling[a],
                              adapter_name=a).detach()
    del weight, lora_weight
    return norm


class _AdapterTerm(torch.autograd.Function):
    """out = result + s·B(A x) (LoRA) or result + (m/n - 1)·(result - bias) + (m/n)·s·B(A x) (DoRA), FP32, rounded once.

    result: the base layer's output (B.., out) in the compute dtype, with its own graph to x.
    x: the layer input (B.., in). A (r, in), B (out, r): FP32 masters. m (out,) FP32 magnitude or None; n (out,)
    the detached DoRA weight norm. bias: the base bias (DoRA only) or None. round_lora: bnb 4-bit layers round the
    LoRA term to the result dtype before adding (PEFT's Linear4bit path)."""

    @staticmethod
    def forward(ctx, result, x, A, B, m, n, bias, scaling: float, round_lora: bool, split: bool = False):
        fused = AK.enabled(result)  # the same arithmetic in one kernel (engine/adapter_kernels.py), bit for bit
        h = lora_h(x, A, split)  # (.., r) fp32
        lora = F.linear(h, B)  # (.., out) fp32
        epilogue = AK.epilogue_fused if fused else AK.epilogue_torch
        if m is None:
            out = epilogue(result, lora, None, None, scaling, False, round_lora)
            ctx.save_for_backward(x, h, A, B)
        else:  # (result + ((ms - 1) * (result - bias) + ms * lora * scaling)).to(dt)
            out = epilogue(result, lora, (m / n).view(1, -1), bias, scaling, True, False)
            ctx.save_for_backward(x, h, A, B, m, n, result, bias)
        ctx.scaling, ctx.dora, ctx.fused = scaling, m is not None, fused
        return out

    @staticmethod
    def backward(ctx, g):
        s = ctx.scaling
        if ctx.dora:
            x, h, A, B, m, n, result, bias = ctx.saved_tensors
        else:
            x, h, A, B = ctx.saved_tensors
        out_dim, r = B.shape
        g2 = g.reshape(-1, out_dim)
        h2 = h.reshape(-1, r)
        # the LoRA term's gradient is g scaled per output column, g_l = g·c (c = ms·s for DoRA, s for LoRA), so every
        # product with it is one with g and c folded into the rank-r side: no (tokens x out) FP32 tensor is formed
        G = mm_exact_lhs(g2.t(), h2)  # (out, r) = g^T h, FP32
        if ctx.dora:
            ms = m / n
            c = ms * s
            backward = AK.dora_backward_fused if ctx.fused else AK.dora_backward_torch
            g_result, g_base = backward(g, ms.view(1, -1), result if bias is None else result - bias)
            # d out / d m = (base + s·lora) / n summed over tokens; Σ_t g·lora = Σ_k B[o,k]·G[o,k]
            g_m = (g_base + s * (B * G).sum(1)) / n
            g_B = c.view(-1, 1) * G
            gh = mm_exact_lhs(g2, c.view(-1, 1) * B)  # (N, r) = g_l B
        else:
            g_result, g_m = g, None
            g_B = G * s
            gh = mm_exact_lhs(g2, B * s)
        x2 = x.reshape(-1, x.shape[-1])
        g_A = mm_exact_lhs(x2.t(), gh).t().contiguous()  # (r, in) = gh^T x
        g_x = lora_input_grad(gh, A, x.dtype).reshape(x.shape) if ctx.needs_input_grad[1] else None
        return g_result, g_x, g_A, g_B, g_m, None, None, None, None, None


# -- the backward's products -----------------------------------------------------------------------------------------
#
# The weight gradients of A and B are products of a tensor that holds BF16 values exactly (the layer input x, the output
# gradient g) with an FP32 rank-r one (h, g·B, g_l B). On CUDA the FP32 side is split into two BF16 halves, t = hi + lo
# (hi = bf16(t), lo = bf16(t - hi): within ~2^-16 of t), laid side by side, and one BF16 tensor-core GEMM with FP32
# accumulation and output takes both: the result equals the FP32 product to ~1e-5 relative, at tensor-core speed
# instead of FP32 SIMT (13 % of replay's kernel time at the 27B width, bench/results/h200-replay-profile-nf4-2026-12-03
# .json). Elsewhere (CPU, FP32 models) the FP32 product itself runs.

_MM_OUT_DTYPE: dict = {}
SPLIT_TOLERANCE = 5e-5  # relative L2 of a split product against FP64 (the split leaves ~2^-17 of the FP32 side)


def _bf16_mm_f32_ok(device) -> bool:
    """The split products qualify on this device: `_split_product` with torch.mm(bf16, bf16, out_dtype=float32) runs
    for a row-major and a transposed left operand (the layouts the backward passes) and equals FP64 within
    SPLIT_TOLERANCE. Checked once per device; when not, one log line says the FP32 products run instead."""
    from engine.kernel_choice import rel_l2

    key = str(device)
    if key not in _MM_OUT_DTYPE:
        why = None
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            a = torch.randn(257, 300, generator=gen).to(device=device, dtype=torch.bfloat16)
            b = (torch.randn(300, 16, generator=gen) * 1e-3).to(device)
            bt = (torch.randn(257, 16, generator=gen) * 1e-3).to(device)
            for lhs, rhs in ((a, b), (a.t(), bt)):
                got = _split_product(lhs, rhs, lambda x, y, dt: torch.mm(x, y, out_dtype=dt))
                err = rel_l2(got, lhs.double() @ rhs.double())
                if got.dtype != torch.float32 or not err <= SPLIT_TOLERANCE:
                    why = f"relative L2 {err:.2e} against FP64 (allowed {SPLIT_TOLERANCE:.0e})"
                    break
        except (RuntimeError, TypeError) as e:  # the op is missing here (NotImplementedError) or takes no out_dtype
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        _MM_OUT_DTYPE[key] = why is None
        if why is not None:
            log.warning("adapter backward on %s: the split BF16 products do not qualify (%s); the FP32 products run",
                        key, why)
    return _MM_OUT_DTYPE[key]


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 t as hi + lo, both BF16: hi = bf16(t), lo = bf16(t - hi); |t - hi - lo| <= 2^-17 |t| or so."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


def _split_here(dtype: torch.dtype, device: torch.device) -> bool:
    """Take the split BF16 products for BF16 operands on `device` (CUDA, FP32-output BF16 GEMMs qualified)."""
    return dtype == torch.bfloat16 and device.type == "cuda" and _bf16_mm_f32_ok(device)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """BF16 a @ BF16 b with FP32 accumulation, output in out_dtype: cuBLAS on CUDA; the same arithmetic in FP32
    elsewhere (BF16 values are exact in FP32), rounded once."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype) if out_dtype != a.dtype else a @ b
    return (a.float() @ b.float()).to(out_dtype)


def _split_product(a: torch.Tensor, b: torch.Tensor, gemm=_mm) -> torch.Tensor:
    """BF16 a @ FP32 b (n columns) as one BF16 GEMM of a with [hi | lo] of b, FP32 accumulation and output
    (gemm(a, b, out_dtype): `_mm`, or torch.mm itself when qualifying the device's op)."""
    n = b.shape[1]
    out = gemm(a, torch.cat(split_bf16(b), 1), torch.float32)
    return out[:, :n] + out[:, n:]


def mm_exact_lhs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in FP32: a (M, K) holds its dtype's values exactly (BF16 activations/gradients, or FP32), b (K, n) FP32
    with n small (the rank); the split product where it qualifies."""
    return _split_product(a, b) if _split_here(a.dtype, a.device) else a.to(b.dtype) @ b


def lora_h(x: torch.Tensor, A: torch.Tensor, split: bool = False) -> torch.Tensor:
    """h = A x in FP32 for x (.., in) and the FP32 master A (r, in). PEFT's arithmetic: x cast to A's dtype, then
    the FP32 GEMM (at the 27B width an FP32 copy of every adapted layer's input and an FP32 SIMT GEMM per layer and
    pass). split (replay.lora_product: split), where the split products qualify (CUDA, BF16 x): mm_exact_lhs, one
    BF16 tensor-core GEMM of x with A's two BF16 halves and FP32 accumulation -- within ~1e-5 relative of the FP32
    product, not bit for bit."""
    if split and _split_here(x.dtype, x.device):
        return mm_exact_lhs(x.reshape(-1, x.shape[-1]), A.t()).reshape(*x.shape[:-1], A.shape[0])
    return F.linear(x.to(A.dtype) if x.dtype != A.dtype else x, A)


def lora_input_grad(gh: torch.Tensor, A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(gh @ A) rounded once to dtype: gh (N, r), A (r, in), both FP32. Split path (BF16 dtype): one BF16 GEMM over
    the three significant cross terms [gh_hi | gh_hi | gh_lo] @ [A_hi; A_lo; A_hi] with FP32 accumulation, rounded
    in its epilogue (the dropped lo·lo term is ~2^-16 relative); elsewhere the FP32 product, then rounded."""
    if _split_here(dtype, gh.device):
        gh_hi, gh_lo = split_bf16(gh)
        a_hi, a_lo = split_bf16(A)
        return _mm(torch.cat([gh_hi, gh_hi, gh_lo], 1), torch.cat([a_hi, a_lo, a_hi], 0), dtype)
    return (gh @ A).to(dtype)


class ReplayAdapter:
    """Installs the lean-backward adapter forward on every single-adapter PEFT LoRA/DoRA layer of `model`.

    The DoRA weight norms are computed on entry when the adapter weights changed since the last entry (by parameter
    address and version); they stay fixed inside a replay, as the adapter does."""

    def __init__(self, model):
        self.model = model
        self.split_forward = False  # replay.lora_product: split (lora_h); engine.replay sets it, read at every call
        self.layers = single_adapter_layers(model)
        for mod, a in self.layers.values():
            drop = mod.lora_dropout[a] if a in getattr(mod, "lora_dropout", {}) else None
            if drop is not None and not isinstance(drop, torch.nn.Identity):
                raise ValueError("replay with gradients runs without LoRA dropout (adapter.dropout: 0.0)")
        self.norms: dict[str, torch.Tensor] = {}
        self._key = None
        self._key_of: dict[str, tuple] = {}
        self._depth = 0
        self._scopes: dict[int, list[str]] = {}

    def _sync(self) -> None:
        key = tuple((p.data_ptr(), p._version) for p in adapter_params(self.layers))
        if key == self._key:
            return
        self.norms = {name: dora_weight_norm(mod, a) for name, (mod, a) in self.layers.items()
                      if a in getattr(mod, "lora_magnitude_vector", {})}
        self._key = key
        self._key_of = {name: _param_key(mod, a) for name, (mod, a) in self.layers.items()}

    def _forward(self, name: str):
        mod, a = self.layers[name]
        base = mod.get_base_layer()
        A, B = mod.lora_A[a].weight, mod.lora_B[a].weight
        scaling = float(mod.scaling[a])
        bnb4 = type(mod).__name__ == "Linear4bit"
        dora = name in self.norms
        m = mod.lora_magnitude_vector[a].weight if dora else None
        norms = self.norms

        def forward(x, *args, **kwargs):
            if torch.is_autocast_enabled():
                raise RuntimeError("ReplayAdapter: replay runs without autocast (the compute dtype is the base's)")
            result = base(x, *args, **kwargs)
            if bnb4:
                result = result.clone()
            bias = base.bias if dora else None
            return _AdapterTerm.apply(result, x, A, B, m, norms.get(name), bias, scaling, bnb4 and not dora,
                                      self.split_forward)

        return forward

    def scope(self, module):
        """A context that installs the lean forward on the adapted layers inside `module` only (one decoder layer):
        what a checkpointed layer's recompute in backward needs. Entering the whole adapter there would install and
        remove every adapted layer's forward (640 at the 27B shape) and re-key every adapter parameter once per
        decoder layer per micro-batch: ~13 ms of CPU each (400 layers, CPU: 0.84 s per 64 recomputes). The DoRA
        norms are the ones the last full entry computed, re-synchronised if this module's adapter weights changed."""
        return _Scope(self, module)

    def __enter__(self):
        if self._depth == 0:
            self._sync()
            for name, (mod, _) in self.layers.items():
                mod.forward = self._forward(name)
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for mod, _ in self.layers.values():
                if "forward" in mod.__dict__:
                    del mod.forward
        return False


def _param_key(mod, a: str) -> tuple:
    ps = [mod.lora_A[a].weight, mod.lora_B[a].weight]
    if a in getattr(mod, "lora_magnitude_vector", {}):
        ps.append(mod.lora_magnitude_vector[a].weight)
    return tuple((p.data_ptr(), p._version) for p in ps)


class _Scope:
    """ReplayAdapter.scope: the lean forward on one module's adapted layers (no-op inside a full entry)."""

    def __init__(self, ra: ReplayAdapter, module):
        self.ra, self.module, self.names = ra, module, None

    def __enter__(self):
        ra = self.ra
        if ra._depth > 0:  # the whole adapter is installed already (the forward pass)
            return self
        names = ra._scopes.get(id(self.module))
        if names is None:
            inside = {id(m) for m in self.module.modules()}
            names = ra._scopes[id(self.module)] = [n for n, (m, _) in ra.layers.items() if id(m) in inside]
        if any(ra._key_of.get(n) != _param_key(*ra.layers[n]) for n in names):
            ra._sync()  # never computed, or this module's adapter changed since: the norms again
        self.names = names
        for n in names:
            ra.layers[n][0].forward = ra._forward(n)
        return self

    def __exit__(self, *exc):
        for n in self.names or ():
            mod = self.ra.layers[n][0]
            if "forward" in mod.__dict__:
                del mod.forward
        self.names = None
        return False
