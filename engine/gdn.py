"""Gated DeltaNet kernels, chosen by the project and qualified on the running GPU before use.

transformers routes its Qwen3.5 GDN functions to flash-linear-attention (fla) whenever `fla` imports (a decorator
with a fallback; the PyTorch reference stays reachable as `__wrapped__`), whatever the GPU, the Triton version or
the kernel's correctness there. fla 0.6.0 itself refuses its gated chunk backward on Hopper with Triton 3.4-3.7.0
(wrong gradients) unless tilelang is installed. So the choice is made here, explicitly, per kernel:

    chunk        chunked gated delta rule, forward and backward (prefill, replay)   fla chunk_gated_delta_rule
    recurrent    one-token recurrent step (latent loop, decode)                      fla fused_recurrent_gated_delta_rule
    conv         causal depthwise conv1d + SiLU over a sequence, with backward       fla causal_conv1d (Triton)
    conv_update  the same for one token against the layer's conv state (in place)   fla causal_conv1d_update

The PyTorch conv runs F.conv1d on the (B, C, T) transpose of the projection's (B, T, C) output: a copy in, a
generic depthwise kernel, the SiLU, and a (B, T, C) view of the result whose q/k/v heads need copies again; fla's
conv reads the (B, T, C) layout through strides and writes it contiguous, so the head views that follow are free.

`install(mode, device)` sets the functions the stock transformers modules call (module globals of
transformers.models.qwen3_5.modeling_qwen3_5) to the PyTorch reference or to fla's kernel. A kernel is used only
when `qualify` found it correct on this GPU with these library versions: forward (and, for chunk, every input
gradient) against the PyTorch reference in FP32 on random inputs of the model's head layout, relative L2 within
QUALIFY_REL_L2 and no more than QUALIFY_VS_TORCH times the PyTorch path's own BF16 error. Results are cached per
(GPU, torch, triton, fla, tilelang, transformers, layout) in ~/.cache/lgrpo (LGRPO_CACHE_DIR). An unqualified
kernel is not used: one log line says which path runs instead and why. bench/gdn_kernels.py prints the full table
(1k-32k tokens, error and time per kernel).
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("lgrpo.gdn")

QUALIFY_REL_L2 = 0.02  # BF16 operands land between 1e-3 and 1e-2 against FP32; above this a kernel is wrong
QUALIFY_VS_TORCH = 3.0  # and no worse than this multiple of the PyTorch path's own BF16 error
QUALIFY_RULE = 2  # what qualification checks (cached results of an older rule are not used); 2: chunk from a state
GLOBALS = {"chunk": "torch_chunk_gated_delta_rule", "recurrent": "torch_recurrent_gated_delta_rule",
           "conv": "causal_conv1d_fn", "conv_update": "causal_conv1d_update"}
_STATE: dict = {"mode": None, "chosen": {}}


def _mq():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    return mq


def reference(name: str):
    """The PyTorch reference implementation transformers ships for GLOBALS[name] (decorators unwrapped)."""
    mq = _mq()
    cur = getattr(mq, GLOBALS[name])
    fn = getattr(cur, "_lgrpo_reference", None) or inspect.unwrap(cur)
    if getattr(fn, "__module__", "") != mq.__name__:
        raise RuntimeError(f"cannot find transformers' PyTorch {GLOBALS[name]} (found {fn!r}): transformers changed "
                           "how it dispatches GDN kernels; update engine/gdn.py")
    return fn


def versions() -> dict:
    out = {"torch": torch.__version__}
    for pkg in ("triton", "fla-core", "tilelang", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return out


def fla_functions() -> dict:
    """fla's kernels for the 'chunk' and 'recurrent' slots, wrapped to transformers' call signature."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def wrap(fn, name):
        params = set(inspect.signature(fn).parameters)

        def call(query, key, value, g, beta, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k in params and k != "chunk_size"}
            if kwargs.get("cu_seqlens") is None:
                kwargs.pop("cu_seqlens", None)
            return fn(query, key, value, g=g, beta=beta, **kwargs)

        call.__name__ = f"fla_{name}"
        return call

    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        """transformers' causal_conv1d_fn: (B, C, T) in and out (views of fla's (B, T, C)); kwargs ignored as the
        reference ignores them."""
        x = hidden_states.to(weight.dtype).transpose(1, 2)
        y, _ = causal_conv1d(x, weight=weight, bias=bias, activation=activation)
        return y.transpose(1, 2).to(hidden_states.dtype)

    def conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
        """transformers' causal_conv1d_update for one token: (B, C, 1) in and out, conv_state (B, C, W) updated in
        place. fla addresses the state as contiguous (and its input guard would copy a strided one, losing the
        update), so any other layout or length runs the reference."""
        if hidden_states.shape[-1] != 1 or not conv_state.is_contiguous() or conv_state.shape[-1] != weight.shape[-1]:
            return reference("conv_update")(hidden_states, conv_state, weight, bias, activation)
        y, _ = causal_conv1d_update(hidden_states[..., 0].to(weight.dtype), cache=conv_state, weight=weight,
                                    bias=bias, activation=activation)
        return y.unsqueeze(-1).to(hidden_states.dtype)

    conv.__name__, conv_update.__name__ = "fla_conv", "fla_conv_update"
    return {"chunk": wrap(chunk_gated_delta_rule, "chunk"), "recurrent": wrap(fused_recurrent_gated_delta_rule,
                                                                               "recurrent"),
            "conv": conv, "conv_update": conv_update}


# ----------------------------------------------------------------------------------------------------------------
# qualification


def model_repeats_heads() -> bool:
    """Whether transformers' GDN module repeats the key heads to the value heads before calling the kernel (then
    the kernels see hv heads everywhere; otherwise they get grouped-value inputs)."""
    return "repeat_interleave" in inspect.getsource(_mq().Qwen3_5GatedDeltaNet.forward)


def _inputs(T: int, hk: int, hv: int, dk: int, dv: int, device, seed: int, state: bool):
    """Random kernel inputs in the layout the model passes (q, k with hk heads, or repeated to hv)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if model_repeats_heads():
        hk = hv
    q = torch.randn(1, T, hk, dk, device=device, generator=g)
    k = torch.randn(1, T, hk, dk, device=device, generator=g)
    v = torch.randn(1, T, hv, dv, device=device, generator=g)
    a = torch.randn(1, T, hv, device=device, generator=g)
    g_ = -torch.rand(hv, device=device, generator=g).mul(8).add(0.5) * torch.nn.functional.softplus(a + 1.0)
    beta = torch.rand(1, T, hv, device=device, generator=g)
    h0 = torch.randn(1, hv, dk, dv, device=device, generator=g) * 0.1 if state else None
    return q, k, v, g_, beta, h0


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def within_rule(errs: dict, torch_errs: dict) -> bool:
    """The qualification rule: every error (relative L2 against the FP32 reference) within QUALIFY_REL_L2 and within
    QUALIFY_VS_TORCH times the PyTorch path's own BF16 error (floored at 1e-3)."""
    return all(errs[k] <= QUALIFY_REL_L2 and errs[k] <= QUALIFY_VS_TORCH * max(torch_errs[k], 1e-3) for k in errs)


def _run(fn, q, k, v, g, beta, h0, dtype, grad: bool):
    """fn on inputs cast to dtype (g and the state stay FP32, as the model passes them); output and input grads."""
    xs = [t.to(dtype).detach().requires_grad_(grad) for t in (q, k, v)]
    gg = g.detach().requires_grad_(grad)
    bb = beta.to(dtype).detach().requires_grad_(grad)
    hh = None if h0 is None else h0.detach().requires_grad_(grad)
    out, state = fn(*xs, g=gg, beta=bb, initial_state=hh, output_final_state=True, use_qk_l2norm_in_kernel=True)
    res = {"o": out.detach().float(), "state": None if state is None else state.detach().float()}
    if grad:
        # the same FP32 cotangents for every dtype (a generator draws different values per dtype); the final state's
        # too, and the initial state's gradient is checked: prefix-shared replay (engine.shared_replay) continues a
        # chunk from a state that carries gradients
        gen = torch.Generator(device=out.device).manual_seed(7)
        w = torch.randn(out.shape, generator=gen, device=out.device)
        loss = (out.float() * w).sum()
        if state is not None:
            loss = loss + (state.float() * torch.randn(state.shape, generator=gen, device=out.device)).sum()
        loss.backward()
        names, tensors = ["q", "k", "v", "g", "beta"], [*xs, gg, bb]
        if hh is not None:
            names.append("h0")
            tensors.append(hh)
        res.update({f"d{n}": t.grad.float() for n, t in zip(names, tensors)})
    return res


def qualify_one(name: str, fn, T: int, layout: dict, device, seed: int = 0) -> dict:
    """Errors of `fn` (BF16) and of the PyTorch reference (BF16) against the reference in FP32, per output and input
    gradient; passed when every one is within QUALIFY_REL_L2 and QUALIFY_VS_TORCH x the reference's own error."""
    ref_fn = reference(name)
    grad = name == "chunk"
    q, k, v, g, beta, h0 = _inputs(T, layout["hk"], layout["hv"], layout["dk"], layout["dv"], device, seed,
                                   state=True)
    try:
        ref = _run(ref_fn, q, k, v, g, beta, h0, torch.float32, grad)
        tb = _run(ref_fn, q, k, v, g, beta, h0, torch.bfloat16, grad)
        got = _run(fn, q, k, v, g, beta, h0, torch.bfloat16, grad)
    except RuntimeError as e:  # a kernel that refuses (fla's Hopper/Triton guard) or fails to build: not qualified
        return {"kernel": name, "T": T, "passed": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    errs = {key: _rel(got[key], ref[key]) for key in ref if ref[key] is not None}
    torch_errs = {key: _rel(tb[key], ref[key]) for key in ref if ref[key] is not None}
    passed = within_rule(errs, torch_errs)
    return {"kernel": name, "T": T, "passed": passed, "rel_l2": errs, "torch_bf16_rel_l2": torch_errs}


def qualify_conv(name: str, fn, T: int, layout: dict, device, seed: int = 0) -> dict:
    """qualify_one for the causal conv kernels: output (and for conv the input and weight gradients; for conv_update
    the updated state) of `fn` and of the PyTorch reference in BF16 against the reference in FP32, on random inputs
    of the model's layout: x as the (B, C, T) transpose of a (B, T, C) projection output, weight (C, W), SiLU."""
    ref_fn = reference(name)
    C, W = 2 * layout["hk"] * layout["dk"] + layout["hv"] * layout["dv"], layout["w"]
    g = torch.Generator(device=device).manual_seed(seed)
    B = 1 if name == "conv" else 4
    x = torch.randn(B, T, C, device=device, generator=g)
    w = torch.randn(C, W, device=device, generator=g) / W ** 0.5
    st = torch.randn(B, C, W, device=device, generator=g)
    cot = torch.randn(B, C, T, device=device, generator=g)

    def run(f, dtype):
        xs = x.to(dtype).detach().requires_grad_(name == "conv")
        ws = w.to(dtype).detach().requires_grad_(name == "conv")
        if name == "conv":
            out = f(xs.transpose(1, 2), ws, None, activation="silu")
            (out.float() * cot).sum().backward()
            return {"o": out.detach().float(), "dx": xs.grad.float(), "dw": ws.grad.float()}
        state = st.to(dtype, copy=True)  # a copy for every run: the kernels update it in place
        out = f(xs.transpose(1, 2), state, ws, None, "silu")
        return {"o": out.float(), "state": state.float()}

    try:
        ref = run(ref_fn, torch.float32)
        tb = run(ref_fn, torch.bfloat16)
        got = run(fn, torch.bfloat16)
    except (RuntimeError, ValueError, AssertionError) as e:  # a kernel that refuses or fails to build
        return {"kernel": name, "T": T, "passed": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    errs = {key: _rel(got[key], ref[key]) for key in ref}
    torch_errs = {key: _rel(tb[key], ref[key]) for key in ref}
    passed = within_rule(errs, torch_errs)
    return {"kernel": name, "T": T, "passed": passed, "rel_l2": errs, "torch_bf16_rel_l2": torch_errs}


def _cache_file() -> Path:
    root = Path(os.environ.get("LGRPO_CACHE_DIR", Path.home() / ".cache" / "lgrpo"))
    return root / "gdn-qualification.json"


def qualify(layout: dict, device) -> dict[str, dict]:
    """Qualification of fla's chunk and recurrent kernels on this GPU and these versions, cached on disk."""
    key = json.dumps({"versions": versions(), "layout": layout, "rule": QUALIFY_RULE}, sort_keys=True)
    path = _cache_file()
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return cache[key]
    fns = fla_functions()
    result = {"chunk": qualify_one("chunk", fns["chunk"], 512, layout, device),
              "recurrent": qualify_one("recurrent", fns["recurrent"], 1, layout, device),
              "conv": qualify_conv("conv", fns["conv"], 512, layout, device),
              "conv_update": qualify_conv("conv_update", fns["conv_update"], 1, layout, device)}
    cache[key] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(path)
    return result


# ----------------------------------------------------------------------------------------------------------------
# installing the choice


def layout_of(config) -> dict:
    return {"hk": config.linear_num_key_heads, "hv": config.linear_num_value_heads,
            "dk": config.linear_key_head_dim, "dv": config.linear_value_head_dim, "w": config.linear_conv_kernel_dim}


def _set(name: str, fn, label: str) -> None:
    """Point the module global transformers calls at `fn` (None: the PyTorch reference), remembering the reference.
    A kernel runs only on CUDA tensors; a model on the CPU in the same process (a reference, a diagnostic) gets the
    PyTorch reference."""
    mq = _mq()
    cur = getattr(mq, GLOBALS[name])
    ref = getattr(cur, "_lgrpo_reference", None) or inspect.unwrap(cur)
    impl = ref if fn is None else fn

    def call(*args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        return impl(*args, **kwargs) if x.is_cuda else ref(*args, **kwargs)

    call._lgrpo_reference = ref
    call.__name__ = f"{label}_{name}"
    setattr(mq, GLOBALS[name], call)
    _STATE["chosen"][name] = label


def install(mode: str, config, device) -> dict[str, str]:
    """Choose the GDN implementation for this process: mode torch (the PyTorch reference everywhere), fla (fla's
    kernels, which must qualify here, else RuntimeError) or auto (fla where it qualifies on this GPU, the reference
    elsewhere, with one log line per kernel that falls back). Returns {kernel: implementation}."""
    if mode not in ("auto", "torch", "fla"):
        raise ValueError(f"model.gdn_kernels={mode!r}: one of auto, torch, fla")
    device = torch.device(device)
    chosen = {"chunk": "torch", "recurrent": "torch", "conv": "torch", "conv_update": "torch"}
    fns: dict = {}
    reasons: dict[str, str] = {}
    if mode != "torch":
        if device.type != "cuda":
            reasons = {k: "no CUDA device (fla's kernels are Triton)" for k in GLOBALS}
        else:
            try:
                fns = fla_functions()
            except ImportError as e:
                reasons = {k: f"fla is not installed ({e}); pip install 'latent-grpo[gpu]'" for k in GLOBALS}
            if fns:
                q = qualify(layout_of(config), device)
                for k in GLOBALS:
                    if q[k]["passed"]:
                        chosen[k] = "fla"
                    else:
                        reasons[k] = q[k].get("error") or f"errors {q[k]['rel_l2']} vs the FP32 reference"
    if mode == "fla" and any(chosen[k] != "fla" for k in GLOBALS):
        raise RuntimeError("model.gdn_kernels=fla, but fla's kernels do not qualify here: "
                           + "; ".join(f"{k}: {r}" for k, r in reasons.items())
                           + ". Set model.gdn_kernels: auto (or torch), or install a working fla (+ tilelang on Hopper)")
    for k in GLOBALS:
        _set(k, fns.get(k) if chosen[k] == "fla" else None, chosen[k])
    key = (mode, tuple(sorted(chosen.items())))
    if _STATE["mode"] != key:
        _STATE["mode"] = key
        for k, r in reasons.items():
            if mode == "auto" and device.type == "cuda":
                log.warning("GDN kernel %s: fla not qualified here (%s); running the PyTorch reference instead", k, r)
        log.info("GDN kernels: %s", ", ".join(f"{k}={v}" for k, v in chosen.items()))
    return dict(chosen)


def chosen() -> dict[str, str]:
    return dict(_STATE["chosen"])


def install_default() -> None:
    """The PyTorch reference for every GDN kernel, once per process, unless a choice was made already: nothing in
    this project runs a kernel transformers picked by itself (engine.model calls this on import)."""
    if not _STATE["chosen"]:
        for k in GLOBALS:
            _set(k, None, "torch")
