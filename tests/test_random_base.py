"""The full-size step's pieces on the CPU: a `model.source: random` base (a recipe built where it runs), the synthetic
gym (the recipe's load shape), and replay tiers inside a real step -- fresh and reuse, then optimize re-run from the
stored artifacts (no live graph) giving the same adapter bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import fresh_step, make_run

pytestmark = pytest.mark.slow

RANDOM = {
    "model.source": "random",
    "gym.name": "synthetic",
    "gym.options": {"prompt_words": 30, "tool_words": 6},
    "gym.max_turns": 2,
    "gym.eval_tasks": 2,
    "latent.max_latent_steps": 3,
    "sampler.max_answer_tokens": 6,
    "steps.pattern": ["fresh", "reuse"],
    # a mix of tiers inside one step: the first turns keep their graph, then checkpointing, then two-pass
    "replay.microbatch_tokens": 64,
    "replay.keep_graph_tokens": 100,
    "replay.checkpoint_tokens": 200,
}


def test_synthetic_gym_shape_and_rewards():
    from gyms.synthetic import SyntheticGym

    env = SyntheticGym(max_turns=3, prompt_words=50, tool_words=7)
    task = env.sample_tasks(1, seed=0)[0]
    assert len(env.reset(task).split()) == 50
    r1 = env.step("not a tool call")
    assert not r1.done and r1.info["tool_error"] and len(r1.observation.split()) >= 7
    r2 = env.step(env.oracle_answers(task)[1])
    assert not r2.done and not r2.info["tool_error"] and len(r2.observation.split()) == 7
    r3 = env.step("x")
    assert r3.done and r3.info["reason"] == "max_turns" and 0.0 <= r3.reward <= 1.0
    rewards = set()
    for i in range(16):  # the end reward depends on the answers: a group's rows get different rewards
        env.reset(task)
        for t in range(3):
            r = env.step(f"answer {i} {t}")
        rewards.add(r.reward)
    assert len(rewards) == 16 and all(0.0 <= x <= 1.0 for x in rewards)


def test_random_base_is_a_recipe_built_where_it_runs(tmp_path):
    from artifacts import read_json
    from engine import model as M

    run_dir = make_run(tmp_path, **RANDOM)
    base = read_json(f"{run_dir}/prepared.json")["base"]
    manifest = M.random_base_manifest(base)
    assert manifest["seed"] == 0 and not list(__import__("pathlib").Path(base).glob("*.safetensors"))
    a = M.load_base(base, "float32")
    b = M.load_base(base, "float32")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_step_with_replay_tiers_then_optimize_rerun_from_artifacts_is_bitwise(tmp_path, monkeypatch):
    from artifacts import read_table, read_tensors
    from engine import runtime
    from stages.optimize import optimize
    from stages.replay import replay

    run_dir = make_run(tmp_path, **RANDOM)
    s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    tiers = s0["replay"]["plan"]["tier_microbatches"]
    assert tiers["keep"] and tiers["checkpoint"] and tiers["two_pass"], s0["replay"]["plan"]
    assert s0["optimize"]["grad_norm"] > 0 and s0["optimize"]["live_graph"]
    meta = read_table(s0["replay"]["path"]).schema.metadata
    assert b"plan" in meta
    adapter0 = read_tensors(f"{run_dir}/step-0000/adapter/adapter_model.safetensors")[0]

    # optimize again from the stored artifacts in a fresh "process" (engines dropped: no live graph): every
    # micro-batch is re-forwarded, checked bit for bit against replay.arrow, back-propagated
    runtime.clear()
    ro, rp = s0["rollouts"], s0["replay"]["path"]
    op = optimize(run_dir, 0, ro, rp, rp, f"{run_dir}/adapter-init", None, s0["base"])
    assert not op["live_graph"]
    again = read_tensors(f"{run_dir}/step-0000/adapter/adapter_model.safetensors")[0]
    assert all(torch.equal(adapter0[k], again[k]) for k in adapter0)

    # a reuse step replays the same rollouts with the updated adapter, same tiers
    rr = replay(run_dir, 1, ro, f"{run_dir}/step-0000/adapter", s0["base"], False)
    assert rr["plan"] == s0["replay"]["plan"]
    import stages.optimize as SO

    reads = []
    real_read = SO.read_tensors
    monkeypatch.setattr(SO, "read_tensors", lambda p, *a, **k: (reads.append(str(p)), real_read(p, *a, **k))[1])
    opt_in = f"{run_dir}/step-0000/optimizer.safetensors"
    o1 = optimize(run_dir, 1, ro, rr["path"], rp, f"{run_dir}/step-0000/adapter", opt_in, s0["base"])
    assert o1["grad_norm"] > 0
    # the optimizer the rerun above kept (it wrote opt_in) was reused, not read back ...
    assert not any(r.endswith("optimizer.safetensors") for r in reads), reads
    kept = [read_tensors(f"{run_dir}/step-0001/{n}")[0] for n in ("adapter/adapter_model.safetensors",
                                                                  "optimizer.safetensors")]
    # ... and gives what reading the state from the file gives, bit for bit (a new process: engines dropped)
    runtime.clear()
    optimize(run_dir, 1, ro, rr["path"], rp, f"{run_dir}/step-0000/adapter", opt_in, s0["base"])
    assert any(r.endswith("optimizer.safetensors") for r in reads)
    read_back = [read_tensors(f"{run_dir}/step-0001/{n}")[0] for n in ("adapter/adapter_model.safetensors",
                                                                       "optimizer.safetensors")]
    for a, b in zip(kept, read_back):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_engine_hashes_an_adapter_it_already_holds_once(tmp_path, monkeypatch):
    """Engine.use_adapter asks which adapter a directory holds on every generate turn, replay and optimize: once its
    files have settled, the answer is remembered by their stat signature instead of hashing the weights again (a 27B
    adapter is ~450 MB); a rewrite of the directory is hashed and loaded again."""
    import time

    from artifacts import store
    from engine import model as M
    from engine import runtime
    from stages.context import run_config

    run_dir = make_run(tmp_path, **RANDOM)
    s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    adapter = f"{run_dir}/step-0000/adapter"
    runtime.clear()
    engine = runtime.trainer(run_config(run_dir), s0["base"], s0["base"])
    time.sleep(0.25)  # past artifacts.store's settle time
    hashed = []
    real_verify = store.verify
    monkeypatch.setattr(store, "verify", lambda p: (hashed.append(str(p)), real_verify(p))[1])
    engine.use_adapter(adapter)
    first = len(hashed)
    assert first >= 1 and engine.adapter_digest == store.dir_digest(adapter)
    hashed.clear()
    for _ in range(3):
        engine.use_adapter(adapter)
    assert hashed == [], hashed
    state = M.adapter_state(engine.model)
    store.write_adapter_dir(adapter, M.adapter_config_dict(engine.model),
                            {k: v + 1.0 if "lora_B" in k else v for k, v in state.items()})
    engine.use_adapter(adapter)  # rewritten: hashed and loaded again
    assert any(h.endswith("adapter_model.safetensors") for h in hashed)
    assert engine.adapter_digest == store.dir_digest(adapter)


# token-level importance correction: a turn's loss weights then depend on the other turns only through the token
# count, so replay knows them exactly (sequence-level correction on a fresh step needs the whole row: on the CPU the
# hf sampler's log-probs differ from the trainer's by rounding, the predicted ratios too, and optimize re-forwards)
ONE_PASS = {**{k: v for k, v in RANDOM.items() if k not in ("replay.keep_graph_tokens", "replay.checkpoint_tokens")},
            "grpo.vllm_importance_sampling_mode": "token_mask"}


def test_one_pass_replay_gives_the_tiered_step_bit_for_bit_fresh_and_reuse(tmp_path, monkeypatch):
    """replay.one_pass back-propagates each micro-batch inside replay with the weights the driver computes later:
    the adapters after a fresh and a reuse step equal, bit for bit, those of the same steps with kept graphs and of
    optimize re-run from the stored artifacts (every micro-batch re-forwarded); weights that differ from the
    driver's, or gradients touched between replay and optimize, make optimize re-forward instead of using them."""
    from artifacts import read_tensors
    from engine import runtime
    from stages.optimize import optimize
    from stages.replay import replay

    def adapter(run_dir, step):
        return read_tensors(f"{run_dir}/step-{step:04d}/adapter/adapter_model.safetensors")[0]

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    runs = {}
    for name, one_pass in (("kept", False), ("one_pass", True)):
        runtime.clear()
        run_dir = make_run(tmp_path / name, **ONE_PASS, **{"replay.one_pass": one_pass})
        s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
        ro, rp, base = s0["rollouts"], s0["replay"]["path"], s0["base"]
        r1 = replay(run_dir, 1, ro, f"{run_dir}/step-0000/adapter", base, False, old_replay_in=rp)
        o1 = optimize(run_dir, 1, ro, r1["path"], rp, f"{run_dir}/step-0000/adapter",
                      f"{run_dir}/step-0000/optimizer.safetensors", base)
        runs[name] = (run_dir, s0, r1, o1)
    kept, one = runs["kept"], runs["one_pass"]
    n_mb = one[1]["replay"]["plan"]["microbatches"]
    assert n_mb > 1 and one[1]["replay"]["plan"]["tier_microbatches"]["one_pass"] == n_mb, one[1]["replay"]["plan"]
    assert one[2]["plan"]["tier_microbatches"]["one_pass"] == n_mb
    assert kept[1]["replay"]["plan"]["tier_microbatches"]["keep"] == n_mb
    assert one[1]["optimize"]["one_pass"] is True and one[3]["one_pass"] is True
    assert "one_pass" not in kept[1]["optimize"]
    for step in (0, 1):
        assert same(adapter(kept[0], step), adapter(one[0], step)), step

    # optimize from the stored artifacts in a new "process": the one-pass plan's micro-batches are re-forwarded with
    # the graphs replay used, checked bit for bit, and give the same adapter
    run_dir, s0 = one[0], one[1]
    ro, rp, base = s0["rollouts"], s0["replay"]["path"], s0["base"]
    want = adapter(run_dir, 0)
    runtime.clear()
    op = optimize(run_dir, 0, ro, rp, rp, f"{run_dir}/adapter-init", None, base)
    assert not op["live_graph"] and "one_pass" not in op and same(adapter(run_dir, 0), want)

    # weights replay predicted wrong: optimize sees it and re-forwards
    import stages.optimize as SO

    real = SO.PredictedWeights.__call__
    monkeypatch.setattr(SO.PredictedWeights, "__call__",
                        lambda self, *a: tuple([w * 1.5 for w in ws] for ws in real(self, *a)))
    replay(run_dir, 0, ro, f"{run_dir}/adapter-init", base, True)
    op = optimize(run_dir, 0, ro, rp, rp, f"{run_dir}/adapter-init", None, base)
    assert op["live_graph"] and op["one_pass"] is False and same(adapter(run_dir, 0), want)
    monkeypatch.setattr(SO.PredictedWeights, "__call__", real)

    # gradients touched between replay and optimize: not trusted either
    replay(run_dir, 0, ro, f"{run_dir}/adapter-init", base, True)
    eng = runtime.trainer(runtime_cfg := SO.run_config(run_dir), base, base)
    next(p for p in eng.model.parameters() if p.requires_grad).grad.mul_(1.0)
    op = optimize(run_dir, 0, ro, rp, rp, f"{run_dir}/adapter-init", None, base)
    assert op["one_pass"] is False and same(adapter(run_dir, 0), want), runtime_cfg.replay


def test_one_pass_plan_keeps_what_fits_in_flight_and_refuses_what_cannot():
    from configs.schema import ReplayConfig
    from engine.replay import ReplayMemoryError, TokenCosts, plan_replay

    GiB, MiB = 2**30, 2**20
    costs = TokenCosts(keep=4 * MiB, checkpoint=1 * MiB, transient=0.5 * MiB, source="config", fixed=0.25 * GiB)
    lengths = [3000, 2500, 1000, 900, 800]
    plan = plan_replay(lengths, ReplayConfig(), costs, base_bytes=10 * GiB, budget_bytes=24 * GiB, one_pass=True)
    assert plan.one_pass and sorted(i for mb in plan.microbatches for i in mb) == list(range(5))
    room = 14 * GiB - 0.25 * GiB
    for n, g in zip(plan.tokens, plan.graphs):  # keep whatever fits in flight, else checkpointed
        assert g == ("keep" if (costs.keep + costs.transient) * n <= room else "checkpoint"), (n, g)
    assert set(plan.graphs) == {"keep", "checkpoint"}
    need = max(((costs.keep if g == "keep" else costs.checkpoint) + costs.transient) * n
               for n, g in zip(plan.tokens, plan.graphs))
    assert plan.est_peak_bytes == 10 * GiB + costs.fixed + need <= 24 * GiB
    assert plan.summary()["tier_microbatches"]["one_pass"] == len(plan.microbatches)
    # without a budget (the CPU default) every micro-batch keeps its whole graph in flight
    free = plan_replay(lengths, ReplayConfig(microbatch_tokens=3000), one_pass=True)
    assert free.graphs == ["keep"] * len(free.microbatches) and free.tiers == ["one_pass"] * len(free.microbatches)
    with pytest.raises(ReplayMemoryError, match="gym.token_budget|replay.memory_budget_gb"):
        plan_replay([20000], ReplayConfig(), costs, 10 * GiB, 24 * GiB, one_pass=True)
    with pytest.raises(ReplayMemoryError, match="replay.microbatch_tokens"):
        plan_replay([5000, 5000, 5000], ReplayConfig(microbatch_tokens=15000), costs, 10 * GiB, 24 * GiB, one_pass=True)
    with pytest.raises(ValueError, match="replay.one_pass"):
        ReplayConfig(one_pass=True, keep_graph_tokens=100)
    from configs.schema import load_config

    with pytest.raises(ValueError, match="replay.one_pass: false, or workers: 0"):
        load_config("tiny", {"replay.one_pass": True, "workers": 2})
