"""Fused RMSNorms of the Qwen3.5 hybrid on CUDA: one kernel per norm and direction instead of a chain of FP32 passes.

Why: transformers' Qwen3_5RMSNorm and Qwen3_5RMSNormGated are written as PyTorch expressions in FP32 -- cast, pow,
mean, add, rsqrt, mul, mul, cast (and for the gated norm of every GDN layer the silu gate) -- each a kernel that
reads and writes the whole (tokens x width) tensor, and autograd keeps their FP32 intermediates and runs a longer
chain backward. Measured on one H200 at the 27B width (bench/results/h200-replay-attribution-nf4-fused-2026-12-01.json,
NF4 + DoRA r16, 7,281 tokens, 8 layers): the three norms of a layer took 57 ms of 413 ms attributed kernel time
(forward, checkpoint recompute and backward), ~14 % of replay; in a batch-4 decode step each norm is ~8 launches.

What: Triton kernels with the same operations and rounding points as transformers' expressions --

    Qwen3_5RMSNorm        out = bf16((x * rsqrt(mean(x^2) + eps)) * (1 + w))                      (FP32 inside)
    Qwen3_5RMSNormGated   out = bf16(hw * silu(z)),  hw = w * bf16(x * rsqrt(mean(x^2) + eps))    (hw BF16 if w is)

-- and their input gradients (the base's norm weights are frozen: no weight gradient; a norm whose weight requires
a gradient keeps transformers' forward), rounded where autograd rounds them. Autograd keeps only x (and z): the
BF16 inputs, no FP32 copies. The row reduction is Triton's, not ATen's, so results are not bit for bit PyTorch's;
each row is reduced the same way whatever the batch around it (one program per block of rows, one fixed lane
layout per width), so a row's output does not depend on how many rows share its forward (decode, prefill and
replay compute a token's norm identically).

Use: `install(mode, device)` once per process before the first forward (engine.runtime does, beside the GDN and
adapter-kernel choices; model.norm_kernels). mode auto qualifies the kernels on the device -- outputs and input
gradients against an FP64 evaluation of the same expression must be as accurate as PyTorch's own FP32 chain
(relative L2 within 1.25x of PyTorch's error plus 1e-6, largest elementwise error within 2x), on widths 5120, 256,
128 and an odd one -- and
uses them only if they pass, with one log line otherwise; torch keeps transformers' forwards. On a CPU transformers'
forwards always run; the kernels also run under TRITON_INTERPRET=1 (tests/test_norm_kernels.py). The choice is
process-wide (the norm classes' forwards), so every engine of the process -- trainer, sampler, probe -- computes
the same norms, which the bitwise engine-to-engine contracts (shared prefix cache, teacher-forced probe) need.
"""

from __future__ import annotations

import logging

import torch

from engine.kernel_choice import choose, interpret, kernel_errors

log = logging.getLogger("lgrpo.norms")

_STATE: dict = {"devices": set(), "launches": 0, "orig": None}
_K: dict = {}
ROWS_PER_PROGRAM_ELEMS = 4096  # BR * BN per program (BR >= 1)
MAX_WIDTH = 16384


def _kernels() -> dict:
    if not _K:
        from engine import _norm_triton as T

        _K.update(rms_fwd=T.rms_fwd, rms_bwd=T.rms_bwd, gated_fwd=T.gated_fwd, gated_bwd=T.gated_bwd)
    return _K


def _launch(name: str, n_rows: int, n_cols: int, *args, **meta):
    import triton

    _STATE["launches"] += 1  # counted (tests check the fused path really ran)
    BN = triton.next_power_of_2(n_cols)
    BR = max(1, ROWS_PER_PROGRAM_ELEMS // BN)
    grid = (triton.cdiv(n_rows, BR),)
    kernel = _kernels()[name]
    extra = {} if interpret() else {"enable_fp_fusion": False, "num_warps": 8 if BN * BR >= 4096 else 4}
    return kernel[grid](*args, BR=BR, BN=BN, **meta, **extra)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as (rows, n) with unit column stride (a view when the layout allows: e.g. the query half of q_proj's
    output, rows 2n apart), else a contiguous copy."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


# -- the references: transformers' own forwards (what runs on the CPU and where the kernels do not qualify) ---------

def _reference_forwards():
    """(Qwen3_5RMSNorm.forward, Qwen3_5RMSNormGated.forward) as transformers ships them, patched or not."""
    if _STATE["orig"] is not None:
        return _STATE["orig"][1:]
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    return mq.Qwen3_5RMSNorm.forward, mq.Qwen3_5RMSNormGated.forward


def _module(cls_name: str, w: torch.Tensor, eps: float):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    mod = getattr(mq, cls_name)(w.shape[0], eps=eps)
    mod.weight = torch.nn.Parameter(w, requires_grad=False)
    return mod


def rms_torch(x, w, eps: float):
    return _reference_forwards()[0](_module("Qwen3_5RMSNorm", w, eps), x)


def gated_torch(x, z, w, eps: float):
    return _reference_forwards()[1](_module("Qwen3_5RMSNormGated", w, eps), x, z)


# -- the fused side ------------------------------------------------------------------------------------------------------

class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        n = x.shape[-1]
        x2 = _rows(x, n)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        _launch("rms_fwd", x2.shape[0], n, x2, w, out, x2.shape[0], n, x2.stride(0), 1.0 / n, float(eps))
        ctx.save_for_backward(x2, w)
        ctx.eps, ctx.shape = float(eps), x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        n = x2.shape[1]
        g2 = g.reshape(-1, n).contiguous()
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        _launch("rms_bwd", x2.shape[0], n, x2, w, g2, dx, x2.shape[0], n, x2.stride(0), 1.0 / n, ctx.eps)
        return dx.view(ctx.shape), None, None


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, w, eps):
        n = x.shape[-1]
        x2, z2 = _rows(x, n), _rows(z, n)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        round_hw = w.dtype == x.dtype
        _launch("gated_fwd", x2.shape[0], n, x2, z2, w, out, x2.shape[0], n, x2.stride(0), z2.stride(0), 1.0 / n,
                float(eps), ROUND_HW=round_hw)
        ctx.save_for_backward(x2, z2, w)
        ctx.eps, ctx.shapes, ctx.round_hw = float(eps), (x.shape, z.shape), round_hw
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, z2, w = ctx.saved_tensors
        n = x2.shape[1]
        g2 = g.reshape(-1, n).contiguous()
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        dz = torch.empty(z2.shape, dtype=z2.dtype, device=z2.device)
        _launch("gated_bwd", x2.shape[0], n, x2, z2, w, g2, dx, dz, x2.shape[0], n, x2.stride(0), z2.stride(0),
                1.0 / n, ctx.eps, ROUND_HW=ctx.round_hw)
        return dx.view(ctx.shapes[0]), dz.view(ctx.shapes[1]), None, None


def rms_fused(x, w, eps: float):
    _need(x, w)
    return _RMSNorm.apply(x, w, eps)


def gated_fused(x, z, w, eps: float):
    _need(x, w)
    if z.shape != x.shape or z.dtype != x.dtype:
        raise ValueError(f"gated norm: gate {tuple(z.shape)} {z.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _GatedNorm.apply(x, z, w, eps)


def _need(x, w) -> None:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the fused norms round to BF16; got {x.dtype} (use transformers' expressions)")
    if x.shape[-1] > MAX_WIDTH or w.shape != (x.shape[-1],):
        raise ValueError(f"fused norm: width {x.shape[-1]} with weight {tuple(w.shape)} (at most {MAX_WIDTH})")


# -- the choice ---------------------------------------------------------------------------------------------------------

def enabled(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Use the fused kernels for x (BF16, on a device where install qualified them, weight frozen, no autocast)."""
    return (x.dtype == torch.bfloat16 and (x.is_cuda or interpret()) and str(x.device) in _STATE["devices"]
            and not w.requires_grad and x.shape[-1] <= MAX_WIDTH and not torch.is_autocast_enabled())


def _patch() -> None:
    """Route transformers' Qwen3.5 norm forwards through `enabled` (once per process; removed by `reset`)."""
    if _STATE["orig"] is not None:
        return
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    plain, gated = mq.Qwen3_5RMSNorm.forward, mq.Qwen3_5RMSNormGated.forward

    def rms_forward(self, x):
        if enabled(x, self.weight):
            return rms_fused(x, self.weight, self.eps)
        return plain(self, x)

    def gated_forward(self, hidden_states, gate):
        if self.activation == "silu" and gate.dtype == hidden_states.dtype and enabled(hidden_states, self.weight):
            return gated_fused(hidden_states, gate, self.weight, self.variance_epsilon)
        return gated(self, hidden_states, gate)

    mq.Qwen3_5RMSNorm.forward, mq.Qwen3_5RMSNormGated.forward = rms_forward, gated_forward
    _STATE["orig"] = (mq, plain, gated)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _ref64(kind: str, x, z, w, eps: float):
    """The expression in FP64 (no intermediate rounding): the accuracy yardstick for both implementations."""
    xd = x.double()
    h = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms":
        return h * (1.0 + w.double())
    return (w.double() * h) * torch.nn.functional.silu(z.double())


TOLERANCE = (1.25, 1e-6)  # the kernel's relative L2 error vs FP64 <= 1.25 x PyTorch's FP32 chain's + 1e-6
MAX_ABS_FACTOR = 2.0  # and its largest elementwise error <= 2 x PyTorch's largest (one BF16 rounding step more)


def qualify(device, dtype=torch.bfloat16) -> dict:
    """Both kernels and both directions against PyTorch's expressions, measured against FP64 on random data: rows
    not a multiple of a program's rows, widths 5120 (hidden), 256 (attention heads), 128 (GDN heads) and 300 (odd),
    a strided input (the query half of a q_proj output), BF16 and FP32 gated-norm weights. Passed: every output and
    input gradient within TOLERANCE of PyTorch's own error (relative L2) and within MAX_ABS_FACTOR of its largest
    elementwise error, and a row's output the same alone as in a batch."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    res = {"passed": True, "cases": [], "tolerance": list(TOLERANCE)}
    eps = 1e-6

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    def check(case: dict, pairs) -> None:
        ok = True
        for name, k, t, ref in pairs:
            ek, et = _rel(k, ref), _rel(t, ref)
            mk, mt = float((k.double() - ref).abs().max()), float((t.double() - ref).abs().max())
            case[name] = {"kernel_rel_l2": ek, "torch_rel_l2": et, "kernel_max_abs": mk, "torch_max_abs": mt,
                          "equal_to_torch": float((k == t).float().mean())}
            ok &= bool(ek <= TOLERANCE[0] * et + TOLERANCE[1]) and bool(mk <= MAX_ABS_FACTOR * mt + TOLERANCE[1])
            ok &= bool(torch.isfinite(k).all())
        case["passed"] = ok
        res["cases"].append(case)
        res["passed"] &= ok

    try:
        for kind in ("rms", "gated"):
            for n_rows, n in ((37, 5120), (301, 256), (1030, 128), (7, 300)):
                for wdt in ((dtype,) if kind == "rms" else (dtype, torch.float32)):
                    strided = kind == "rms" and n == 256
                    xs = rnd(n_rows, 2 * n, scale=3.0) if strided else rnd(n_rows, n, scale=3.0)
                    x = xs[:, :n] if strided else xs
                    z = rnd(n_rows, n, scale=2.0)
                    w = (rnd(n, dt=torch.float32, scale=0.1) + (0.0 if kind == "rms" else 1.0)).to(wdt)
                    g = rnd(n_rows, n)
                    outs = {}
                    for impl in ("kernel", "torch"):
                        xi, zi = x.detach().clone().requires_grad_(True), z.detach().clone().requires_grad_(True)
                        if kind == "rms":
                            o = rms_fused(xi, w, eps) if impl == "kernel" else rms_torch(xi, w, eps)
                        else:
                            o = gated_fused(xi, zi, w, eps) if impl == "kernel" else gated_torch(xi, zi, w, eps)
                        o.backward(g)
                        outs[impl] = (o.detach(), xi.grad, zi.grad)
                    xd = x.detach().double().requires_grad_(True)
                    zd = z.detach().double().requires_grad_(True)
                    r = _ref64(kind, xd, zd, w, eps)
                    r.backward(g.double())
                    pairs = [("out", outs["kernel"][0], outs["torch"][0], r.detach()),
                             ("dx", outs["kernel"][1], outs["torch"][1], xd.grad)]
                    if kind == "gated":
                        pairs.append(("dz", outs["kernel"][2], outs["torch"][2], zd.grad))
                    case = {"kernel": kind, "rows": n_rows, "width": n, "weight": str(wdt).replace("torch.", ""),
                            "strided": strided}
                    # a row alone equals the same row in the batch, bit for bit (layout-independent reduction)
                    one = (rms_fused(x[3:4], w, eps) if kind == "rms" else gated_fused(x[3:4], z[3:4], w, eps))
                    case["row_alone_bitwise"] = bool(torch.equal(one[0], outs["kernel"][0][3]))
                    check(case, pairs)
                    if not case["row_alone_bitwise"]:
                        case["passed"] = False
                        res["passed"] = False
    except kernel_errors() as e:  # a kernel that does not build or run here is not qualified: the reason is logged
        res.update(passed=False, error=f"{type(e).__name__}: {e}")
    return res


def install(mode: str, device) -> str:
    """Choose the RMSNorm implementation for `device` in this process: torch (transformers' expressions) or auto
    (the fused kernels where they qualify; one log line says which runs and why). Returns "fused" or "torch"."""
    return choose("model.norm_kernels", "RMSNorm", "transformers' expressions", mode, device, _STATE["devices"],
                  qualify, lambda q: [c for c in q["cases"] if not c.get("passed", True)], log,
                  f"against FP64, within {TOLERANCE} of PyTorch's error", allow_interpreter=True, on_pass=_patch)


def reset() -> None:
    """Forget every choice and restore transformers' forwards (tests)."""
    _STATE["devices"].clear()
    if _STATE["orig"] is not None:
        mq, plain, gated = _STATE["orig"]
        mq.Qwen3_5RMSNorm.forward, mq.Qwen3_5RMSNormGated.forward = plain, gated
        _STATE["orig"] = None
