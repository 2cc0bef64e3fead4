"""The driver's gym stage on a real (small) run: token budget, live episodes, user gyms, TRL-style rewards."""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_run


def _episodes(run_dir: str, step: int = 0) -> list[tuple[dict, dict]]:
    """Generate and step every turn of a fresh step; returns (generate summary, gym summary) per turn."""
    from artifacts import read_json
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from stages.gym import run_gym

    cfg = run_config(run_dir)
    prep = read_json(f"{run_dir}/prepared.json")
    export = export_base(run_dir, prep["base"])["path"]
    state = sample_tasks(run_dir, step, prep["base"])["path"]
    out = []
    for turn in range(cfg.gym.max_turns):
        tr = generate_turn(run_dir, step, turn, state, prep["adapter_init"], export, prep["base"])
        gr = run_gym(run_dir, step, turn, state, tr["path"], prep["base"])
        out.append((tr, gr))
        state = gr["path"]
        if gr["all_done"]:
            break
    return out


def test_token_budget_ends_episodes_and_is_never_exceeded(tmp_path, monkeypatch):
    """A sampler that always calls a tool (as a trained agent reading sources does) runs into a 40-token budget."""
    from artifacts import read_json, read_table
    from engine import runtime
    from engine.runtime import tokenizer
    from gyms.tools import format_tool_call

    budget = 40
    run_dir = make_run(tmp_path / "run", **{"gym.token_budget": budget, "gym.max_turns": 5,
                                             "sampler.max_answer_tokens": 24, "grpo.groups_per_step": 4})
    tok = tokenizer(read_json(f"{run_dir}/prepared.json")["base"])
    call = tok(format_tool_call("lookup", {"key": "alpha"}))["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]

    def always_a_tool_call(self, prefixes, boundaries, z, max_new, temperature, seed, limits, trainer, times=None):
        caps = [min(max_new, lim) for lim in (limits or [max_new] * len(prefixes))]
        return [call[:c] for c in caps], [[-0.5] * len(call[:c]) for c in caps]

    monkeypatch.setattr(runtime.Engine, "answers", always_a_tool_call)  # the hf sampler role
    turns = _episodes(run_dir)
    final = read_table(turns[-1][1]["path"]).to_pylist()
    assert all(r["done"] for r in final)
    for r in final:
        used = r["model_tokens"] + r["tool_tokens"]
        assert used <= budget, r
        # the stored prefix holds exactly the question plus what the budget counted
        question_len = len(read_table(f"{run_dir}/step-0000/tasks.arrow").column("prefix_ids")[r["row"]])
        assert len(r["prefix_ids"]) == question_len + used
    reasons = {r["reason"] for r in final}
    assert "budget" in reasons, f"a 40-token budget must end some table episodes: {reasons}"
    for tr, _ in turns:  # answers never ran past what the budget left them
        for a in read_table(tr["path"]).to_pylist():
            assert len(a["answer_ids"]) <= budget
    assert sum(g["budget_ended"] for _, g in turns) == sum(r["reason"] == "budget" for r in final)


def test_run_gym_is_repeatable_after_a_retry_and_after_a_restart(tmp_path):
    """A retried turn (live environments already advanced) and a restarted process (none alive) give the
    same row state bit for bit: environments are rebuilt from the task and the answer history."""
    from artifacts import read_json, read_table
    from stages import context
    from stages.gym import run_gym

    run_dir = make_run(tmp_path / "run", **{"gym.max_turns": 3})
    turns = _episodes(run_dir)
    prep = read_json(f"{run_dir}/prepared.json")
    last = len(turns) - 1
    state_in = f"{run_dir}/step-0000/gym-{last - 1:02d}.arrow" if last else f"{run_dir}/step-0000/tasks.arrow"
    first = read_table(turns[-1][1]["path"]).to_pydict()
    pool = context.episode_pool(context.run_config(run_dir), run_dir)
    rebuilds = pool.rebuilds
    again = run_gym(run_dir, 0, last, state_in, turns[-1][0]["path"], prep["base"], out_path=str(tmp_path / "a.arrow"))
    assert read_table(again["path"]).to_pydict() == first
    assert pool.rebuilds > rebuilds, "a retried turn must rebuild the episodes it had already advanced"
    context._POOLS.clear()  # a new process: no live environment
    restarted = run_gym(run_dir, 0, last, state_in, turns[-1][0]["path"], prep["base"],
                        out_path=str(tmp_path / "b.arrow"))
    assert read_table(restarted["path"]).to_pydict() == first


def test_a_user_gym_with_a_reward_function_runs_through_the_stages(tmp_path):
    """The worked example of docs/gyms.md: a gym by import path and a TRL-style reward function."""
    from artifacts import read_table
    from examples.rewards import fewer_turns
    from stages.gym import transcript

    run_dir = make_run(tmp_path / "run", **{"gym.name": "examples.guess_gym:GuessGym", "gym.options": {"high": 8},
                                             "gym.max_turns": 4, "gym.reward_funcs": ["examples.rewards:fewer_turns"]})
    turns = _episodes(run_dir)
    final = read_table(turns[-1][1]["path"]).to_pylist()
    assert all(r["done"] for r in final)
    from examples.guess_gym import GuessGym

    for r in final:  # the stored reward = the gym's own reward + the reward function's value
        task = json.loads(r["task"])
        env = GuessGym(max_turns=4, high=8)
        from gyms.protocol import Task

        env.reset(Task.from_dict(task))
        gym_reward = sum(env.step(a).reward for a in json.loads(r["history"]))
        extra = fewer_turns([[{"role": "user", "content": task["question"]}]], [transcript(task["question"], r)],
                            reason=[r["reason"]])[0]
        assert r["reward"] == pytest.approx(gym_reward + (extra or 0.0))


def test_reward_functions_get_trl_inputs_and_bad_outputs_are_named():
    from stages.gym import apply_reward_funcs

    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [0.5, None]

    rows = [{"task": json.dumps({"id": f"t{i}", "question": f"q{i}", "target": i, "data": {}}), "reward": 1.0,
             "turn_reward": 1.0, "reason": "answer", "history": json.dumps(["<tool_call>x</tool_call>", "7"]),
             "observations": json.dumps(["obs"])} for i in range(2)]
    apply_reward_funcs([("spy", spy)], rows)
    assert [r["reward"] for r in rows] == [1.5, 1.0]
    assert seen["prompts"][0] == [{"role": "user", "content": "q0"}]
    assert seen["completions"][0] == [{"role": "assistant", "content": "<tool_call>x</tool_call>"},
                                      {"role": "tool", "content": "obs"}, {"role": "assistant", "content": "7"}]
    assert seen["target"] == [0, 1] and seen["task_id"] == ["t0", "t1"] and seen["reason"] == ["answer"] * 2
    with pytest.raises(ValueError, match="expected a list of 2"):
        apply_reward_funcs([("short", lambda prompts, completions, **kw: [1.0])], rows)
    with pytest.raises(ValueError, match="finite numbers or None"):
        apply_reward_funcs([("nan", lambda prompts, completions, **kw: [float("nan"), 0.0])], rows)


def test_bad_reward_function_path_fails_at_load():
    from configs.schema import ConfigError, load_config
    from stages.context import reward_functions

    with pytest.raises(ConfigError, match="import paths"):
        load_config("tiny", {"gym.reward_funcs": ["no_colon"]})
    cfg = load_config("tiny", {"gym.reward_funcs": ["examples.rewards:missing"]})
    with pytest.raises(ValueError, match="cannot import 'examples.rewards:missing'"):
        reward_functions(cfg)
    with pytest.raises(ConfigError, match="token_budget"):
        load_config("tiny", {"gym.token_budget": 8192})


def _oracle_turns(run_dir: str, tmp_path, *, restart_every: int = 0, fail_turn: int | None = None):
    """Drive run-gym with the research oracle's answers (turn files written by hand: no model needed)."""
    import numpy as np

    from artifacts import read_json, read_table, write_table
    from engine.runtime import tokenizer
    from gyms.protocol import Task
    from gyms.research import ResearchGym
    from stages import context
    from stages.generate import sample_tasks
    from stages.gym import run_gym

    cfg = context.run_config(run_dir)
    base = read_json(f"{run_dir}/prepared.json")["base"]
    tok = tokenizer(base)
    oracle = ResearchGym(**{k: v for k, v in cfg.gym.options.items()})
    state = sample_tasks(run_dir, 0, base)["path"]
    summaries = []
    for turn in range(cfg.gym.max_turns):
        rows = [r for r in read_table(state).to_pylist() if not r["done"]]
        texts = [oracle.oracle_answers(Task.from_dict(json.loads(r["task"])))[turn] for r in rows]
        turn_in = str(tmp_path / f"turn-{turn}.arrow")
        write_table(turn_in, {"row": np.asarray([r["row"] for r in rows], dtype=np.int32), "answer_text": texts,
                              "answer_ids": [np.asarray(tok(t)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")],
                                                        dtype=np.int32) for t in texts]})
        if restart_every and turn % restart_every == restart_every - 1:
            context._POOLS.clear()  # as if the driver process had restarted between turns
        summaries.append(run_gym(run_dir, 0, turn, state, turn_in, base))
        state = summaries[-1]["path"]
        if summaries[-1]["all_done"]:
            break
    return read_table(state).to_pylist(), summaries


def test_research_gym_over_the_tool_server_with_faults_loses_no_episode(tmp_path):
    """The driver's real path: research episodes through the tool server the run starts, 20 % of requests
    faulted; every episode completes with the oracle's full reward and a sealed trace that verifies."""
    from stages.rollouts import episode_stats, verify_traces

    run_dir = make_run(tmp_path / "run", **{
        "gym.name": "research", "gym.max_turns": 6, "gym.options": {"n_entities": 8, "progress_reward": 0.25},
        "gym.transport": "http", "grpo.groups_per_step": 8, "grpo.num_generations": 4,
        "gym.tool_server.timeout_s": 0.5, "gym.tool_server.backoff_base_s": 0.05, "gym.tool_server.backoff_max_s": 0.5,
        "gym.tool_server.max_attempts": 10, "gym.tool_server.faults.rate": 0.2})
    final, summaries = _oracle_turns(run_dir, tmp_path, restart_every=3)
    assert len(final) == 32 and all(r["done"] and r["reason"] == "answer" for r in final)
    assert [r["reward"] for r in final] == [1.5] * 32
    assert verify_traces(final) == 32
    for r in final:
        entries = [json.loads(line) for line in open(r["trace"])]
        assert [e["call_id"] for e in entries[:-1]] == ["0", "1", "2", "3", "4"], "one entry per call, no duplicates"
    stats = episode_stats(final)
    assert stats["completion_rate"] == 1.0 and 0 < stats["tool_token_share"] < 1
    retries = sum(s["transport_retries"] for s in summaries)
    faults = [json.loads(line) for line in open(f"{run_dir}/tool-server/faults.jsonl")]
    journal = [json.loads(line) for line in open(f"{run_dir}/tool-server/client-faults.jsonl")]
    assert retries > 0 and len(faults) > 0
    assert {f["request_id"] for f in faults if f["kind"] != "latency"} <= {j["request_id"] for j in journal}


def test_a_tool_server_outage_fails_the_turn_and_a_retry_completes_it(tmp_path):
    """Terminal transport error after the retry budget: run-gym fails (Prefect retries the turn); nothing half-done
    is kept, and the retried turn completes every episode with the same results."""
    from gyms.service import ToolTransportError
    from stages import context

    run_dir = make_run(tmp_path / "run", **{
        "gym.name": "research", "gym.max_turns": 6, "gym.options": {"n_entities": 8},
        "gym.transport": "http", "gym.tool_server.timeout_s": 0.5, "gym.tool_server.backoff_base_s": 0.01,
        "gym.tool_server.backoff_max_s": 0.05, "gym.tool_server.max_attempts": 3})
    cfg = context.run_config(run_dir)
    context.tool_client(cfg, run_dir)  # starts the run's server
    key = next(k for k in context._SERVERS if k[0] == str((tmp_path / "run").resolve()))
    context._SERVERS[key].stop()
    with pytest.raises(ToolTransportError, match="3 attempts"):
        _oracle_turns(run_dir, tmp_path)
    for d in (context._CLIENTS, context._SERVERS, context._POOLS):  # the retry runs in a fresh worker process
        for k in [k for k in d if k[0] == key[0]]:
            d.pop(k)
    final, _ = _oracle_turns(run_dir, tmp_path)
    assert all(r["reason"] == "answer" and r["reward"] == 1.0 for r in final)


def test_a_tool_server_that_dies_while_starting_is_started_again_with_a_warning(tmp_path, monkeypatch, caplog):
    """The soak drill killed a run's tool server before it listened: the start is tried again (up to
    START_ATTEMPTS), with a warning naming what happened, instead of failing the gym stage."""
    import logging

    import gyms.launcher
    from stages import context

    run_dir = make_run(tmp_path / "run", **{"gym.transport": "http"})
    cfg = context.run_config(run_dir)
    real, calls = gyms.launcher.start_tool_server, []

    def dies_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("tool server (gyms.table:TableGym) exited with code -9 before listening; log x:\n...")
        return real(*args, **kwargs)

    monkeypatch.setattr(gyms.launcher, "start_tool_server", dies_first)
    with caplog.at_level(logging.WARNING, logger="lgrpo.gym"):
        client = context.tool_client(cfg, run_dir)
    key = next(k for k in context._SERVERS if k[0] == str((tmp_path / "run").resolve()))
    try:
        assert len(calls) == 2 and context._SERVERS[key].alive() and client is not None
        assert any("did not start (tool server (gyms.table:TableGym) exited with code -9 before listening" in r.message
                   and "attempt 2 of 3" in r.message for r in caplog.records)
    finally:
        context._SERVERS[key].stop()
        for d in (context._CLIENTS, context._SERVERS):
            for k in [k for k in d if k[0] == key[0]]:
                d.pop(k)

    calls.clear()
    monkeypatch.setattr(gyms.launcher, "start_tool_server",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("exited with code 1 before listening")))
    with pytest.raises(RuntimeError, match="before listening"):
        context._start_own_tool_server(cfg, run_dir)
