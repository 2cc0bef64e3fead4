"""Correctness gates: pure functions over per-token numbers. Thresholds come from the config and never move.

This module imports no torch at module level (flows import `GateFailed` to decide on retries).
"""

from __future__ import annotations

import math


class GateFailed(RuntimeError):
    """A correctness gate failed. Never retried: the task ends Failed and the report is kept."""

    def __init__(self, gate: str, message: str, report: dict | None = None):
        super().__init__(f"gate `{gate}` failed: {message}")
        self.gate = gate
        self.report = report or {}


def rollout_parity(trainer_lp: list[list[float]], sampler_lp: list[list[float]], *, mean_max: float,
                   token_max: float, min_prob: float) -> tuple[dict, list[list[bool]]]:
    """Trainer vs sampler log-prob of every real answer token.

    Over tokens that either engine gives at least `min_prob` probability: mean |gap| must be <= mean_max; a token
    whose gap exceeds `token_max` is masked out of the loss and recorded. Tokens under `min_prob` in both engines are
    left out of both and counted (`tokens_below_min_prob`). Returns (report, keep-mask per turn).
    The report also carries the peers' mismatch metrics: k3 KL (sampler -> trainer), importance ratio
    min/mean/max (exp(trainer - sampler)) and the share of masked tokens.
    """
    gaps, masked, keep, considered_tokens = [], [], [], []
    k3, ratios = [], []
    n_all = 0
    for i, (tl, sl) in enumerate(zip(trainer_lp, sampler_lp)):
        if len(tl) != len(sl):
            raise ValueError(f"turn {i}: trainer scored {len(tl)} tokens, sampler {len(sl)}")
        row_keep = []
        for j, (t, s) in enumerate(zip(tl, sl)):
            n_all += 1
            r = t - s
            ratios.append(math.exp(max(min(r, 50.0), -50.0)))
            k3.append(math.exp(max(min(r, 50.0), -50.0)) - r - 1.0)
            considered = max(math.exp(t), math.exp(s)) >= min_prob
            gap = abs(r)
            ok = True
            if considered:
                gaps.append(gap)
                considered_tokens.append((gap, i, j, t, s))
                if gap > token_max:
                    ok = False
                    masked.append({"turn": i, "token": j, "trainer": t, "sampler": s, "gap": gap})
            row_keep.append(ok)
        keep.append(row_keep)
    report = {
        "tokens": n_all,
        "tokens_considered": len(gaps),
        # left out of the mean and of the per-token mask: under min_prob in both engines (their log-probs are large,
        # noisy numbers that say nothing about whether both engines score the same model)
        "tokens_below_min_prob": n_all - len(gaps),
        "mean_gap": sum(gaps) / len(gaps) if gaps else 0.0,
        "max_gap": max(gaps) if gaps else 0.0,
        "masked_tokens": masked,
        "masked_share": len(masked) / n_all if n_all else 0.0,
        "k3_kl": sum(k3) / len(k3) if k3 else 0.0,
        "is_ratio_min": min(ratios) if ratios else 1.0,
        "is_ratio_mean": sum(ratios) / len(ratios) if ratios else 1.0,
        "is_ratio_max": max(ratios) if ratios else 1.0,
        "limits": {"mean_max": mean_max, "token_max": token_max, "min_prob": min_prob},
        "worst_tokens": [{"turn": i, "token": j, "trainer": t, "sampler": s, "gap": g}
                         for g, i, j, t, s in sorted(considered_tokens, key=lambda x: (-x[0], x[1], x[2]))[:8]],
    }
    report["passed"] = report["mean_gap"] <= mean_max
    return report, keep


def check_thought_gap(gap: float, limit: float, step: int) -> None:
    """The thought density gap (max |recorded - replayed| log q over a step's thoughts, same adapter): generation and
    replay must compute the same thought means. Healthy BF16 steps stay a few nats (rounding flips); a different
    adapter, scale or thought position between the two layouts gives hundreds to thousands."""
    if gap > limit:
        raise GateFailed(
            "thought-density",
            f"step {step}: a recorded thought log-density differs from replay's by {gap:.3f} nat > {limit} "
            "(gates.thought_logq_gap_max): the latent loop and replay did not compute the same thought means -- "
            "check that generation used the step's input adapter, the same sigma and embedding scale, and that "
            "replay reads mu at the thought positions",
            {"step": step, "thought_logq_gap_max": gap, "limit": limit},
        )


def check_finite_weights(step: int, w_thought: list, w_answer: list, log_ratio, max_log_ratio) -> None:
    """Before any backward: the loss's per-term weights w = d loss / d logp must be finite. Per turn, w_thought and
    w_answer are the weights; log_ratio() gives the new-minus-old log-probs per turn (thoughts then answer) and is
    called only when a weight is not finite. A term more than log(FLT_MAX) = 88.7 nat above its old value overflows
    exp in FP32 and turns the whole gradient NaN; the report names where."""
    import math

    import torch

    w = [torch.cat([q, a]) for q, a in zip(w_thought, w_answer)]
    if all(bool(torch.isfinite(x).all()) for x in w):
        return
    bad = []
    for i, (x, lr) in enumerate(zip(w, log_ratio())):
        K = len(w_thought[i])
        for j in (~torch.isfinite(x)).nonzero()[:, 0].tolist():
            bad.append({"turn": i, "kind": "thought" if j < K else "answer", "term": j if j < K else j - K,
                        "log_ratio": float(lr[j])})
    worst = max(bad, key=lambda b: abs(b["log_ratio"]) if math.isfinite(b["log_ratio"]) else math.inf)
    kinds = {k: sum(b["kind"] == k for b in bad) for k in ("thought", "answer")}
    overflow = math.isfinite(worst["log_ratio"]) and abs(worst["log_ratio"]) > math.log(torch.finfo(torch.float32).max)
    cause = (f"log(pi/pi_old) reaches {worst['log_ratio']:.1f} nat ({worst['kind']} term {worst['term']} of turn "
             f"{worst['turn']}): exp overflows FP32 beyond 88.7 nat and TRL's clipped objective then back-propagates "
             "inf * 0. Set grpo.max_log_ratio (20 is verl's clamp; clamped terms get zero gradient) or use "
             "grpo.loss_type: cispo (detached ratio)" if overflow and max_log_ratio is None else
             "the stored log-probs or advantages are not finite -- run the failure diagnostic on this step's replay")
    raise GateFailed("finite-gradients",
                     f"step {step}: {len(bad)} loss weights are not finite ({kinds['thought']} thought terms, "
                     f"{kinds['answer']} answer tokens), so the gradient would be NaN; {cause}",
                     {"step": step, "nonfinite_weights": len(bad), "by_kind": kinds, "worst": worst,
                      "max_log_ratio": max_log_ratio})


def check_parity(report: dict) -> None:
    if not report["passed"]:
        raise GateFailed(
            "rollout-parity",
            f"mean trainer-vs-sampler gap {report['mean_gap']:.4f} nat > {report['limits']['mean_max']} over "
            f"{report['tokens_considered']} tokens (max {report['max_gap']:.3f}); the sampler is not scoring the "
            "model being trained — check the adapter sync and the sampler's precision path",
            report,
        )
