"""Gym lookup by name: a built-in (``table``, ``research``, ``synthetic``) or an import path ``pkg.module:Factory``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from gyms.protocol import Env
from gyms.research import ResearchGym
from gyms.synthetic import SyntheticGym
from gyms.table import TableGym

BUILTIN_GYMS: dict[str, Callable[..., Env]] = {"table": TableGym, "research": ResearchGym, "synthetic": SyntheticGym}


class GymRegistryError(ValueError):
    """The gym name cannot be resolved, or what it names does not follow the ``Env`` protocol."""


def _import_factory(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise GymRegistryError(f"gym {path!r}: an import path must look like 'pkg.module:Factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GymRegistryError(f"gym {path!r}: cannot import module {module_name!r} ({exc})") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise GymRegistryError(f"gym {path!r}: module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise GymRegistryError(f"gym {path!r}: {attr!r} is not callable (got {type(factory).__name__})")
    return factory


def resolve_factory(name: str) -> Callable[..., Any]:
    """The class or function that builds the gym ``name`` (not yet called)."""
    if name in BUILTIN_GYMS:
        return BUILTIN_GYMS[name]
    if ":" in name:
        return _import_factory(name)
    raise GymRegistryError(
        f"unknown gym {name!r}: use a built-in ({', '.join(sorted(BUILTIN_GYMS))}) or 'pkg.module:Factory'"
    )


def _build(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> Env:
    try:
        env = factory(**options)
    except TypeError as exc:
        raise GymRegistryError(f"gym {name!r}: options {sorted(options)} rejected by its factory ({exc})") from exc
    if not isinstance(env, Env):
        raise GymRegistryError(
            f"gym {name!r}: the factory returned {type(env).__name__}, which lacks reset(task) and step(answer_text)"
        )
    return env


def make_env_factory(name: str, options: dict[str, Any] | None = None) -> Callable[[], Env]:
    """A zero-argument callable returning a fresh environment on each call.

    One environment is built right away so a bad name, bad options or a non-``Env`` object fail here,
    with a message that says which, instead of inside a rollout.
    """
    options = dict(options or {})
    factory = resolve_factory(name)
    _build(name, factory, options)

    def make() -> Env:
        return _build(name, factory, options)

    return make
