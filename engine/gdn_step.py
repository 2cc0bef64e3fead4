"""One token of a Gated DeltaNet layer in the static decoder: gates and recurrent step in one kernel, state in place.

Why: in the graphed latent step and decoded token of the 27B (48 GDN layers, 4 rows), transformers' module computes
the gates as a chain of small kernels (sigmoid; A_log cast, exp, negation; a cast, + dt_bias, softplus, product),
copies q, k and v out of the conv output for the recurrent kernel, and copies the new FP32 state (12.6 MB per layer)
back into the cache: about 11 launches per layer beside the recurrent kernel itself, ~1 ms of a 22 ms step on an H200
(h200-recipe-27b-nf4-kernels-2026-12-03.json: exp, softplus, sigmoid, casts, device-to-device copies).

What: `gdn_step` (engine/_gdn_step_triton.py) reads q, k, v straight from the conv output, the raw a and b
projections, A_log and dt_bias, and updates the cache's state in place, with transformers' arithmetic in FP32 (beta
rounded to BF16 as `b.sigmoid()` rounds it; l2norm as rsqrt; q divided by sqrt(K)). The rest of the layer stays the
module's own: its projections (with the adapter forwards), the installed conv update, the gated norm, out_proj.

Where: only in engine/cuda_graphs' static decoder (a StaticHybridCache, one token, no padding mask, after the
prefill): the same forward runs eagerly and inside the captured graph, so thoughts stay bitwise equal between them.
Prefill and replay keep transformers' forward (their chunked kernel), as before.

Use: `install(mode, config, device)` after engine.gdn.install (engine.runtime.build does; mode: model.gdn_kernels,
torch = never): the kernel is qualified on the device first by engine.gdn's rule -- output and new state (BF16
inputs) against transformers' path in FP32, relative L2 within gdn.QUALIFY_REL_L2 and at most gdn.QUALIFY_VS_TORCH
times transformers' own BF16 error -- and used only if it passes, with one log line otherwise.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from engine import gdn
from engine.kernel_choice import choose, interpret, kernel_errors

log = logging.getLogger("lgrpo.gdn")

BV, WARPS = 32, 4  # value columns per program (a K x BV FP32 state tile), warps per program
_STATE: dict = {"devices": set(), "orig": None, "launches": 0}


def step_fused(x, a, b, A_log, dt_bias, state, n_k_heads: int, k_dim: int) -> torch.Tensor:
    """x (rows, 2*H*K + HV*V) the conv output (unit column stride), a and b (rows, HV), state (rows, HV, K, V) FP32
    contiguous, updated in place. Returns o (rows, HV, V) BF16 (x is BF16)."""
    from engine._gdn_step_triton import gdn_step

    rows, hv, kd, vd = state.shape
    if kd != k_dim or x.shape[1] != 2 * n_k_heads * k_dim + hv * vd or state.dtype != torch.float32 \
            or not state.is_contiguous() or x.stride(1) != 1 or a.stride(-1) != 1 or b.stride(0) != a.stride(0):
        raise ValueError(f"gdn_step: layouts do not fit (x {tuple(x.shape)}, state {tuple(state.shape)} "
                         f"{state.dtype}, H {n_k_heads}, K {k_dim})")
    bv = min(BV, vd)
    if vd % bv or hv % n_k_heads:
        raise ValueError(f"gdn_step: V {vd} not a multiple of {bv} or {hv} value heads not a multiple of {n_k_heads}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"gdn_step: BF16 activations only, got {x.dtype}")
    o = torch.empty(rows, hv, vd, dtype=x.dtype, device=x.device)
    _STATE["launches"] += 1
    meta = {} if interpret() else {"num_warps": WARPS}
    gdn_step[(rows * hv * (vd // bv),)](x, a, b, A_log, dt_bias, state, o, x.stride(0), a.stride(0),
                                          float(k_dim ** 0.5), 1e-6, H=n_k_heads, HV=hv, K=k_dim, V=vd, BV=bv, **meta)
    return o


def step_reference(x, a, b, A_log, dt_bias, state, n_k_heads: int, k_dim: int) -> torch.Tensor:
    """transformers' arithmetic for the same step (its module's gates + torch_recurrent_gated_delta_rule); the state
    updated in place like the cache update does."""
    rows, hv, _, vd = state.shape
    q, k, v = torch.split(x, [n_k_heads * k_dim, n_k_heads * k_dim, hv * vd], dim=-1)
    q, k, v = q.reshape(rows, 1, n_k_heads, k_dim), k.reshape(rows, 1, n_k_heads, k_dim), v.reshape(rows, 1, hv, vd)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if hv != n_k_heads:
        q, k = q.repeat_interleave(hv // n_k_heads, dim=2), k.repeat_interleave(hv // n_k_heads, dim=2)
    o, new = gdn.reference("recurrent")(q, k, v, g=g[:, None], beta=beta[:, None], initial_state=state,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(new)
    return o.reshape(rows, hv, vd)


def _inputs(layout: dict, rows: int, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hk, hv, dk, dv = layout["hk"], layout["hv"], layout["dk"], layout["dv"]
    x = torch.randn(rows, 2 * hk * dk + hv * dv, generator=g)
    a, b = torch.randn(rows, hv, generator=g), torch.randn(rows, hv, generator=g) * 2
    A_log = torch.log(torch.empty(hv).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(hv, generator=g)
    state = torch.randn(rows, hv, dk, dv, generator=g) * 0.1
    return [t.to(device) for t in (x, a, b, A_log, dt_bias, state)]


def qualify_one(fn, layout: dict, rows: int, device, seed: int = 0) -> dict:
    """`fn` on BF16 inputs (the model's: x, a, b, A_log, dt_bias in BF16, the state FP32) and transformers' path in
    BF16, each against transformers' path in FP32 on the same values: output and new state, engine.gdn's rule. Also
    that `fn` updated the state in place (the captured graph reads the cache's own buffer)."""
    x, a, b, A_log, dt_bias, state = _inputs(layout, rows, device, seed)
    bf = [t.bfloat16() for t in (x, a, b, A_log, dt_bias)]
    ref_state, tb_state, st = state.clone(), state.clone(), state.clone()
    ptr = st.data_ptr()
    try:
        ref = step_reference(*[t.float() for t in bf], ref_state, layout["hk"], layout["dk"])
        tb = step_reference(*bf, tb_state, layout["hk"], layout["dk"])
        got = fn(*bf, st, layout["hk"], layout["dk"])
    except (ValueError, *kernel_errors()) as e:  # a kernel that does not build or run here is not qualified
        return {"kernel": "step", "rows": rows, "passed": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    errs = {"o": gdn._rel(got, ref), "state": gdn._rel(st, ref_state)}
    torch_errs = {"o": gdn._rel(tb, ref), "state": gdn._rel(tb_state, ref_state)}
    in_place = st.data_ptr() == ptr and not torch.equal(st, state)
    return {"kernel": "step", "rows": rows, "passed": in_place and gdn.within_rule(errs, torch_errs), "rel_l2": errs,
            "torch_bf16_rel_l2": torch_errs, "in_place": in_place}


def qualify(layout: dict, device, fn=step_fused) -> dict:
    res = {"passed": True, "cases": []}
    for rows, seed in ((1, 0), (4, 1), (16, 2)):
        c = qualify_one(fn, layout, rows, device, seed)
        res["cases"].append(c)
        res["passed"] &= c["passed"]
    return res


# -- the module's forward in the static decoder -----------------------------------------------------------------------

def enabled(x: torch.Tensor) -> bool:
    return (x.is_cuda or interpret()) and str(x.device) in _STATE["devices"]


def fused_forward(mod, hidden_states: torch.Tensor, slot) -> torch.Tensor:
    """transformers' GDN forward for one token on a filled static cache slot (engine.cuda_graphs._LinearSlot), with
    the gates and the recurrent step in gdn_step and the slot's state updated in place."""
    B = hidden_states.shape[0]
    mixed = mod.in_proj_qkv(hidden_states).transpose(1, 2)
    z = mod.in_proj_z(hidden_states)
    b = mod.in_proj_b(hidden_states).reshape(B, -1)
    a = mod.in_proj_a(hidden_states).reshape(B, -1)
    y = gdn._mq().causal_conv1d_update(mixed, slot.conv_states[0], mod.conv1d.weight.squeeze(1), mod.conv1d.bias,
                                       mod.activation)
    x = y.transpose(1, 2).reshape(B, -1)
    if x.stride(1) != 1:
        x = x.contiguous()
    o = step_fused(x, a, b, mod.A_log, mod.dt_bias, slot.recurrent_states[0], mod.num_k_heads, mod.head_k_dim)
    core = mod.norm(o.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))
    return mod.out_proj(core.reshape(B, 1, -1))


def _patch() -> None:
    """Route transformers' GDN forward through `fused_forward` where it applies (once per process)."""
    if _STATE["orig"] is not None:
        return
    mq = gdn._mq()
    orig = mq.Qwen3_5GatedDeltaNet.forward
    names = list(inspect.signature(orig).parameters)[2:4]  # the cache's name (cache / cache_params), attention_mask

    def forward(self, hidden_states, *args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        cache, mask = bound.get(names[0]), bound.get("attention_mask")
        if (mask is None and hidden_states.shape[1] == 1 and hidden_states.dtype == torch.bfloat16
                and getattr(cache, "gdn_steps_in_place", False) and cache.filled and enabled(hidden_states)):
            slot = cache.layers[self.layer_idx]
            st = slot.recurrent_states[0]
            if st is not None and st.dtype == torch.float32 and st.is_contiguous():
                return fused_forward(self, hidden_states, slot)
        return orig(self, hidden_states, *args, **kwargs)

    mq.Qwen3_5GatedDeltaNet.forward = forward
    _STATE["orig"] = (mq, orig)


def install(mode: str, config, device) -> str:
    """Choose the static decoder's GDN step for `device`: mode torch -> transformers' forward; auto or fla -> the
    fused step where it qualifies (model.gdn_kernels). Returns "fused" or "torch"."""
    layout = gdn.layout_of(config)
    return choose("model.gdn_kernels", "GDN single-token step", "transformers' forward",
                  "torch" if mode == "torch" else "auto", device, _STATE["devices"],
                  lambda dev: qualify(layout, dev), lambda q: [c for c in q["cases"] if not c["passed"]], log,
                  "against transformers' FP32 path", allow_interpreter=True, on_pass=_patch)


def reset() -> None:
    """Forget every choice and restore transformers' forward (tests)."""
    _STATE["devices"].clear()
    if _STATE["orig"] is not None:
        mq, orig = _STATE["orig"]
        mq.Qwen3_5GatedDeltaNet.forward = orig
        _STATE["orig"] = None
