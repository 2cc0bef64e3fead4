"""Steps through Prefect (prefect_test_harness): task states, caching on re-run, and a gate failure."""

from __future__ import annotations

import pytest

from tests.conftest import make_run

pytestmark = pytest.mark.slow


def _states(state):
    from flows.rerun import task_states

    return task_states(state.state_details.flow_run_id)


def test_two_steps_task_states_and_cached_rerun(prefect_harness, tmp_path):
    from flows.step import grpo_step

    run_dir = make_run(tmp_path / "run", **{"steps.pattern": ["fresh", "reuse"]})
    s0 = grpo_step(run_dir, 0, return_state=True)
    assert s0.is_completed(), s0
    st0 = _states(s0)
    assert st0["export"] == "Completed"
    for name in ("sample-tasks-0", "generate-turn-0-0", "run-gym-0-0", "collect-rollouts-0", "replay-0", "optimize-0"):
        assert st0[name] == "Completed", (name, st0)

    s1 = grpo_step(run_dir, 1, return_state=True)  # reuse step: replays step 0's rollouts
    st1 = _states(s1)
    assert st1 == {"export": "Cached", "replay-1": "Completed", "optimize-1": "Completed"}, st1
    m1 = s1.result()
    assert m1["kind"] == "reuse" and set(m1["phases"]) == {"replay", "optimize"} and m1["cached"] == ["export"]

    again = _states(grpo_step(run_dir, 1, return_state=True))  # nothing changed: everything comes back Cached
    assert set(again.values()) == {"Cached"}, again

    forced = _states(grpo_step(run_dir, 1, force_from="optimize", return_state=True))
    assert forced["replay-1"] == "Cached" and forced["optimize-1"] == "Completed", forced

    # task results are persisted as JSON (paths and small summaries), never as pickles
    import json

    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    stored = [json.loads(p.read_text()) for p in PREFECT_LOCAL_STORAGE_PATH.value().iterdir() if p.is_file()]
    assert stored and {r["metadata"]["serializer"]["type"] for r in stored} == {"json"}, stored[:1]
    assert any(json.loads(r["result"]).get("path", "").endswith("rollouts.arrow") for r in stored)


def test_gate_failure_fails_the_task_without_retry(prefect_harness, tmp_path, monkeypatch):
    """A sampler that over-reports its log-probs by 3 nat (an injected defect) fails the rollout-parity gate."""
    from prefect.states import State

    from engine import runtime
    from flows.step import grpo_step

    real = runtime.Engine.answers

    def off_by_three(*args, **kwargs):
        ids, lps = real(*args, **kwargs)
        return ids, [[x + 3.0 for x in row] for row in lps]

    monkeypatch.setattr(runtime.Engine, "answers", off_by_three)  # the hf sampler role
    run_dir = make_run(tmp_path / "run")
    state: State = grpo_step(run_dir, 0, return_state=True)
    assert state.is_failed()
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    replay = [r for r in runs if r.name == "replay-0"]
    assert len(replay) == 1 and replay[0].state.name == "Failed"
    assert replay[0].run_count == 1, "GateFailed must not be retried"
    assert "rollout-parity" in replay[0].state.message
    assert not [r for r in runs if r.name.startswith("optimize")], "nothing after a failed gate may run"
    from artifacts import RunDir, read_json

    report = read_json(RunDir(tmp_path / "run").parity(0))
    assert report["passed"] is False and report["mean_gap"] == pytest.approx(3.0, abs=1e-3)
    # the gate report is attached as an artifact, and the diagnostic names the guilty path: every isolated path
    # agrees with the trainer; only the values the sampler recorded during the rollout are off
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    assert {"step-0000-gate-rollout-parity", "step-0000-diagnostic"} <= keys, keys
    diag = read_json(RunDir(tmp_path / "run").step_dir(0) / "diagnostic-rollout-parity.json")
    assert diag["disagreeing_paths"] == ["sampler/rollout"], diag["disagreeing_paths"]
    assert diag["verdict"].startswith("sampler rollout path only")


def test_phase_times_split_prefill_from_latent_and_answers_where_the_stage_measured_it():
    from flows.step import phase_times

    graphed = {"stage": "generate-turn", "wall_s": 10.0, "latent_s": 4.0, "answers_s": 5.0,
               "latent_prefill_s": 1.5, "answers_prefill_s": 2.0}
    eager = {"stage": "generate-turn", "wall_s": 3.0, "latent_s": 1.0, "answers_s": 1.5}
    ph = phase_times([graphed, {"stage": "replay", "wall_s": 7.0}, {"stage": "optimize", "wall_s": 9.0, "cached": True}])
    assert ph == {"prefill": 3.5, "latent": 2.5, "answers": 3.0, "generate-other": 1.0, "replay": 7.0}
    assert sum(v for k, v in ph.items() if k != "replay") == graphed["wall_s"]  # the split adds up to the stage
    assert phase_times([eager]) == {"latent": 1.0, "answers": 1.5, "generate-other": 0.5}  # no prefill measured: none


def _task_runs(flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _artifact_keys() -> set[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_artifacts()}


def test_every_gate_fails_its_task_visibly(prefect_harness, tmp_path, monkeypatch):
    """Issue 15: each gate that a stage checks, failed by a real defect injected under it, fails its Prefect task
    at once (no retry, though the task has retries), attaches the gate's report as an artifact, and stops the step.
    (rollout-parity and teacher-forced-probe: their own tests in this file.)"""
    import torch

    from engine import runtime
    from flows import tasks as T
    from flows.step import grpo_step
    from stages import optimize as O

    # the two-pass replay tier: optimize re-forwards each micro-batch, so replay-determinism is checked there
    run_dir = make_run(tmp_path / "run", **{"replay.keep_graph_tokens": 0, "replay.checkpoint_tokens": 0,
                                            "gates.probe_every": 1000, "steps.total": 2,
                                            "gym.reward_funcs": ["tests.test_log_ratio:answer_length"]})
    s0 = grpo_step(run_dir, 0, return_state=True)
    assert s0.is_completed() and s0.result()["grad_norm"] > 0, "the injections below need a step with a gradient signal"

    real_acc, real_weights = O.accumulate_gradients, O.driver_weights

    def zero_gradients(cfg, engine, *a, **k):  # a backward that loses the gradient
        real_acc(cfg, engine, *a, **k)
        for p in engine.model.parameters():
            if p.grad is not None:
                p.grad.zero_()

    def changed_weights(cfg, engine, *a, **k):  # the weights move between replay and the second pass
        with torch.no_grad():  # lora_B: the initial adapter's lora_A alone changes nothing (B = 0)
            next(p for n, p in engine.model.named_parameters() if "lora_B" in n).add_(1e-3)
        real_acc(cfg, engine, *a, **k)

    def infinite_weight(cfg, li, metrics):  # a loss weight that overflowed
        wq, wa = real_weights(cfg, li, metrics)
        wa[0][0] = float("inf")
        return wq, wa

    for gate, name, patch in (("nonzero-gradients", "accumulate_gradients", zero_gradients),
                              ("replay-determinism", "accumulate_gradients", changed_weights),
                              ("finite-gradients", "driver_weights", infinite_weight)):
        with monkeypatch.context() as m:
            m.setattr(O, name, patch)
            runtime.clear()  # the trainer is rebuilt from the stored adapter: the injected change is the only one
            state = grpo_step(run_dir, 0, force_from="optimize", return_state=True)
        assert state.is_failed(), (gate, state)
        opt = [r for r in _task_runs(state.state_details.flow_run_id) if r.name == "optimize-0"]
        assert len(opt) == 1 and opt[0].state.name == "Failed" and opt[0].run_count == 1, (gate, opt)
        assert gate in opt[0].state.message, (gate, opt[0].state.message)
        assert f"step-0000-gate-{gate}" in _artifact_keys(), gate
    runtime.clear()

    # verified-checkpoint: the engine reloaded from disk does not hold the trained weights
    real_build = runtime.build

    def stale_checkpoint(*a, **k):
        eng = real_build(*a, **k)
        if k.get("via_peft"):
            with torch.no_grad():
                next(p for n, p in eng.model.named_parameters() if "lora_B" in n).add_(1e-2)
        return eng

    from artifacts import RunDir, read_json

    base = read_json(RunDir(run_dir).prepared())["base"]
    with monkeypatch.context() as m:
        m.setattr(runtime, "build", stale_checkpoint)
        state = T.verify_checkpoint(run_dir, str(RunDir(run_dir).adapter(0)), base, return_state=True)
    assert state.is_failed() and "verified-checkpoint" in state.message, state
    assert "final-gate-verified-checkpoint" in _artifact_keys()



def test_provenance_gate_fails_collect_rollouts_visibly(prefect_harness, tmp_path):
    """A stored sealed trace changed after its episode (one flipped bit) fails collect-rollouts through Prefect at
    once, with the gate's artifact. The research gym keeps traces (its tools run server-side); the table gym none."""
    from artifacts import RunDir
    from flows.step import grpo_step

    run_dir = make_run(tmp_path / "run", **{"gym.name": "research", "gym.max_turns": 2,
                                            "gym.options": {"n_entities": 8}, "gates.probe_every": 1000})
    assert grpo_step(run_dir, 0, return_state=True).is_completed()
    traces = sorted(RunDir(run_dir).step_dir(0).rglob("*.trace.jsonl"))
    assert traces, "the research gym stores a sealed trace per episode"
    raw = bytearray(traces[0].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    traces[0].write_bytes(bytes(raw))
    state = grpo_step(run_dir, 0, force_from="collect-rollouts", return_state=True)
    assert state.is_failed()
    col = [r for r in _task_runs(state.state_details.flow_run_id) if r.name == "collect-rollouts-0"]
    assert col[0].state.name == "Failed" and col[0].run_count == 1 and "provenance" in col[0].state.message, col
    assert "step-0000-gate-provenance" in _artifact_keys()


def test_train_parameters_are_a_typed_form_validated_before_the_run(prefect_harness, tmp_path):
    """Issue 15: the train flow's parameters are a pydantic model, so Prefect's UI builds a form from its schema, and
    a combination the config schema rejects fails the flow run before any task runs."""
    from prefect.utilities.callables import parameter_schema

    from flows.train import train

    schema = parameter_schema(train).model_dump()
    props = schema["definitions"]["TrainParameters"]["properties"]
    assert {"config", "steps", "run_dir", "learning_rate", "groups_per_step", "overrides"} <= set(props)
    assert props["steps"]["anyOf"][0]["minimum"] == 1 and "GRPO steps" in props["steps"]["description"]
    state = train(params={"run_dir": str(tmp_path / "run"), "overrides": {"model.arch.linear_key_head_dim": 32}},
                  return_state=True)
    assert state.is_failed() and "64 or 128" in state.message, state
    assert not (tmp_path / "run").exists()  # nothing started
    assert _task_runs(state.state_details.flow_run_id) == []


def test_run_gym_retries_through_prefect_when_the_tool_server_is_down(prefect_harness, tmp_path):
    """Issue 15: the run's tool server is down when run-gym starts (its process was stopped; the client gives up at
    once). The attempt fails, the stage restarts the run's dead server, and Prefect's retry completes the task
    against it: the task's state history shows the retry, and the step's rollouts are bit-identical to the
    undisturbed run's."""
    from prefect import get_client

    from artifacts import RunDir, verify
    from flows.step import grpo_step
    from stages import context

    run_dir = make_run(tmp_path / "run", **{"gym.name": "research", "gym.max_turns": 2,
                                            "gym.options": {"n_entities": 8}, "gym.transport": "http",
                                            "gym.tool_server.max_attempts": 1, "gates.probe_every": 1000})
    assert grpo_step(run_dir, 0, return_state=True).is_completed()
    undisturbed = verify(RunDir(run_dir).rollouts(0))
    servers = [s for k, s in context._SERVERS.items() if k[0] == str((tmp_path / "run").resolve())]
    assert len(servers) == 1
    servers[0].stop()  # the server goes down; the run's client still points at it

    state = grpo_step(run_dir, 0, force_from="run-gym", return_state=True)
    assert state.is_completed(), state
    runs = {r.name: r for r in _task_runs(state.state_details.flow_run_id)}
    first = runs["run-gym-0-0"]
    assert first.run_count == 2 and first.state.name == "Completed", (first.run_count, first.state)
    with get_client(sync_client=True) as client:
        history = [s.name for s in client.read_task_run_states(first.id)]
    assert "AwaitingRetry" in history and history[-1] == "Completed", history
    new = [s for k, s in context._SERVERS.items() if k[0] == str((tmp_path / "run").resolve())]
    assert new[0] is not servers[0] and new[0].alive()
    assert verify(RunDir(run_dir).rollouts(0)) == undisturbed


def test_teacher_forced_probe_gate_fails_its_task_with_report_and_diagnostic(prefect_harness, tmp_path):
    """The probe gate through Prefect: the sampler combines DoRA in two roundings (the seed's vLLM bug, injected in
    the sampler only); the probe task fails at once (no retry), with the gate's report and the diagnostic's verdict
    as artifacts."""
    import types

    from artifacts import read_json
    from engine import runtime
    from engine.diagnose import adapter_modules
    from flows import tasks as T
    from stages.context import run_config
    from stages.export import export_base
    from tests.test_gates import _round_twice, trained_like_adapter

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"adapter.type": "dora", "model.dtype": "bfloat16"})
    adapter = trained_like_adapter(run_dir, tmp_path / "adapter")
    base = read_json(f"{run_dir}/prepared.json")["base"]
    export = export_base(run_dir, base)["path"]
    sampler = runtime.sampler(run_config(run_dir), export, base)
    for module in adapter_modules(sampler.model).values():
        module.forward = types.MethodType(_round_twice, module)
    state = T.probe(run_dir, 3, adapter, export, base, return_state=True)
    runtime.clear()
    assert state.is_failed() and "teacher-forced-probe" in state.message, state
    from prefect import get_client

    with get_client(sync_client=True) as client:
        tr = client.read_task_run(state.state_details.task_run_id)
    assert tr.run_count == 1, "a failed gate is not retried"
    assert {"step-0003-gate-teacher-forced-probe", "step-0003-diagnostic"} <= _artifact_keys()


def test_a_cached_stage_whose_artifact_was_deleted_runs_again(prefect_harness, tmp_path):
    """Prefect's cache key covers the inputs, not the outputs: a stage whose stored output was deleted would come
    back Cached and the next stage would fail on a missing file. It runs again instead, bit-identically."""
    from artifacts import RunDir, verify
    from flows.step import grpo_step

    run_dir = make_run(tmp_path / "run", **{"gates.probe_every": 1000})
    assert grpo_step(run_dir, 0, return_state=True).is_completed()
    tasks = RunDir(run_dir).tasks(0)
    before = verify(tasks)
    tasks.unlink()
    tasks.with_name(tasks.name + ".sha256").unlink()
    state = grpo_step(run_dir, 0, return_state=True)
    assert state.is_completed(), state
    st = _states(state)
    assert st["sample-tasks-0"] == "Completed" and st["optimize-0"] == "Cached", st
    assert verify(tasks) == before


def test_a_cached_stage_whose_artifact_was_corrupted_is_named_and_runs_again(prefect_harness, tmp_path):
    """One flipped byte in a finished step's stored artifact: the rerun names the file, runs that stage again and
    writes the same bytes (the later stages stay Cached)."""
    import logging

    from artifacts import RunDir, verify
    from flows.step import grpo_step

    run_dir = make_run(tmp_path / "run", **{"gates.probe_every": 1000})
    assert grpo_step(run_dir, 0, return_state=True).is_completed()
    replay = RunDir(run_dir).replay(0)
    before = verify(replay)
    data = bytearray(replay.read_bytes())
    data[len(data) // 2] ^= 0x01
    replay.write_bytes(bytes(data))
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger("lgrpo.rerun").addHandler(handler)
    try:
        state = grpo_step(run_dir, 0, return_state=True)
    finally:
        logging.getLogger("lgrpo.rerun").removeHandler(handler)
    assert state.is_completed(), state
    cached = state.result()["cached"]  # the flow's own record (the API's task states can lag behind in a long suite)
    assert "replay" not in cached and "optimize" in cached, cached
    assert any(str(replay) in m and "corrupted" in m for m in seen), seen
    assert verify(replay) == before


def test_step_flows_share_one_async_client_and_stay_subflows_of_the_run(prefect_harness, monkeypatch):
    """Prefect creates each subflow's tracking task run with get_client(); outside an AsyncClientContext that is a new
    client (a TLS context from certifi's CA bundle, ~20 ms, and a new connection) per step. Inside step_flows()
    every step flow uses one client, and each is still recorded as a subflow of the run's flow (the UI's nesting)."""
    from prefect import flow
    from prefect.client.orchestration import PrefectClient, get_client

    from flows.step import shared_async_client

    made = []
    init = PrefectClient.__init__

    def counting_init(self, *a, **k):
        made.append(self)
        init(self, *a, **k)

    monkeypatch.setattr(PrefectClient, "__init__", counting_init)

    @flow(name="lgrpo-test-step")
    def step(i: int) -> int:
        return i

    @flow(name="lgrpo-test-run")
    def run(shared: bool):
        from contextlib import nullcontext

        from prefect.runtime import flow_run

        with shared_async_client() if shared else nullcontext():
            before = len(made)
            states = [step(i, return_state=True) for i in range(3)]
            return flow_run.id, len(made) - before, [s.state_details.flow_run_id for s in states]

    parent, new_clients, children = run(True)
    assert new_clients == 0, new_clients
    _, new_default, _ = run(False)
    assert new_default >= 3, new_default  # Prefect's default: one client per subflow

    from prefect.utilities.asyncutils import run_coro_as_sync

    async def parents():
        async with get_client() as client:
            out = []
            for child in children:
                fr = await client.read_flow_run(child)
                tr = await client.read_task_run(fr.parent_task_run_id)
                out.append(str(tr.flow_run_id))
            return out

    assert run_coro_as_sync(parents()) == [str(parent)] * 3


def test_the_run_step_flows_post_their_artifacts_linked_to_each_step_flow_run(prefect_harness, tmp_path):
    """Inside step_flows() (one shared async client, no heartbeat threads) each step's timing and metrics artifacts
    belong to its own step flow run."""
    from prefect import flow, get_client

    from flows.step import step_flows

    run_dir = make_run(tmp_path / "run", **{"steps.pattern": ["fresh", "reuse"]})

    @flow(name="lgrpo-test-steps")
    def steps():
        with step_flows() as step_flow:
            return [str(step_flow(run_dir, s, return_state=True).state_details.flow_run_id) for s in range(2)]

    runs = steps()
    with get_client(sync_client=True) as client:
        arts = [a for a in client.read_artifacts() if a.key and a.key.startswith(("step-0000-", "step-0001-"))
                and str(a.flow_run_id) in runs]
    by_key = {a.key: str(a.flow_run_id) for a in arts}
    assert by_key == {"step-0000-timings": runs[0], "step-0000-metrics": runs[0],
                      "step-0001-timings": runs[1], "step-0001-metrics": runs[1]}, by_key

