"""GRPO loss as pure tensor functions, mirroring TRL 1.16.0 `GRPOTrainer` line for line.

TRL keeps its loss inline in a trainer method that reads ~20 attributes; here the same arithmetic is
four plain functions (B sequences, T tokens):

    group_advantages          <- GRPOTrainer._generate_and_score_completions (sum_then_normalize branch)
    importance_sampling_ratio <- GRPOTrainer._generate_and_score_completions (vLLM IS-correction block)
    grpo_loss                 <- GRPOTrainer._compute_loss (beta=0, no entropy mask/bonus, no off-policy mask)
    token_weights             -> w_i = d loss / d logp_i, so that workers back-propagate sum_i w_i * logp_i

Normalizers are TRL's with num_processes=1, gradient_accumulation_steps=1, steps_per_generation=1.
tests/test_loss.py drives TRL's own code on the same tensors as the oracle.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ScaleRewards = Literal["group", "batch", "none"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


def _nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Bessel-corrected std ignoring NaNs; NaN where fewer than 2 values (trl.trainer.utils.nanstd).

    As in TRL, the factor count / (count - 1) divides int tensors, so it is float32 (torch's default dtype)
    even for float64 rewards: std carries a ~1e-8 relative error in float64.
    """
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * corr)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: ScaleRewards | bool = "group") -> Tensor:
    """(B,) rewards, consecutive groups of `num_generations` -> (B,) advantages.

    Mirrors `GRPOTrainer._generate_and_score_completions`, `multi_objective_aggregation="sum_then_normalize"`
    (rewards = already-weighted sum over reward functions, NaN = unscorable completion):
        A = (r - nanmean_group(r)) / (nanstd(r) + 1e-4)
    std is per group for "group", over the whole batch for "batch" (the mean stays per group!), and unused for
    "none". nanstd is Bessel-corrected. NaN advantages (unscorable rows) become 0. True/False mean group/none
    as in GRPOConfig.
    """
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}.")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of num_generations={num_generations}; "
            "pass whole groups of completions, each group contiguous."
        )
    G = num_generations
    grouped = rewards.view(-1, G)  # (B/G, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)  # (B,)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(G) if G > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def scale_negative_advantages(advantages: Tensor, scale: float) -> Tensor:
    """Advantages below zero multiplied by `scale` (grpo.negative_advantage_scale); 1 returns them unchanged."""
    if scale == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * scale, advantages)


def negative_token_advantages(advantages: Tensor, sampling_logps: Tensor, answer_tokens: Tensor,
                              max_prob: float) -> Tensor:
    """(B, T) per-token advantages: a below-mean rollout's advantage only on its answer tokens that were sampled with
    probability below `max_prob` (grpo.negative_token_max_prob) -- the tokens where it slipped -- and on its other
    terms (thought densities) as before; every token of the other rollouts keeps its rollout's advantage.

    advantages (B,); sampling_logps (B, T): the sampler's log-probs (at its temperature) in the sequence layout;
    answer_tokens (B, T): 1 where the term is an answer token (not a thought density, not padding)."""
    if (advantages.dim() != 1 or sampling_logps.shape != answer_tokens.shape
            or sampling_logps.shape[0] != advantages.shape[0]):
        raise ValueError(f"advantages (B,) and (B, T) log-probs / answer mask expected, got {tuple(advantages.shape)}, "
                         f"{tuple(sampling_logps.shape)}, {tuple(answer_tokens.shape)}")
    adv = advantages.unsqueeze(1).expand_as(sampling_logps)
    keep = (adv >= 0) | (answer_tokens == 0) | (sampling_logps < math.log(max_prob))
    return torch.where(keep, adv, torch.zeros_like(adv))


def importance_sampling_ratio(
    old_logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    mode: ISMode = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> Tensor:
    """Trainer-vs-sampler IS ratio exp(old - sampling): (B, T) for token_* modes, (B, 1) for sequence_* modes.

    Mirrors the `vllm_importance_sampling_correction` block of `GRPOTrainer._generate_and_score_completions`
    (the value stored as inputs["importance_sampling_ratio"]). Masked positions contribute a log-diff of 0
    (ratio 1 per token); NaN sampling log-probs count as 0 too (note: nan_to_num also turns +-inf into the
    dtype's finite extremes). The sequence ratio is exp of the *sum* of token log-diffs. *_truncate clamps to
    [clip_min, clip_max]; *_mask sets ratios outside it to 0 (a bound of None is open).
    """
    if mode not in IS_MODES:
        raise ValueError(f"importance-sampling mode {mode!r} is not one of {IS_MODES}.")
    if not (old_logps.shape == sampling_logps.shape == mask.shape) or old_logps.dim() != 2:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)}, sampling_logps {tuple(sampling_logps.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)."
        )
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)  # (B, T)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            raise ValueError(f"mode={mode!r} needs clip_min or clip_max; both are None.")
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    is_ratio: Tensor | None = None,
    max_completion_length: int = 512,
    num_items_in_batch: Tensor | float | None = None,
    max_log_ratio: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO policy loss and its metrics; mirrors `GRPOTrainer._compute_loss` with beta=0.

    logps, old_logps, mask: (B, T); advantages: (B,) or (B, T); is_ratio: (B, T) or (B, 1) from
    `importance_sampling_ratio`, or None for no sampler correction. old_logps=None means logps.detach()
    (TRL's on-policy shortcut). epsilon_high=None means epsilon -- also for cispo, where TRL uses
    epsilon_high itself (not 1 + epsilon_high) as the cap on the detached ratio (ScaleRL recommends 5.0).
    num_items_in_batch=None means mask.sum() (dapo/cispo normalizer; pass the global token count when the
    batch is split).
    max_log_ratio=None is TRL's arithmetic. A value m clamps log(pi/pi_old) to [-m, m] before the exp (verl's
    guard, m=20 there): without it one term more than 88.7 nat above its old value makes exp overflow FP32 and the
    dapo/grpo/bnpo/dr_grpo gradient NaN (inf * 0 in the clipped branch), whatever `delta`; cispo's detached ratio
    is immune. A clamped term has zero gradient (as a clipped one); the share is reported as log_ratio/clamped.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {LOSS_TYPES}.")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not one of {IS_LEVELS}.")
    old_logps = logps.detach() if old_logps is None else old_logps
    if logps.dim() != 2 or old_logps.shape != logps.shape or mask.shape != logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)}, old_logps {tuple(old_logps.shape)} and mask {tuple(mask.shape)} "
            "must all be (B, T)."
        )
    B, T = logps.shape
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"advantages must be ({B},) or ({B}, {T}), got {tuple(advantages.shape)}.")
    if is_ratio is not None and is_ratio.shape not in ((B, T), (B, 1)):
        raise ValueError(f"is_ratio must be ({B}, {T}) or ({B}, 1), got {tuple(is_ratio.shape)}.")
    eps_low, eps_high = epsilon, (epsilon_high if epsilon_high is not None else epsilon)
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)

    log_ratio = logps - old_logps  # (B, T)
    if importance_sampling_level == "token":
        log_w = log_ratio  # (B, T)
    else:  # GSPO: length-normalized sequence log-ratio
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    clamped = None
    if max_log_ratio is not None:
        if not max_log_ratio > 0:
            raise ValueError(f"max_log_ratio must be > 0 (or None for TRL's arithmetic), got {max_log_ratio}.")
        clamped = log_w.detach().abs() > max_log_ratio
        log_w = log_w.clamp(-max_log_ratio, max_log_ratio)
    coef_1 = torch.exp(log_w)

    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * logps  # (B, T)
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:  # two-sided clipping (INTELLECT-2)
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)  # (B, T) or (B, 1)
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio

    masked = per_token_loss * mask  # (B, T)
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (per_token_loss.size(0) * max_completion_length)
    else:  # dapo, cispo
        n = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=logps.dtype)
        loss = masked.sum() / n.clamp(min=1.0)

    # Metrics, as TRL logs them (one process): token means over the mask, or over sequences when (B, 1).
    def masked_mean(x: Tensor) -> float:
        if x.shape[1] == 1:
            return (x.sum() / max(x.shape[0], 1)).item()
        return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

    def seq_means(x: Tensor) -> Tensor:  # (B,), NaN for an empty sequence
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def nan_extreme(x: Tensor, fn: Callable[[Tensor], Tensor]) -> float:  # trl.trainer.utils.nanmin / nanmax
        x = x[~torch.isnan(x)]
        return fn(x).item() if x.numel() else math.nan

    metrics: dict[str, float] = {"loss": loss.item()}
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > eps_high) & (adv > 0)).float())
    else:
        low = (coef_1 < 1 - eps_low) & (adv < 0)
        high = (coef_1 > 1 + eps_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = masked_mean(low.float())
        metrics["clip_ratio/high_mean"] = masked_mean(high.float())
        metrics["clip_ratio/region_mean"] = masked_mean((low | high).float())
        metrics["clip_ratio/low_min"] = nan_extreme(seq_means(low.float()), torch.min)
        metrics["clip_ratio/high_max"] = nan_extreme(seq_means(high.float()), torch.max)
    if is_ratio is not None:
        flat = is_ratio.flatten() if is_ratio.shape[1] == 1 else is_ratio[mask.bool()]
        for name, fn in (("min", torch.min), ("mean", torch.mean), ("max", torch.max)):
            metrics[f"sampling/importance_sampling_ratio/{name}"] = fn(flat).item() if flat.numel() else 0.0
    if clamped is not None:
        metrics["log_ratio/clamped"] = masked_mean(clamped.float())
    return loss, metrics


def token_weights(logps_detached: Tensor, loss_fn: Callable[[Tensor], Tensor | tuple[Tensor, dict]]) -> Tensor:
    """w = d loss / d logp for every token, same shape as logps_detached.

    loss_fn may return a loss or (loss, metrics) such as `grpo_loss`. Back-propagating (w * logp).sum() through
    the model then gives exactly the gradient of loss_fn(logp) (chain rule), without running the loss there.
    """
    leaf = logps_detached.detach().clone().requires_grad_(True)
    out = loss_fn(leaf)
    loss = out[0] if isinstance(out, tuple) else out
    (w,) = torch.autograd.grad(loss, leaf, materialize_grads=True)
    return w
