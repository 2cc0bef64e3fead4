"""Adapter forwards for replay with gradients: PEFT's arithmetic forward, a lean backward.

PEFT's LoRA/DoRA forward (measured, peft 0.21) casts each adapted layer's input to the FP32 of the master weights
and lets autograd keep that FP32 copy (and, for DoRA, the FP32 products (m/||W+sBA|| - 1)·base and the LoRA
term) until backward; DoRA also rebuilds the dense weight W + s·BA in FP32 (and an in x in identity matrix) on
every forward to take its row norms. At the 27B shape that is ~70 MB of kept graph per replayed token and 340 MiB
to 1.2 GiB of transient dense FP32 per layer.

`ReplayAdapter` keeps the forward expression for expression (FP32 LoRA term from the FP32 masters, combined with the
base output in FP32, rounded once -- the design's "compute separately, combine in FP32, round once", equal bit for
bit to PEFT's forward and to engine.cuda_graphs.FrozenAdapter, so replay scores exactly what generation sampled
from) and replaces what autograd keeps:

    kept per layer      x in its own dtype (BF16 on the GPU; often the same tensor the next op keeps anyway),
                        h = A x in FP32 (rank r per token: 64 bytes at r 16), and for DoRA the base output in its
                        own dtype. Nothing FP32 of the layer's width, no dense weight.
    DoRA scale          ||W + s·BA||_row once per adapter version (one layer's dense FP32 at a time, freed before
                        the next), detached as in PEFT and the DoRA paper.
    backward            input gradient through the base layer in its own dtype (BF16 GEMM) plus the LoRA term's
                        input gradient rounded once to x's dtype; weight gradients of A, B and the magnitude as
                        FP32 GEMMs/sums (FP32 accumulation into the FP32 masters' .grad).

Use as a context manager around replay scoring (re-entrant; installs instance forwards on PEFT's LoRA layers and
removes them on exit). Gradients match PEFT's own autograd (tests/test_replay_memory.py: FP32 to 1e-6, and the
gradient-equivalence gate in BF16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import adapter_kernels as AK


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
    def forward(ctx, result, x, A, B, m, n, bias, scaling: float, round_lora: bool):
        fused = AK.enabled(result)  # the same arithmetic in one kernel (engine/adapter_kernels.py), bit for bit
        xf = x.to(A.dtype) if x.dtype != A.dtype else x
        h = F.linear(xf, A)  # (.., r) fp32
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
        if ctx.dora:
            # d out / d result = 1 + (ms - 1) = ms; d out / d lora = ms·s; d out / d m = (base + s·lora) / n, summed
            # over tokens: (g_result, g_lora, Σ g·(base + s·lora)) in one kernel when fused, else as PyTorch does
            base_result = result if bias is None else result - bias
            backward = AK.dora_backward_fused if ctx.fused else AK.dora_backward_torch
            g_result, gl, g_sum = backward(g, (m / n).view(1, -1), base_result, F.linear(h, B), s)
            g_m = g_sum / n
        else:
            g_result = g
            gl = AK.lora_grad_fused(g, s) if ctx.fused else AK.lora_grad_torch(g, s)
            g_m = None
        gl2 = gl.reshape(-1, out_dim)  # (N, out) fp32
        h2 = h.reshape(-1, r)
        g_B = gl2.t() @ h2  # (out, r) fp32
        gh = gl2 @ B  # (N, r) fp32
        x2 = x.reshape(-1, x.shape[-1])
        g_A = gh.t() @ (x2.float() if x2.dtype != torch.float32 else x2)  # (r, in) fp32
        g_x = (gh @ A).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[1] else None
        return g_result, g_x, g_A, g_B, g_m, None, None, None, None


class ReplayAdapter:
    """Installs the lean-backward adapter forward on every single-adapter PEFT LoRA/DoRA layer of `model`.

    The DoRA weight norms are computed on entry when the adapter weights changed since the last entry (by parameter
    address and version); they stay fixed inside a replay, as the adapter does."""

    def __init__(self, model):
        self.model = model
        self.layers = single_adapter_layers(model)
        for mod, a in self.layers.values():
            drop = mod.lora_dropout[a] if a in getattr(mod, "lora_dropout", {}) else None
            if drop is not None and not isinstance(drop, torch.nn.Identity):
                raise ValueError("replay with gradients runs without LoRA dropout (adapter.dropout: 0.0)")
        self.norms: dict[str, torch.Tensor] = {}
        self._key = None
        self._depth = 0

    def _sync(self) -> None:
        key = tuple((p.data_ptr(), p._version) for p in adapter_params(self.layers))
        if key == self._key:
            return
        self.norms = {name: dora_weight_norm(mod, a) for name, (mod, a) in self.layers.items()
                      if a in getattr(mod, "lora_magnitude_vector", {})}
        self._key = key

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
            return _AdapterTerm.apply(result, x, A, B, m, norms.get(name), bias, scaling, bnb4 and not dora)

        return forward

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
