"""Shared fixtures: a small but real run configuration, a prepared run directory, the Prefect test harness."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# tests build their own tokenizers and bases: the cache shared by runs (artifacts/shared_cache.py) stays out of them
# unless a test turns it on for itself (tests/test_shared_cache.py)
os.environ["LGRPO_CACHE_DIR"] = "off"

# The embedded default, shrunk so a step takes seconds: same model, gym, stages and gates.
SMALL = {
    "bootstrap.episodes": 8,
    "bootstrap.epochs": 1,
    "bootstrap.batch_size": 8,
    "grpo.groups_per_step": 2,
    "grpo.num_generations": 2,
    "gym.max_turns": 2,
    "gym.eval_tasks": 2,
    "sampler.max_answer_tokens": 12,
    "threads": 1,
}


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: str(results)}):
        with prefect_test_harness(server_startup_timeout=180):
            yield


def make_run(tmp_path, **overrides) -> str:
    """Create a run directory and prepare it (tokenizer, small bootstrap, initial adapter) through the stages."""
    from configs.schema import load_config
    from stages.prepare import init_run_dir
    from stages.prepare import prepare_run

    cfg = load_config("tiny", {**SMALL, "run_dir": str(tmp_path), **overrides})
    rd = init_run_dir(cfg)
    prepare_run(str(rd.root))
    return str(rd.root)


def fresh_step(run_dir: str, step: int, adapter: str) -> dict:
    """One fresh step through the stages (no Prefect): generation, gym, rollouts, replay, optimize."""
    from artifacts import read_json
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from stages.gym import run_gym
    from stages.rollouts import collect_rollouts
    from stages.optimize import optimize
    from stages.replay import replay

    cfg = run_config(run_dir)
    base = read_json(f"{run_dir}/prepared.json")["base"]
    export = export_base(run_dir, base)["path"]
    state = sample_tasks(run_dir, step, base)["path"]
    turns, gyms, gen = [], [], []
    for turn in range(cfg.gym.max_turns):
        tr = generate_turn(run_dir, step, turn, state, adapter, export, base)
        gen.append(tr | {"state_in": state})
        gr = run_gym(run_dir, step, turn, state, tr["path"], base)
        turns.append(tr["path"])
        gyms.append(gr["path"])
        state = gr["path"]
        if gr["all_done"]:
            break
    ro = collect_rollouts(run_dir, step, turns, gyms)
    rp = replay(run_dir, step, ro["path"], adapter, base, True)
    prev_opt = None if step == 0 else f"{run_dir}/step-{step - 1:04d}/optimizer.safetensors"
    op = optimize(run_dir, step, ro["path"], rp["path"], rp["path"], adapter, prev_opt, base)
    return {"rollouts": ro["path"], "export": export, "base": base, "replay": rp, "optimize": op, "generate": gen,
            "collect": ro}
