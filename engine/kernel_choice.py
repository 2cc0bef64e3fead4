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


def as_accurate(kernel_rel: float, torch_rel: float, kernel_max: float, torch_max: float,
                tolerance: tuple[float, float], max_abs_factor: float) -> bool:
    """A kernel's errors against an FP64 reference are within the stated tolerance of the PyTorch path's: relative
    L2 <= tolerance[0] x PyTorch's + tolerance[1], largest elementwise error <= max_abs_factor x PyTorch's +
    tolerance[1]."""
    return (kernel_rel <= tolerance[0] * torch_rel + tolerance[1]
            and kernel_max <= max_abs_factor * torch_max + tolerance[1])


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
