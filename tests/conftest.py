"""Shared fixtures: a small but real run configuration, a prepared run directory, the Prefect test harness."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

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
    from flows.train import init_run_dir
    from stages.prepare import prepare_run

    cfg = load_config("tiny", {**SMALL, "run_dir": str(tmp_path), **overrides})
    rd = init_run_dir(cfg)
    prepare_run(str(rd.root))
    return str(rd.root)
