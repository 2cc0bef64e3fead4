"""engine.loss against TRL 1.16.0 (the oracle) and against numbers worked out by hand.

Tolerances: loss values and d loss / d logps match TRL *bitwise* (atol = rtol = 0) in float32 and float64,
because engine.loss performs the same torch ops in the same order. Logged metrics match to 1e-6 relative
(TRL divides clip counts in float32, we in the log-prob dtype). Hand-computed numbers: 1e-12 in float64.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from trl.trainer import grpo_trainer as trl_grpo
from trl.trainer.grpo_trainer import GRPOTrainer

from engine.loss import (LOSS_TYPES, group_advantages, grpo_loss, importance_sampling_ratio,
                         scale_negative_advantages, token_weights)

torch.set_num_threads(1)
EXACT = dict(atol=0.0, rtol=0.0)
IS_MODES = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# ---------------------------------------------------------------- TRL oracles


def _trl_block(fn, start: str, end: str) -> str:
    """Source lines of `fn` from the line containing `start` up to (excluding) the line containing `end`.

    The IS ratio and the advantages are computed inline in the ~600-line
    `GRPOTrainer._generate_and_score_completions` (generation, rewards, vLLM, logging); driving the whole
    method would need a model, tokenizer and reward functions. Instead we execute TRL's own source text of
    exactly those blocks on our tensors. If TRL moves the markers, this fails loudly rather than silently.
    """
    lines = inspect.getsource(fn).splitlines()
    i = next((k for k, ln in enumerate(lines) if start in ln), None)
    assert i is not None, f"marker {start!r} not found in TRL {fn.__qualname__}; TRL changed, update the oracle"
    j = next((k for k in range(i + 1, len(lines)) if end in lines[k]), None)
    assert j is not None, f"marker {end!r} not found after {start!r} in TRL {fn.__qualname__}"
    return textwrap.dedent("\n".join(lines[i:j]))


_GEN = GRPOTrainer._generate_and_score_completions
TRL_IS_BLOCK = _trl_block(
    _GEN, "# Compute the importance sampling ratio when using vLLM", "# Compute the per-token log probabilities"
)
TRL_IS_METRICS_BLOCK = _trl_block(
    _GEN, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {"
)
TRL_ADV_BLOCK = _trl_block(
    _GEN,
    'if self.multi_objective_aggregation == "sum_then_normalize":',
    'elif self.multi_objective_aggregation == "normalize_then_sum":',
)


def trl_is_ratio(old, sampling, mask, mode, clip_max=3.0, clip_min=None):
    """TRL's IS-ratio block run on our tensors; also returns its min/mean/max metrics."""
    me = SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=clip_max, vllm_importance_sampling_clip_min=clip_min,
        accelerator=SimpleNamespace(gather=lambda x: x.reshape(-1)), _metrics={"train": defaultdict(list)},
    )
    ns = dict(self=me, torch=torch, math=math, old_per_token_logps=old, sampling_per_token_logps=sampling,
              completion_mask=mask, tool_mask=None, device=old.device, mode="train",
              nanmin=trl_grpo.nanmin, nanmax=trl_grpo.nanmax)
    exec(TRL_IS_BLOCK, ns)
    # the metrics block starts inside its own `if use_vllm ...:`; run it dedented (its condition holds here)
    exec(TRL_IS_METRICS_BLOCK, ns)
    m = {k.split("/")[-1]: v[0] for k, v in me._metrics["train"].items() if "importance_sampling_ratio" in k}
    return ns["vllm_importance_sampling_ratio"], m


def trl_advantages(rewards, num_generations, scale_rewards):
    me = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale_rewards,
                         reward_weights=torch.ones(1, dtype=rewards.dtype))
    rewards_per_func = rewards.unsqueeze(1)  # (B, 1): one reward function
    ns = dict(self=me, torch=torch, nanstd=trl_grpo.nanstd, rewards_per_func=rewards_per_func,
              unscorable_mask=torch.isnan(rewards_per_func).all(dim=1), num_generations=num_generations,
              device=rewards.device)
    exec(TRL_ADV_BLOCK, ns)
    return torch.nan_to_num(ns["advantages"], nan=0.0)  # TRL's next statement after the aggregation branches


def trl_loss(logps, old, adv, mask, *, loss_type, level, is_ratio=None, epsilon=0.2, epsilon_high=None,
             delta=None, max_completion_length=512):
    """Run `GRPOTrainer._compute_loss` on a stand-in trainer. Returns (loss, d loss/d logps, metrics)."""
    leaf = logps.detach().clone().requires_grad_(True)
    B, T = logps.shape
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.rand_like(leaf), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None, beta=0.0,
        importance_sampling_level=level, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon_high if epsilon_high is not None else epsilon,  # as GRPOTrainer.__init__
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, _entropy_bonus_enabled=False,
        args=SimpleNamespace(delta=delta, steps_per_generation=1, use_bias_correction_kl=True),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _metrics={"train": defaultdict(list)},
    )
    imask = mask.long()  # TRL's completion_mask is an int tensor
    inputs = dict(prompt_ids=torch.zeros(B, 0, dtype=torch.long), prompt_mask=torch.zeros(B, 0, dtype=torch.long),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=imask, advantages=adv,
                  old_per_token_logps=old, num_items_in_batch=imask.sum())
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(me, model=None, inputs=inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    metrics = {k: v[0] for k, v in me._metrics["train"].items() if k != "entropy"}
    return loss.detach(), grad, metrics


# ---------------------------------------------------------------- data


def make_batch(dtype, B=8, T=7, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    old = -1.0 - r(B, T).abs()  # (B, T) behaviour log-probs
    logps = old + 0.3 * r(B, T)  # current policy: ratios around 1, some clipped
    sampling = old + 0.4 * r(B, T)  # sampler: sequence IS ratios beyond 3 sometimes
    sampling[0, 2] -= 1.5  # one token IS ratio > e^1.5 = 4.5, beyond clip_max=3
    lengths = torch.tensor([7, 5, 1, 3, 7, 0, 6, 2])  # one empty completion, one of length 1
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)  # (B, T)
    rewards = torch.randint(0, 3, (B,), generator=g).to(dtype)
    adv = group_advantages(rewards, G)
    return logps, old, sampling, mask, adv


# ---------------------------------------------------------------- 1. against TRL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_grad_match_trl(loss_type, level, is_mode, dtype):
    logps, old, sampling, mask, adv = make_batch(dtype)
    is_ratio = None
    if is_mode is not None:
        is_ratio, _ = trl_is_ratio(old, sampling, mask.long(), is_mode)
        torch.testing.assert_close(importance_sampling_ratio(old, sampling, mask, is_mode), is_ratio, **EXACT)
        assert ((is_ratio == 0) | (is_ratio == 3.0)).any()  # the clip / mask bites somewhere
    fn = partial(grpo_loss, old_logps=old, advantages=adv, mask=mask, loss_type=loss_type,
                 importance_sampling_level=level, is_ratio=is_ratio)
    loss, metrics = fn(logps)
    w = token_weights(logps, fn)
    ref_loss, ref_grad, ref_metrics = trl_loss(logps, old, adv, mask, loss_type=loss_type, level=level,
                                               is_ratio=is_ratio)
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    torch.testing.assert_close(w, ref_grad, **EXACT)
    assert ref_grad.abs().sum() > 0  # the case is not vacuous
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-6, nan_ok=True), k


@pytest.mark.parametrize(
    "loss_type,kw",
    [("dapo", dict(epsilon_high=0.28)), ("grpo", dict(delta=1.3)), ("bnpo", dict(epsilon=0.1, delta=1.5)),
     ("dapo", dict(delta=1.1)),  # delta < 1 + epsilon_high: pins TRL's order (coef_2 is clipped before delta)
     ("dr_grpo", dict(max_completion_length=16)), ("cispo", dict(epsilon_high=5.0)), ("cispo", dict(epsilon_high=1.2))],
)
def test_options_match_trl(loss_type, kw):
    logps, old, sampling, mask, adv = make_batch(torch.float64, seed=1)
    logps = old + 3.0 * (logps - old)  # wide ratios so delta / epsilon_high / cispo caps all bite
    is_ratio = importance_sampling_ratio(old, sampling, mask, "token_truncate", clip_max=2.0, clip_min=0.5)
    ref_is, _ = trl_is_ratio(old, sampling, mask.long(), "token_truncate", clip_max=2.0, clip_min=0.5)
    torch.testing.assert_close(is_ratio, ref_is, **EXACT)
    fn = partial(grpo_loss, old_logps=old, advantages=adv, mask=mask, loss_type=loss_type, is_ratio=is_ratio, **kw)
    ref_loss, ref_grad, ref_metrics = trl_loss(logps, old, adv, mask, loss_type=loss_type, level="token",
                                               is_ratio=is_ratio, **kw)
    loss, metrics = fn(logps)
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    torch.testing.assert_close(token_weights(logps, fn), ref_grad, **EXACT)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-6, nan_ok=True), k


@pytest.mark.parametrize("mode", IS_MODES[1:])
@pytest.mark.parametrize("clip", [(3.0, None), (2.0, 0.5), (None, 0.8)])
def test_is_ratio_matches_trl(mode, clip):
    clip_max, clip_min = clip
    if clip_max is None and mode.endswith("truncate"):
        clip_max = 10.0  # both None is an error in truncate mode (torch.clamp raises in TRL)
    _, old, sampling, mask, _ = make_batch(torch.float64, seed=2)
    sampling[0, 1] = float("nan")  # vLLM could not score this token: TRL treats it as ratio 1
    ours = importance_sampling_ratio(old, sampling, mask, mode, clip_max=clip_max, clip_min=clip_min)
    ref, ref_metrics = trl_is_ratio(old, sampling, mask.long(), mode, clip_max=clip_max, clip_min=clip_min)
    torch.testing.assert_close(ours, ref, **EXACT)
    _, metrics = grpo_loss(old, old, torch.zeros(8, dtype=old.dtype), mask, is_ratio=ours)
    for k in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{k}"] == pytest.approx(ref_metrics[k], rel=1e-12)


def test_is_ratio_by_hand():
    # old - sampling = log 2 at both tokens of seq 0, log 0.5 at token 0 of seq 1 (token 1 of seq 1 is padding).
    old = torch.zeros(2, 2, dtype=torch.float64)
    sampling = -torch.tensor([[math.log(2), math.log(2)], [math.log(0.5), 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    cases = {  # token ratios [[2, 2], [0.5, 1 (padding)]]; sequence ratios [4, 0.5] (exp of the *sum*)
        ("token_truncate", 3.0, None): [[2, 2], [0.5, 1]],
        ("token_mask", 1.5, None): [[0, 0], [0.5, 1]],
        ("token_truncate", 3.0, 0.8): [[2, 2], [0.8, 1]],
        ("sequence_truncate", 3.0, None): [[3], [0.5]],
        ("sequence_mask", 3.0, None): [[0], [0.5]],  # seq 0 masked although each token's ratio is only 2
        ("sequence_mask", 5.0, 0.6): [[4], [0]],
    }
    for (mode, hi, lo), want in cases.items():
        got = importance_sampling_ratio(old, sampling, mask, mode, clip_max=hi, clip_min=lo)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0, msg=mode)
        torch.testing.assert_close(got, trl_is_ratio(old, sampling, mask.long(), mode, hi, lo)[0], **EXACT)


# ---------------------------------------------------------------- 2. by hand


def hand_batch():
    # old logp = 0, so ratio r = exp(logp). Seq 0: A=+1, r=[1.5, 0.9]. Seq 1: A=-1, r=[0.5, 1.1], token 1 padding.
    r = torch.tensor([[1.5, 0.9], [0.5, 1.1]], dtype=torch.float64)
    return r.log(), torch.zeros(2, 2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64), \
        torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)


def test_hand_computed_dapo_and_grpo():
    # eps = 0.2, per-token loss = -min(r*A, clip(r, 0.8, 1.2)*A):
    #   seq 0, A=+1: r=1.5 -> -min(1.5, 1.2) = -1.2 (high-clipped, grad 0); r=0.9 -> -0.9 (d/dlogp = -r*A = -0.9)
    #   seq 1, A=-1: r=0.5 -> -min(-0.5, -0.8) = 0.8 (low-clipped, grad 0); token 1 masked
    # dapo/bnpo: (-1.2 - 0.9 + 0.8) / 3 tokens = -1.3/3;  w = [[0, -0.9/3], [0, 0]]
    # grpo: mean(seq0 (-1.2-0.9)/2 = -1.05, seq1 0.8/1) = -0.125;  w = [[0, -0.9/2/2], [0, 0]]
    # dr_grpo (max_completion_length=4): -1.3 / (2*4) = -0.1625
    logps, old, adv, mask = hand_batch()
    tol = dict(atol=1e-12, rtol=0)
    want = {"dapo": (-1.3 / 3, -0.3), "bnpo": (-1.3 / 3, -0.3), "grpo": (-0.125, -0.225), "dr_grpo": (-0.1625, -0.1125)}
    for lt, (want_loss, want_w) in want.items():
        fn = partial(grpo_loss, old_logps=old, advantages=adv, mask=mask, loss_type=lt, max_completion_length=4)
        loss, m = fn(logps)
        torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=torch.float64), **tol)
        expected_w = torch.tensor([[0.0, want_w], [0.0, 0.0]], dtype=torch.float64)
        torch.testing.assert_close(token_weights(logps, fn), expected_w, **tol)
        # clip metrics: 1 of 3 tokens low-clipped, 1 high-clipped
        assert (m["clip_ratio/low_mean"], m["clip_ratio/high_mean"]) == pytest.approx((1 / 3, 1 / 3))
        assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)


def test_hand_computed_cispo_and_sequence_level():
    logps, old, adv, mask = hand_batch()
    # cispo, eps_high=1.2: loss = -sum(min(r, 1.2).detach() * A * logp) / 3
    #   = -(1.2*log1.5 + 0.9*log0.9 - 0.5*log0.5) / 3;  w = -min(r,1.2)*A/3 = [[-0.4, -0.3], [0.5/3, 0]]
    fn = partial(grpo_loss, old_logps=old, advantages=adv, mask=mask, loss_type="cispo", epsilon_high=1.2)
    want = -(1.2 * math.log(1.5) + 0.9 * math.log(0.9) - 0.5 * math.log(0.5)) / 3
    assert fn(logps)[0].item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(token_weights(logps, fn), torch.tensor([[-0.4, -0.3], [0.5 / 3, 0.0]],
                               dtype=torch.float64), atol=1e-12, rtol=0)
    # GSPO (sequence level), grpo: s0 = exp(mean(log 1.5, log 0.9)) = sqrt(1.35) = 1.1619, inside [0.8, 1.2];
    #   s1 = 0.5 (one real token), A=-1 -> low-clipped: -min(-0.5, -0.8) = 0.8.
    #   loss = mean over seqs (-s0, 0.8) = (0.8 - sqrt(1.35)) / 2;  w on each token of seq 0 = -s0 / 2 tokens / 2 seqs
    fn = partial(grpo_loss, old_logps=old, advantages=adv, mask=mask, loss_type="grpo",
                 importance_sampling_level="sequence")
    assert fn(logps)[0].item() == pytest.approx((-math.sqrt(1.35) + 0.8) / 2, abs=1e-12)
    s0 = math.sqrt(1.35)
    torch.testing.assert_close(token_weights(logps, fn), torch.tensor([[-s0 / 4, -s0 / 4], [0.0, 0.0]],
                               dtype=torch.float64), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- 3. advantages


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    # group: group 0 mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3); group 1 has std 0 -> 0 / 1e-4 = 0
    s = math.sqrt(1 / 3)
    a = 0.5 / (s + 1e-4)  # 0.86587...
    want_group = [a, -a, -a, a, 0, 0, 0, 0]
    # batch: mean still per group; std over all 8: mean 1.25, sum sq dev 5.5, /7 -> sqrt(5.5/7) = 0.886405
    b = 0.5 / (math.sqrt(5.5 / 7) + 1e-4)  # 0.5 / 0.886505 = 0.564012
    want_batch = [b, -b, -b, b, 0, 0, 0, 0]
    want_none = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    for mode, want in (("group", want_group), ("batch", want_batch), ("none", want_none)):
        got = group_advantages(r, 4, mode)
        # 1e-7, not 1e-12: TRL's nanstd computes the Bessel factor n/(n-1) from int tensors, i.e. in float32
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-7, rtol=0, msg=mode)
        torch.testing.assert_close(got, trl_advantages(r, 4, mode), **EXACT)
    assert a == pytest.approx(0.865875, abs=1e-6) and b == pytest.approx(0.564012, abs=1e-6)
    torch.testing.assert_close(group_advantages(r, 4, True), group_advantages(r, 4, "group"), **EXACT)


def test_negative_advantage_scale():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv = group_advantages(r, 4)
    assert scale_negative_advantages(adv, 1.0) is adv  # the default is TRL's arithmetic, untouched
    a = float(adv[0])
    torch.testing.assert_close(scale_negative_advantages(adv, 0.0),
                               torch.tensor([a, 0, 0, a, 0, 0, 0, 0], dtype=torch.float64), **EXACT)
    torch.testing.assert_close(scale_negative_advantages(adv, 0.25),
                               torch.tensor([a, -a / 4, -a / 4, a, 0, 0, 0, 0], dtype=torch.float64), **EXACT)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_group_advantages_match_trl_with_nan(mode):
    g = torch.Generator().manual_seed(3)
    r = torch.rand(12, generator=g)
    r[1] = float("nan")  # unscorable: excluded from its group's mean/std, advantage 0
    r[8:12] = torch.tensor([float("nan"), 1.0, float("nan"), float("nan")])  # one scorable -> std NaN -> adv 0
    got = group_advantages(r, 4, mode)
    torch.testing.assert_close(got, trl_advantages(r, 4, mode), **EXACT)
    assert got[1] == 0 and not got.isnan().any()


# ---------------------------------------------------------------- 4. sum w * logp backprop == direct backprop


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_token_weights_backprop_equals_direct_grad(loss_type, level):
    g = torch.Generator().manual_seed(4)
    B, T, D, V = 4, 5, 3, 6
    model = torch.nn.Linear(D, V).double()
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()

    def logp():  # (B, T) per-token log-probs of the targets, with graph
        return torch.log_softmax(model(x), -1).gather(-1, targets[..., None]).squeeze(-1)

    with torch.no_grad():
        old = logp() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    is_ratio = importance_sampling_ratio(old, sampling, mask, "token_truncate")
    fn = partial(grpo_loss, old_logps=old, advantages=torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64),
                 mask=mask, loss_type=loss_type, importance_sampling_level=level, is_ratio=is_ratio)
    direct = torch.autograd.grad(fn(logp())[0], list(model.parameters()))
    lp = logp()
    w = token_weights(lp.detach(), fn)
    via_w = torch.autograd.grad((w * lp).sum(), list(model.parameters()))
    for a, b in zip(direct, via_w):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- 5. bad input


def test_bad_input_raises():
    logps, old, adv, mask = hand_batch()
    with pytest.raises(ValueError, match="loss_type='sapo' is not supported"):
        grpo_loss(logps, old, adv, mask, loss_type="sapo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(logps, old, adv, mask, importance_sampling_level="seq")
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        grpo_loss(logps, old, adv, mask[:, :1])
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(logps, old, adv[:1], mask)
    with pytest.raises(ValueError, match="is_ratio must be"):
        grpo_loss(logps, old, adv, mask, is_ratio=torch.ones(2, 3))
    with pytest.raises(ValueError, match="importance-sampling mode"):
        importance_sampling_ratio(old, old, mask, "token")
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        importance_sampling_ratio(old, old[:1], mask)
    with pytest.raises(ValueError, match="needs clip_min or clip_max"):
        importance_sampling_ratio(old, old, mask, "token_truncate", clip_max=None)
    with pytest.raises(ValueError, match="not a multiple of num_generations=3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(8), 4, "std")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


def test_on_policy_default_and_explicit_normalizer():
    logps, _, adv, mask = hand_batch()
    # old_logps=None is TRL's on-policy shortcut (old = logps.detach()): ratio 1, dapo loss = -sum(A * mask) / 3
    loss, _ = grpo_loss(logps, None, adv, mask)
    assert loss.item() == pytest.approx(-(1 + 1 - 1) / 3, abs=1e-12)
    # an explicit global token count (e.g. 6 over two micro-batches) replaces mask.sum() = 3 for dapo and cispo
    for lt in ("dapo", "cispo"):
        half, _ = grpo_loss(logps, None, adv, mask, loss_type=lt, num_items_in_batch=torch.tensor(6))
        assert half.item() == pytest.approx(grpo_loss(logps, None, adv, mask, loss_type=lt)[0].item() / 2, abs=1e-12)


def test_negative_token_advantages_keep_a_failed_rollouts_advantage_only_where_it_slipped():
    """grpo.negative_token_max_prob: a below-mean rollout's negative advantage stays on its answer tokens sampled with
    probability below p and on its thought terms; its likely answer tokens get none; other rollouts are untouched. In
    the loss only those tokens then carry gradient for that rollout."""
    from engine.loss import negative_token_advantages

    adv = torch.tensor([1.0, -1.0, 0.0])
    p = torch.tensor([[0.9, 0.1, 0.6, 0.05], [0.9, 0.1, 0.6, 0.05], [0.9, 0.1, 0.6, 0.05]])
    answer = torch.tensor([[0.0, 1.0, 1.0, 1.0]] * 3)  # term 0: a thought density (its "log-prob" is not one)
    out = negative_token_advantages(adv, p.log(), answer, 0.5)
    assert torch.equal(out[0], torch.ones(4))
    assert torch.equal(out[1], torch.tensor([-1.0, -1.0, 0.0, -1.0]))
    assert torch.equal(out[2], torch.zeros(4))
    lp = p.log().clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, None, out, torch.ones(3, 4))
    loss.backward()
    assert lp.grad[1, 2] == 0 and lp.grad[1, 1] != 0 and lp.grad[1, 3] != 0 and lp.grad[0].ne(0).all()
    with pytest.raises(ValueError, match="expected"):
        negative_token_advantages(adv.unsqueeze(1), p.log(), answer, 0.5)
