"""What every stage needs: the run's config, its directory layout, seeds, timers."""

from __future__ import annotations

import hashlib
import sys
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import yaml

from artifacts import RunDir, sha256_file
from configs.schema import RunConfig, config_hash


@lru_cache(maxsize=8)
def _load(path: str, digest: str) -> RunConfig:
    from pydantic import ValidationError

    try:
        return RunConfig.model_validate(yaml.safe_load(Path(path).read_text()))
    except ValidationError as exc:
        raise ValueError(f"{path} does not validate with this version of the trainer (was the run started by an "
                         f"older one?): {exc.errors()[0]['msg']}. Start a new run directory.") from None


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


class Laps:
    """Seconds since the previous lap into out[key], for the parts of a stage (with sync: once the device's queued
    work has finished; torch is not imported here)."""

    def __init__(self, out: dict):
        self.out, self.t = out, time.perf_counter()

    def __call__(self, key: str, sync: bool = False) -> None:
        torch = sys.modules.get("torch")
        if sync and torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.out[key] = round(now - self.t, 4)
        self.t = now


@contextmanager
def timer(out: dict, key: str = "wall_s"):
    """Wall seconds of the block into out[key]; for a stage's own timer (key wall_s) on a GPU also the peak
    allocated device memory during the block, out["peak_gb"] (torch is not imported here: gym stages run without it)."""
    def cuda():
        torch = sys.modules.get("torch")
        return torch if key == "wall_s" and torch is not None and torch.cuda.is_initialized() else None

    retries = 0
    if (torch := cuda()) is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out[key] = round(time.perf_counter() - t0, 4)
        if (torch := cuda()) is not None:  # also when the block started CUDA (a stage that loads its engine)
            torch.cuda.synchronize()
            out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
            # allocations that found no free block, so the allocator released its cache and tried again (each one
            # synchronizes the device): a stage planned near the memory budget shows them here
            out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            # what the stage dropped (a fresh verification engine, spent replay graphs) goes back to the device
            # before the next stage plans its memory (the replay preflight reads free memory)
            import gc

            gc.collect()
            torch.cuda.empty_cache()


def env_factory(cfg: RunConfig, run_dir: str | Path | None = None):
    """A zero-argument builder of the configured gym. With ``gym.transport: http`` and a run directory, the
    gym's tools go through the run's tool server (started on first use); otherwise they run in-process."""
    from gyms.registry import make_env_factory

    options = {"max_turns": cfg.gym.max_turns, **cfg.gym.options}
    if cfg.gym.transport == "http" and run_dir is not None:
        options["tool_client"] = tool_client(cfg, run_dir)
    return make_env_factory(cfg.gym.name, options)


def run_tag(run_dir: str | Path) -> str:
    """A short run-unique tag for episode ids: the directory name and a digest of its absolute path."""
    p = Path(run_dir).resolve()
    return f"{p.name}-{hashlib.sha256(str(p).encode()).hexdigest()[:8]}"


_POOLS: dict[tuple[str, str], object] = {}
_SERVERS: dict[tuple[str, str], object] = {}
_CLIENTS: dict[tuple[str, str], object] = {}


def _gym_key(cfg: RunConfig, run_dir: str | Path) -> tuple[str, str]:
    """Key of a run's live gym objects in this process (pool, tool server, client)."""
    return str(Path(run_dir).resolve()), config_hash(cfg, "gym")


def episode_pool(cfg: RunConfig, run_dir: str | Path):
    """This process's live environments of the run (see ``gyms.episodes.EnvPool``)."""
    from gyms.episodes import EnvPool

    key = _gym_key(cfg, run_dir)
    if key not in _POOLS:
        _POOLS[key] = EnvPool(env_factory(cfg, run_dir))
    return _POOLS[key]


def tool_server_factory_path(name: str) -> str:
    """The import path the tool server builds the gym's tools from (``gyms.<module>:<Class>`` for built-ins)."""
    from gyms.registry import BUILTIN_GYMS

    if name in BUILTIN_GYMS:
        factory = BUILTIN_GYMS[name]
        return f"{factory.__module__}:{factory.__qualname__}"
    return name


def tool_client(cfg: RunConfig, run_dir: str | Path):
    """The run's HTTP tool client; starts the run's tool server on 127.0.0.1 unless ``tool_server.url`` is set."""
    from gyms.transport import HttpToolClient

    ts = cfg.gym.tool_server
    key = _gym_key(cfg, run_dir)
    if key in _CLIENTS:
        return _CLIENTS[key]
    logs = RunDir(run_dir).tool_server_logs()
    logs.mkdir(parents=True, exist_ok=True)
    url = ts.url
    if url is None:
        url = _start_own_tool_server(cfg, run_dir).url
    client = HttpToolClient(url, timeout_s=ts.timeout_s, max_attempts=ts.max_attempts,
                            backoff_base_s=ts.backoff_base_s, backoff_max_s=ts.backoff_max_s,
                            seed=seed_for(cfg.seed, "tool-client"), journal_path=logs / "client-faults.jsonl")
    _CLIENTS[key] = client
    return client


def _start_own_tool_server(cfg: RunConfig, run_dir: str | Path):
    """Start the run's own tool server, stopped at exit, and record it as the run's."""
    import atexit

    from gyms.launcher import start_tool_server
    from gyms.server import FaultConfig

    ts = cfg.gym.tool_server
    logs = RunDir(run_dir).tool_server_logs()
    logs.mkdir(parents=True, exist_ok=True)
    faults = None
    if ts.faults.rate > 0:
        # an injected "timeout" must outlast the client's per-attempt timeout to be one
        faults = FaultConfig(rate=ts.faults.rate, kinds=tuple(ts.faults.kinds), seed=ts.faults.seed,
                             timeout_s=ts.timeout_s + 1.0)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            server = start_tool_server(tool_server_factory_path(cfg.gym.name),
                                       {"max_turns": cfg.gym.max_turns, **cfg.gym.options}, faults=faults,
                                       fault_log=logs / "faults.jsonl", log_path=logs / "server.log")
            break
        except RuntimeError as exc:  # it died or did not listen: say so, start another (the soak drill found this)
            if attempt == START_ATTEMPTS:
                raise
            _warn(f"the run's tool server did not start ({str(exc).splitlines()[0]}); started another "
                  f"(attempt {attempt + 1} of {START_ATTEMPTS})")
    atexit.register(server.stop)
    _SERVERS[_gym_key(cfg, run_dir)] = server
    return server


START_ATTEMPTS = 3  # starts of the run's tool server before a stage fails on it


def _warn(msg: str) -> None:
    import logging

    from artifacts.progress import warn

    warn(logging.getLogger("lgrpo.gym"), msg)


def restart_dead_tool_server(cfg: RunConfig, run_dir: str | Path) -> bool:
    """If the tool server this run started has died, start a new one and point the run's client at it (the next
    attempt of the failed stage then finds it); True when it did. A server given by `tool_server.url` is the
    user's to restart: nothing is done for it."""
    key = _gym_key(cfg, run_dir)
    old = _SERVERS.get(key)
    if old is None or old.alive():
        return False
    new = _start_own_tool_server(cfg, run_dir)
    if key in _CLIENTS:
        _CLIENTS[key].retarget(new.url)
    _warn(f"the run's tool server (pid {old.pid}) had died; restarted it at {new.url} (pid {new.pid})")
    return True


def reward_functions(cfg: RunConfig) -> list[tuple[str, object]]:
    """The configured TRL-style reward functions, imported (a bad path fails with what to fix)."""
    import importlib

    funcs = []
    for path in cfg.gym.reward_funcs:
        module_name, _, attr = path.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"gym.reward_funcs: cannot import {path!r} ({exc}); "
                             "give `package.module:function` importable from the run's working directory") from exc
        if not callable(fn):
            raise ValueError(f"gym.reward_funcs: {path!r} is {type(fn).__name__}, not a function")
        funcs.append((path, fn))
    return funcs
