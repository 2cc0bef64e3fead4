"""The worker pool (engine/pool.py): gloo workers with a clean environment, a dead worker named at once and restarted,
stack dumps on SIGUSR1; generate-turn fanned out over two workers through Prefect with the rollouts of a run
without workers, and a worker SIGKILLed mid-turn failing its task by name before the retry completes it."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.conftest import make_run


@pytest.fixture()
def pool(tmp_path, monkeypatch):
    from engine.pool import WorkerPool

    monkeypatch.setenv("RANK", "5")  # what a launcher left in the driver's environment must not reach a worker
    monkeypatch.setenv("MASTER_PORT", "1")
    p = WorkerPool(tmp_path, 2, "cpu", threads=1)
    yield p
    p.close()


def test_workers_form_a_gloo_group_with_a_clean_environment(pool):
    assert pool.call_all("engine.pool.all_reduce_sum", lambda r: {"values": [1.0 + r, 10.0]}) == [[3.0, 20.0]] * 2
    env = pool.call(1, "engine.pool.info")["env"]
    assert env["RANK"] is None and env["MASTER_PORT"] is None and env["WORLD_SIZE"] is None
    assert env["TRITON_CACHE_DIR"].endswith("cache/triton")


def test_a_killed_worker_is_named_at_once_and_restarted_by_the_next_call(pool):
    from engine.pool import WorkerDied

    pid = pool.pids()[1]
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerDied, match=r"worker 1 died \(killed by SIGKILL\)"):
        pool.call(1, "engine.pool.info")
    assert time.perf_counter() - t0 < 5, "a dead worker must fail the call at once, never hang"
    assert pool.call(1, "engine.pool.info")["pid"] != pid  # restarted
    assert pool.call_all("engine.pool.all_reduce_sum", lambda r: {"values": [1.0]}) == [[2.0]] * 2  # group rebuilt


def test_sigusr1_dumps_every_workers_stacks(pool):
    pool.dump_stacks()
    deadline = time.time() + 10
    while time.time() < deadline:
        logs = [w.log.read_text(errors="replace") for w in pool.workers.values()]
        if all("most recent call first" in t and "_serve" in t for t in logs):  # the dump is written line by line
            break
        time.sleep(0.2)
    assert all("most recent call first" in t and "_serve" in t for t in logs), logs


def divide(a: float, b: float) -> float:
    return a / b


def raise_gate(gate: str) -> None:
    from engine.gates import GateFailed

    raise GateFailed(gate, "injected in a worker", {"where": "worker"})


def test_a_gate_failed_in_a_worker_stays_a_gate_failure_on_the_driver(pool):
    from engine.gates import GateFailed
    from engine.pool import WorkerError

    with pytest.raises(GateFailed, match=r"gate `replay-determinism` failed: injected in a worker \(in worker 1\)") as e:
        pool.call(1, "tests.test_pool.raise_gate", gate="replay-determinism")
    assert e.value.gate == "replay-determinism" and e.value.report == {"where": "worker"}
    with pytest.raises(WorkerError, match="ZeroDivisionError"):  # any other error: named, with the traceback
        pool.call(0, "tests.test_pool.divide", a=1, b=0)
    assert pool.call(0, "engine.pool.info")["rank"] == 0  # the worker goes on serving


def _turns(run_dir: str, step: int) -> list:
    from artifacts import RunDir, read_table

    rd = RunDir(run_dir)
    out = []
    for t in range(8):
        p = rd.turn(step, t)
        if not p.exists():
            break
        out.append(read_table(p).to_pydict())
    return out


@pytest.mark.slow
def test_two_steps_on_two_workers_through_prefect(prefect_harness, tmp_path, monkeypatch):
    """Fresh + reuse step with the pool: generate-turn and replay fanned out, the loss on the driver, backward in the
    workers, FP32 all-reduce, the same AdamW on both replicas; a worker SIGKILLed mid-turn fails its task by name
    and the retry completes. Against the run without workers: the same rollouts, adapters within 1e-6."""
    import torch

    from artifacts import RunDir, read_adapter_dir, read_json
    from engine import pool as P
    from flows.rerun import task_states
    from flows.step import grpo_step

    pattern = {"steps.pattern": ["fresh", "reuse"]}
    one = make_run(tmp_path / "one", **pattern)
    for step in (0, 1):
        assert grpo_step(one, step, return_state=True).is_completed()
    two = make_run(tmp_path / "two", workers=2, **pattern)
    monkeypatch.setenv("LGRPO_WORKER_KILL_AT", "1:generate-turn:0")  # worker 1 dies in its first turn, once
    try:
        s0 = grpo_step(two, 0, return_state=True)
        s1 = grpo_step(two, 1, return_state=True)
    finally:
        P.close_all()
    assert s0.is_completed() and s1.is_completed(), (s0, s1)
    st0, st1 = task_states(s0.state_details.flow_run_id), task_states(s1.state_details.flow_run_id)
    for name in ("generate-turn-0-0-w0", "generate-turn-0-0-w1", "gather-turn-0", "replay-0-w0", "replay-0-w1",
                 "gather-replay-0", "optimize-0"):
        assert st0[name] == "Completed", (name, st0)
    assert {"replay-1-w0", "replay-1-w1", "gather-replay-1", "optimize-1"} <= set(st1), st1

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[s0.state_details.flow_run_id])))
        w1 = [r for r in runs if r.name == "generate-turn-0-0-w1"][0]
        assert w1.run_count == 2, "the killed worker's task ran twice: failed, then retried on a restarted worker"
    from artifacts import read_jsonl

    events = [(e["event"], e["rank"], e.get("cause")) for e in read_jsonl(tmp_path / "two" / "logs" / "pool-events.jsonl")]
    assert events == [("died", 1, "killed by SIGKILL"), ("restarted", 1, None)], events  # the task's error said so too

    # the rollouts do not depend on placement: same rows, same answers, thoughts to float rounding
    a, b = _turns(one, 0), _turns(two, 0)
    assert len(a) == len(b) and len(a) > 0
    for ta, tb in zip(a, b):
        assert ta["row"] == tb["row"] and ta["answer_ids"] == tb["answer_ids"] and ta["answer_text"] == tb["answer_text"]
        for x, y in zip(ta["thoughts"], tb["thoughts"]):
            np.testing.assert_allclose(np.array(x, dtype=np.float32), np.array(y, dtype=np.float32), atol=1e-4)
    m = read_json(RunDir(two).metrics(0))
    assert [w["worker"] for w in m["generate_turns"][0]["workers"]] == [0, 1]
    assert read_json(RunDir(two).loss(0))["workers"] == 2
    # step 1 starts from the AdamW each worker kept after step 0 (the writer's file not read back), as in one process
    assert read_json(RunDir(two).metrics(0))["optimizer_kept"] == [False, False]
    assert read_json(RunDir(two).metrics(1))["optimizer_kept"] == [True, True]
    assert read_json(RunDir(one).metrics(1))["optimizer_kept"] is True
    for step in (0, 1):  # adapters: the all-reduced sum of two partial gradients against one sum
        _, ref = read_adapter_dir(RunDir(one).adapter(step))
        _, got = read_adapter_dir(RunDir(two).adapter(step))
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref) ** 0.5
        den = sum(float(ref[k].pow(2).sum()) for k in ref) ** 0.5
        assert num / den <= 1e-6, (step, num / den)


@pytest.mark.slow
def test_a_training_run_on_two_workers_ends_with_its_pool(prefect_harness, tmp_path):
    """`train` with workers=2: the held-out evaluation, the probe and the checkpoint verification run in worker 0,
    the steps on both; the pool's processes end with the run."""
    from configs.params import TrainParameters
    from engine import pool as P
    from flows.train import train
    from tests.conftest import SMALL

    overrides = {**SMALL, "workers": 2, "steps.total": 2, "gym.eval_tasks": 2}
    state = train(params=TrainParameters(config="tiny", run_dir=str(tmp_path / "run"), overrides=overrides),
                  return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["verified_checkpoint"]["identical"] and len(summary["steps"]) == 2
    assert not P._POOLS, "the run's pool is closed when the train flow ends"
    from engine import runtime

    held = [k for k in runtime._ENGINES if any(str(tmp_path) in str(x) for x in k)]
    assert not held, f"the driver built engines of its own: {held}"  # every model lives in the workers
    logs = sorted((tmp_path / "run" / "logs").glob("worker-*.log"))
    assert [p.name for p in logs] == ["worker-0.log", "worker-1.log"]


def test_a_worker_that_dies_while_starting_is_named_at_once(tmp_path, monkeypatch):
    from engine.pool import WorkerDied, WorkerPool

    monkeypatch.setenv("LGRPO_WORKER_THREADS", "not-a-number")  # the worker dies parsing it, before it connects
    t0 = time.perf_counter()
    with pytest.raises(WorkerDied, match=r"worker 0 died \(did not connect at start \(exit code 1\)\)"):
        WorkerPool(tmp_path, 1, "cpu")
    assert time.perf_counter() - t0 < 60, "a worker that died at start is reported when it dies, not at a timeout"
