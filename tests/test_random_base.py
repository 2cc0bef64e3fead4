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
