"""The choice of an optional Triton kernel family for a device, shared by engine/adapter_kernels.py and
engine/norm_kernels.py: a mode (auto | torch), qualification on the device before first use, one log line saying
which path runs and why."""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch


def interpret() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1): the kernels run on the CPU (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_errors() -> tuple[type[BaseException], ...]:
    """What a Triton kernel raises when it cannot be built or launched here (compile errors, out of resources,
    driver errors); anything else is a bug and propagates."""
    errs: list[type[BaseException]] = [RuntimeError, ImportError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        errs += [CompilationError, OutOfResources]
    except ImportError:
        pass
    return tuple(errs)


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of a against an FP64 reference."""
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def error_stats(kernel_out: torch.Tensor, torch_out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The kernel's and the PyTorch path's errors against the same FP64 reference: relative L2 and largest."""
    return {"kernel_rel_l2": rel_l2(kernel_out, ref), "torch_rel_l2": rel_l2(torch_out, ref),
            "kernel_max_abs": float((kernel_out.double() - ref).abs().max()),
            "torch_max_abs": float((torch_out.double() - ref).abs().max())}


def qualification(cases, check: Callable[..., dict], **extra) -> dict:
    """Run check(*case) for every case (each returns a dict with "passed"); passed = all of them. A kernel that
    cannot be built or launched here fails the qualification with the reason (logged by `choose`)."""
    res = {"passed": True, "cases": [], **extra}
    try:
        for c in cases:
            case = check(*c)
            res["cases"].append(case)
            res["passed"] &= bool(case["passed"])
    except kernel_errors() as e:
        res.update(passed=False, error=f"{type(e).__name__}: {e}")
    return res


def as_accurate(e: dict, tolerance: tuple[float, float], max_abs_factor: float) -> bool:
    """error_stats `e` within the stated tolerance of the PyTorch path's: relative L2 <= tolerance[0] x PyTorch's +
    tolerance[1], largest elementwise error <= max_abs_factor x PyTorch's + tolerance[1]."""
    return (e["kernel_rel_l2"] <= tolerance[0] * e["torch_rel_l2"] + tolerance[1]
            and e["kernel_max_abs"] <= max_abs_factor * e["torch_max_abs"] + tolerance[1])


def choose(setting: str, what: str, fallback: str, mode: str, device, devices: set[str],
           qualify: Callable[[torch.device], dict], failed: Callable[[dict], list], log: logging.Logger,
           qualified_as: str, allow_interpreter: bool = False, on_pass: Callable[[], None] | None = None) -> str:
    """Choose for `device`: mode torch -> `fallback` always; auto -> the fused kernels if `qualify(device)` passes
    (then `on_pass()` and the device joins `devices`), else `fallback` with one warning naming the failed cases.
    Off CUDA the fallback runs (unless the interpreter is on and allow_interpreter). Returns "fused" or "torch"."""
    if mode not in ("auto", "torch"):
        raise ValueError(f"{setting}={mode!r}: one of auto, torch")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device; tensors say "cuda:N"
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if mode == "torch" or (device.type != "cuda" and not (allow_interpreter and interpret())):
        devices.discard(key)
        return "torch"
    if key in devices:
        return "fused"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        log.warning("%s: Triton is not importable (%s); running %s", what, e, fallback)
        return "torch"
    q = qualify(device)
    if q["passed"]:
        if on_pass is not None:
            on_pass()
        devices.add(key)
        log.info("%s: fused Triton kernels (qualified %s on %s)", what, qualified_as, key)
        return "fused"
    log.warning("%s: fused kernels not qualified on %s (%s); running %s", what, key, q.get("error") or failed(q)[:2],
                fallback)
    return "torch"
