"""The rollout-parity rule's two less-travelled branches, driven through the replay and optimize stages.

(a) One answer token whose sampler log-prob is off by more than `gates.parity_token_max` (1 nat) among tokens on
    which both engines agree: the gate passes, the parity report lists the token, its loss weight is exactly zero,
    and the adapter gradient equals the gradient of the GRPO loss with that token removed (computed independently:
    autograd straight through engine.loss on the re-scored log-probs, the token cut out of the sequence).
(b) Tokens under `gates.parity_min_prob` (1 %) in both engines, each off by several nats: counted in the mean they
    would fail the gate; the gate leaves them out and counts them (`tokens_below_min_prob`).

The run is the tiny model in FP32 with a short bootstrap (128 episodes), so the sampled answers hold both tokens the
model is sure of (>= 1 %, the parity population) and tokens it is not (< 1 %). Sampler log-probs are injected by
rewriting rollouts.arrow; the trainer's side is whatever replay computes.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.conftest import fresh_step, make_run

pytestmark = pytest.mark.slow

OFF = 1.25  # nat: the injected token's sampler error, above parity_token_max (1.0)


@pytest.fixture(scope="module")
def stored_step(tmp_path_factory):
    """A finished fresh step: its rollouts (sampler log-probs as sampled) and its replay (trainer log-probs)."""
    from artifacts import read_table
    from engine import runtime

    runtime.clear()
    root = tmp_path_factory.mktemp("parity-mask")
    run_dir = make_run(root / "run", **{"bootstrap.episodes": 128, "bootstrap.batch_size": 16})
    s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    trainer_lp = read_table(s0["replay"]["path"]).column("trainer_logps").to_pylist()
    return {"run_dir": run_dir, "rollouts": s0["rollouts"], "base": s0["base"], "trainer_lp": trainer_lp,
            "adapter": f"{run_dir}/adapter-init", "root": root}


def _with_columns(rollouts_in: str, out: str, **columns) -> str:
    """rollouts.arrow with some columns replaced (schema metadata kept: rows, K, sigma)."""
    from artifacts import read_table, write_table

    t = read_table(rollouts_in)
    for name, values in columns.items():
        field = t.schema.field(name)
        t = t.set_column(t.schema.get_field_index(name), name, pa.array(values, type=field.type))
    write_table(out, t)
    return out


def _sampler_column(lps: list[list[float]]) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.float32) for x in lps]


def test_one_token_above_the_limit_is_masked_and_removed_from_the_gradient(stored_step, tmp_path):
    from artifacts import read_json, read_table
    from engine import runtime
    from engine.loss import grpo_loss, importance_sampling_ratio
    from engine.replay import score_microbatch, to_sequences
    from stages.context import run_config
    from stages.optimize import accumulate_gradients, driver_weights, loss_inputs, stored_plan
    from stages.replay import load_turns, replay

    run_dir, trainer_lp = stored_step["run_dir"], stored_step["trainer_lp"]
    cfg = run_config(run_dir)
    considered = [(i, j) for i, row in enumerate(trainer_lp) for j, t in enumerate(row)
                  if math.exp(t) >= cfg.gates.parity_min_prob]
    assert OFF / len(considered) <= 0.8 * cfg.gates.parity_mean_max, (
        f"only {len(considered)} answer tokens >= 1 %: the injected token alone would fail the mean; bootstrap longer")
    # the most probable token of the turn with the most considered tokens (its neighbours stay in the loss)
    turn = max({i for i, _ in considered}, key=lambda i: sum(1 for k, _ in considered if k == i))
    tok = max((j for i, j in considered if i == turn), key=lambda j: trainer_lp[turn][j])
    sampler = [list(row) for row in trainer_lp]  # both engines agree on every other token
    sampler[turn][tok] = trainer_lp[turn][tok] - OFF
    n_rows = int(read_table(stored_step["rollouts"]).schema.metadata[b"rows"])
    adv_of_row = [(1.0, -1.0, 0.5, -0.5)[r % 4] for r in range(n_rows)]  # a gradient in every row
    rows = read_table(stored_step["rollouts"]).column("row").to_pylist()
    rollouts = _with_columns(stored_step["rollouts"], str(tmp_path / "rollouts.arrow"),
                             sampler_logps=_sampler_column(sampler),
                             advantage=np.asarray([adv_of_row[r] for r in rows], dtype=np.float32))

    # replay (fresh: gated) -> the gate passes, the token is masked and listed
    rp = replay(run_dir, 1, rollouts, stored_step["adapter"], stored_step["base"], True, keep_graph=False)
    report = read_json(f"{run_dir}/step-0001/parity.json")
    assert report["passed"] is True and rp["masked"] == 1
    assert report["mean_gap"] == pytest.approx(OFF / len(considered), abs=1e-5)
    assert [(m["turn"], m["token"]) for m in report["masked_tokens"]] == [(turn, tok)]
    assert report["masked_tokens"][0]["gap"] == pytest.approx(OFF, abs=1e-5)
    assert (report["worst_tokens"][0]["turn"], report["worst_tokens"][0]["token"]) == (turn, tok)
    keep = read_table(rp["path"]).column("loss_mask").to_pylist()
    assert [(i, j) for i, row in enumerate(keep) for j, k in enumerate(row) if not k] == [(turn, tok)]

    # optimize's driver: that token's loss weight is exactly zero, its neighbours' are not
    li = loss_inputs(cfg, rollouts, rp["path"], rp["path"])
    w_thought, w_answer = driver_weights(cfg, li, {})
    assert w_answer[turn][tok].item() == 0.0
    assert bool((w_answer[turn] != 0).sum() == len(w_answer[turn]) - 1), "every other token of the turn has a weight"

    # without the mask the token would count: sequence-level IS ratio exp(OFF) > clip 3 zeroes its whole rollout
    unmasked = _with_columns(rp["path"], str(tmp_path / "replay-unmasked.arrow"),
                             loss_mask=[np.ones(len(k), dtype=bool) for k in keep])
    _, w_unmasked = driver_weights(cfg, loss_inputs(cfg, rollouts, unmasked, unmasked), {})
    assert float(w_unmasked[turn].abs().sum()) == 0.0 and float(w_answer[turn].abs().sum()) > 0.0

    # the stage's gradient: Σ w·logp back-propagated micro-batch by micro-batch (re-forward, checked bit for bit)
    engine = runtime.trainer(cfg, stored_step["base"], stored_step["base"])
    engine.use_adapter(stored_step["adapter"])
    params = [p for _, p in engine.model.named_parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    accumulate_gradients(cfg, engine, li, w_thought, w_answer, None, 1, stored_plan(rp["path"]))
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    # the reference: the GRPO loss of the same re-scored log-probs with the token cut out, autograd to the adapter
    turns, roll = load_turns(rollouts)
    K, sigma = int(roll.schema.metadata[b"K"]), float(roll.schema.metadata[b"sigma"])
    mbs, tiers = stored_plan(rp["path"])
    ans: list = [None] * len(rows)
    logq: list = [None] * len(rows)
    with torch.enable_grad():
        for idx, tier in zip(mbs, tiers):
            a, q = score_microbatch(engine, turns, idx, cfg.sampler.temperature, sigma, tier, cfg.replay)
            for n, i in enumerate(idx):
                ans[i], logq[i] = a[n], q[n]
        tw = cfg.grpo.thought_loss_weight  # value q bit for bit, gradient tw * dq (optimize scales thought weights)
        cut = lambda x, i: torch.cat([x[:tok], x[tok + 1:]]) if i == turn else x  # noqa: E731
        lp_turn = [torch.cat([q.detach() + tw * (q - q.detach()), cut(a, i)])
                   for i, (q, a) in enumerate(zip(logq, ans))]
        samp_turn = [torch.cat([q.detach(), cut(torch.tensor(s), i)]) for i, (q, s) in enumerate(zip(logq, sampler))]
        lp, mask = to_sequences(rows, lp_turn, n_rows)
        samp, _ = to_sequences(rows, samp_turn, n_rows)
        old = lp.detach()
        g = cfg.grpo
        is_ratio = importance_sampling_ratio(old, samp, mask, g.vllm_importance_sampling_mode,
                                             g.vllm_importance_sampling_clip_max, g.vllm_importance_sampling_clip_min)
        loss, _ = grpo_loss(lp, old, torch.tensor(adv_of_row), mask, loss_type=g.loss_type, epsilon=g.epsilon,
                            epsilon_high=g.epsilon_high, delta=g.delta,
                            importance_sampling_level=g.importance_sampling_level, is_ratio=is_ratio,
                            max_completion_length=g.max_completion_length)
        want = torch.autograd.grad(loss, params)
    assert mask.sum() == li.mask.sum() == sum(x.numel() for x in lp_turn), "one token fewer, in both layouts"
    norm = torch.linalg.vector_norm(torch.stack([w.norm() for w in want]))
    assert norm > 0
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7 * float(norm)), (
            f"{name}: the stage's gradient differs from the loss with the token removed by "
            f"{float((a - b).abs().max()):.3e}")


def test_tokens_under_min_prob_are_left_out_of_the_mean_and_counted(stored_step, tmp_path):
    from artifacts import read_json, read_table
    from engine import gates
    from stages.context import run_config
    from stages.replay import replay

    run_dir, trainer_lp = stored_step["run_dir"], stored_step["trainer_lp"]
    cfg = run_config(run_dir)
    p_min = cfg.gates.parity_min_prob
    low = [(i, j) for i, row in enumerate(trainer_lp) for j, t in enumerate(row) if math.exp(t) < p_min]
    n = sum(len(row) for row in trainer_lp)
    assert low and len(low) < n, "the stored step needs answer tokens both under and over 1 %"
    shift = 3.0  # nat: the sampler calls each such token e^3 times less likely (still < 1 %: both engines agree)
    assert shift * len(low) / n > cfg.gates.parity_mean_max, "counted, the shifted tokens must break the mean"
    sampler = [list(row) for row in trainer_lp]
    for i, j in low:
        sampler[i][j] = trainer_lp[i][j] - shift
        assert math.exp(sampler[i][j]) < p_min
    rollouts = _with_columns(stored_step["rollouts"], str(tmp_path / "rollouts.arrow"),
                             sampler_logps=_sampler_column(sampler))

    rp = replay(run_dir, 2, rollouts, stored_step["adapter"], stored_step["base"], True, keep_graph=False)
    report = read_json(f"{run_dir}/step-0002/parity.json")
    assert report["passed"] is True and report["masked_tokens"] == [] and rp["masked"] == 0
    assert report["tokens"] == n
    assert report["tokens_below_min_prob"] == len(low)
    assert report["tokens_considered"] == n - len(low)
    assert report["mean_gap"] < 1e-5 and report["max_gap"] < 1e-5  # the shifted tokens are in neither
    assert all(all(k) for k in read_table(rp["path"]).column("loss_mask").to_pylist()), "left out != masked"
    # the same numbers with the filter off: the mean breaks, the gate fails
    stored = read_table(rp["path"]).column("trainer_logps").to_pylist()
    counted, _ = gates.rollout_parity(stored, sampler, mean_max=cfg.gates.parity_mean_max,
                                      token_max=cfg.gates.parity_token_max, min_prob=0.0)
    assert counted["tokens_below_min_prob"] == 0
    assert counted["mean_gap"] == pytest.approx(shift * len(low) / n, rel=1e-4)
    with pytest.raises(gates.GateFailed):
        gates.check_parity(counted)


def test_rollout_parity_counts_by_hand():
    """Hand-computed: min_prob 0.01 (log 0.01 = -4.605), token_max 1.0, mean_max 0.1."""
    from engine import gates

    lg = math.log
    trainer = [[lg(0.5), lg(0.5), lg(0.005)], [lg(0.9), lg(0.001)]]
    sampler = [[lg(0.5), lg(0.5) - 1.2, lg(0.005) - 4.0], [lg(0.9), lg(0.001) + 2.0]]
    # considered: (0,0) 0, (0,1) 1.2, (1,0) 0 and (1,1): 0.001 * e^2 = 0.0074 < 0.01 -> out; (0,2) out
    report, keep = gates.rollout_parity(trainer, sampler, mean_max=0.5, token_max=1.0, min_prob=0.01)
    assert report["tokens"] == 5 and report["tokens_considered"] == 3 and report["tokens_below_min_prob"] == 2
    assert report["mean_gap"] == pytest.approx(1.2 / 3) and report["passed"]
    assert [(m["turn"], m["token"]) for m in report["masked_tokens"]] == [(0, 1)]
    assert keep == [[True, False, True], [True, True]]
    assert report["masked_share"] == pytest.approx(1 / 5)
    strict, _ = gates.rollout_parity(trainer, sampler, mean_max=0.1, token_max=1.0, min_prob=0.01)
    with pytest.raises(gates.GateFailed, match="rollout-parity"):
        gates.check_parity(strict)
