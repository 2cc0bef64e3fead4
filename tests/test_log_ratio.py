"""A reuse step whose log-ratios overflow: log(pi/pi_old) above 88.7 nat makes TRL's clipped objective back-propagate
inf * 0, so the gradient is NaN. Thought densities move by hundreds of nats when the adapter changes (a reuse step
of the 27B step failed `finite-gradients` this way on the H200). The finite-weights gate stops it before any
backward and names the cause and the setting; grpo.max_log_ratio (verl's clamp) makes the same step finite."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import fresh_step, make_run


def test_overflowing_log_ratio_makes_trl_arithmetic_nan_and_the_clamp_finite():
    from engine.loss import grpo_loss, token_weights

    lp, old, mask = torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)
    lp[0, 1] = 100.0  # one term 100 nat above its old value
    for adv in ([1.0, -1.0], [0.0, 0.5], [-1.0, 1.0]):
        a = torch.tensor(adv)
        w = token_weights(lp, lambda x: grpo_loss(x, old, a, mask, loss_type="dapo", delta=4.0))
        assert not torch.isfinite(w[0, 1])  # delta does not help: the exp overflowed before the clamp
        w = token_weights(lp, lambda x: grpo_loss(x, old, a, mask, loss_type="dapo", max_log_ratio=20.0))
        assert torch.isfinite(w).all() and w[0, 1] == 0.0  # clamped: zero gradient, like a clipped term
        # terms inside the bound keep TRL's values bit for bit
        ref = token_weights(lp, lambda x: grpo_loss(x.clone().index_put_((torch.tensor([0]), torch.tensor([1])),
                                                                          torch.tensor(0.0)), old, a, mask))
        assert torch.equal(w[1], ref[1]) and torch.equal(w[0, [0, 2, 3]], ref[0, [0, 2, 3]])
    _, m = grpo_loss(lp, old, torch.tensor([1.0, -1.0]), mask, max_log_ratio=20.0)
    assert m["log_ratio/clamped"] == 1 / 8
    with pytest.raises(ValueError, match="max_log_ratio"):
        grpo_loss(lp, old, torch.tensor([1.0, -1.0]), mask, max_log_ratio=0.0)


def test_moved_terms_under_the_clamp_dominate_dapo_and_stay_bounded_with_cispo():
    """The 27B presets' choice (cispo, epsilon_high 5): after one update, thought terms that moved by 15 nat with a
    negative advantage get dapo weights e^15 times an unmoved token's (PPO's unclipped branch; the H200 reuse step's
    loss 934,074 and gradient norm 8.8e8), while cispo caps every weight at epsilon_high * |A| / n."""
    from engine.loss import grpo_loss, token_weights

    lp, old, mask = torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)
    lp[0, :2] = 15.0  # two thought terms moved by 15 nat
    adv = torch.tensor([-1.0, 1.0])
    w_dapo = token_weights(lp, lambda x: grpo_loss(x, old, adv, mask, loss_type="dapo", max_log_ratio=20.0))
    w_cispo = token_weights(lp, lambda x: grpo_loss(x, old, adv, mask, loss_type="cispo", epsilon_high=5.0,
                                                    max_log_ratio=20.0))
    n = mask.sum()
    assert torch.allclose(w_dapo[0, :2].abs(), torch.full((2,), math.exp(15.0) / n), rtol=1e-5)
    assert w_dapo[0, :2].abs().min() > 1e6 * w_dapo[0, 2:].abs().max()
    assert w_cispo.abs().max() <= 5.0 / n + 1e-7
    assert torch.allclose(w_cispo[0, :2], torch.full((2,), 5.0 / n))  # d loss / d logp = +cap * |A| / n for A < 0
    assert torch.allclose(w_cispo[0, 2:], torch.full((2,), 1.0 / n))  # unmoved terms: ratio 1


def answer_length(prompts, completions, **kwargs) -> list[float]:
    """A user reward function that spreads any group's rewards (so the step has a gradient signal)."""
    return [1e-3 * len(str(c)) for c in completions]


@pytest.mark.slow
def test_reuse_step_with_moved_thought_densities(tmp_path, monkeypatch):
    from engine import gates, runtime
    from stages import optimize as O
    from stages.context import run_config
    from stages.replay import replay
    from tests.test_gates import trained_like_adapter

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"grpo.max_log_ratio": 20.0,
                                            "gym.reward_funcs": ["tests.test_log_ratio:answer_length"]})
    from artifacts import read_json

    init = read_json(f"{run_dir}/prepared.json")["adapter_init"]
    s0 = fresh_step(run_dir, 0, init)
    # a reuse step whose old replay ran under an adapter far from the new one (LoRA B as after training): a thought
    # sampled near the new adapter's mean is thousands of nats likelier under it than under the old one
    moved = trained_like_adapter(run_dir, tmp_path / "moved")
    old = replay(run_dir, 1, s0["rollouts"], moved, s0["base"], False, keep_graph=False)["path"]
    new = s0["replay"]["path"]
    opt0 = f"{run_dir}/step-0000/optimizer.safetensors"

    # TRL's arithmetic (no clamp): stopped before the backward, with the cause and the setting named
    cfg = run_config(run_dir)
    trl = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_log_ratio": None})})
    monkeypatch.setattr(O, "run_config", lambda _: trl)
    with pytest.raises(gates.GateFailed) as err:
        O.optimize(run_dir, 1, s0["rollouts"], new, old, init, opt0, s0["base"])
    rep = err.value.report
    assert err.value.gate == "finite-gradients" and "grpo.max_log_ratio" in str(err.value)
    assert rep["by_kind"]["thought"] > 0 and rep["worst"]["log_ratio"] > 88.7
    monkeypatch.undo()

    # the run's setting (max_log_ratio 20): the same step is finite, the clamped share reported
    out = O.optimize(run_dir, 1, s0["rollouts"], new, old, init, opt0, s0["base"])
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0, out
    from artifacts import RunDir

    loss = read_json(RunDir(run_dir).loss(1))
    assert 0 < loss["log_ratio/clamped"] < 1
