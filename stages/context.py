"""What every stage needs: the run's config, its directory layout, seeds, timers."""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import yaml

from artifacts import RunDir, sha256_file
from configs.schema import RunConfig


@lru_cache(maxsize=8)
def _load(path: str, digest: str) -> RunConfig:
    return RunConfig.model_validate(yaml.safe_load(Path(path).read_text()))


def run_config(run_dir: str | Path) -> RunConfig:
    """The config frozen into the run directory at its start (config.yaml)."""
    p = RunDir(Path(run_dir)).config()
    if not p.exists():
        raise FileNotFoundError(f"{p} missing: {run_dir} is not a run directory (start one with `lgrpo train`)")
    return _load(str(p), sha256_file(p))


def seed_for(*parts: object) -> int:
    """A 63-bit seed derived from the parts (run seed, step, turn, role)."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def generator(*parts: object):
    import torch

    return torch.Generator().manual_seed(seed_for(*parts))


@contextmanager
def timer(out: dict, key: str = "wall_s"):
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out[key] = round(time.perf_counter() - t0, 4)


def env_factory(cfg: RunConfig):
    from gym.registry import make_env_factory

    return make_env_factory(cfg.gym.name, {"max_turns": cfg.gym.max_turns, **cfg.gym.options})
