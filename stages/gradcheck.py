"""Gradient equivalence on a saved trajectory, and the BF16-LoRA precision finding (BF16 LoRA weights lose small updates).

* ``pipeline_gradients``: the production path in a given base dtype: replay scores every micro-batch in its planned
  tier (graph kept, activation checkpointing, or two-pass), the driver evaluates the loss on the detached log-probs (w = d loss / d logp) and the engine
  back-propagates Σ w·logp micro-batch by micro-batch, into FP32-master adapter weights (``stages.optimize``).
* ``reference_gradients``: one full batch, every weight and activation in FP32, direct autograd of the
  same TRL loss (thought terms scaled by ``thought_loss_weight`` through a straight-through product).
* ``compare``: relative L2 over all adapter tensors, and per tensor (gate: ≤ 0.002 each, seed threshold).
* ``unchanged_share``: one AdamW step at a small learning rate with the adapter in BF16 vs FP32 masters: the share
  of ``lora_A`` elements that do not change at all.
"""

from __future__ import annotations

import copy

import torch

from engine import model as M
from engine.replay import packer_for, plan_replay, to_sequences
from stages.optimize import LossInputs, accumulate_gradients, driver_weights

REL_L2_MAX = 0.002  # the gradient-equivalence gate (docs/architecture.md); never moved
NEGLIGIBLE = 1e-6  # a tensor whose reference norm is below this share of the total is compared in absolute terms


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}


def _zero(model) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def pipeline_gradients(cfg, engine, li: LossInputs, costs=None, budget: float | None = None
                       ) -> dict[str, torch.Tensor]:
    """Replay + driver weights + micro-batched backward, as a fresh step runs them, following the replay plan of
    ``cfg.replay`` (tiers keep / checkpoint / two-pass; ``costs``/``budget`` as the preflight would see them)."""
    li = copy.copy(li)
    _zero(engine.model)
    live, lp_turn = [], [None] * len(li.rows)
    plan = plan_replay(li.turns.lengths(), cfg.replay, costs, 0.0, budget, packer=packer_for(li.turns, cfg.replay, engine.model))
    for idx, tier in zip(plan.microbatches, plan.tiers):
        with torch.set_grad_enabled(tier != "two_pass"):
            a, q = engine.score(li.turns, idx, cfg.sampler.temperature, li.sigma, tier, cfg.replay)
        live.append((idx, a, q) if tier != "two_pass" else None)
        for n, i in enumerate(idx):
            lp_turn[i] = torch.cat([q[n].detach().float(), a[n].detach().float()])
    li.lp_turn = lp_turn
    li.old_lp = to_sequences(li.rows, lp_turn, li.n_rows)[0]  # a fresh step: the old policy is this replay
    w_thought, w_answer = driver_weights(cfg, li, {})
    accumulate_gradients(cfg, engine, li, w_thought, w_answer, live=live, plan=(plan.microbatches, plan.tiers))
    return adapter_grads(engine.model)


def reference_gradients(cfg, engine, li: LossInputs) -> dict[str, torch.Tensor]:
    """All turns in one batch, direct autograd of the loss (no micro-batches, no driver weights)."""
    _zero(engine.model)
    c = cfg.grpo.thought_loss_weight
    with torch.enable_grad():
        a, q = engine.score(li.turns, list(range(len(li.rows))), cfg.sampler.temperature, li.sigma)
        per_turn = []
        for n in range(len(li.rows)):
            thought = c * q[n] + (1 - c) * q[n].detach()  # value unchanged, gradient scaled by c
            per_turn.append(torch.cat([thought, a[n]]))
        lp, _ = to_sequences(li.rows, per_turn, li.n_rows)
        dtype = lp.dtype
        li2 = copy.copy(li)
        # a fresh step: the old policy is the current one (its own values, detached), as on the pipeline path
        li2.old_lp, li2.mask, li2.adv = lp.detach(), li.mask.to(dtype), li.adv.to(dtype)
        li2.is_ratio = None if li.is_ratio is None else li.is_ratio.to(dtype)
        li2.loss(cfg, lp).backward()
    return adapter_grads(engine.model)


def compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Relative L2 over all tensors and per tensor; tensors outside ``REL_L2_MAX`` are listed."""
    num = sum(float((grads[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    total = den ** 0.5
    outside, worst = [], 0.0
    for k in ref:
        err = float((grads[k] - ref[k]).norm())
        norm = float(ref[k].norm())
        rel = err / norm if norm > NEGLIGIBLE * total else err / max(total, 1e-30)
        worst = max(worst, rel)
        if rel > REL_L2_MAX:
            outside.append({"tensor": k, "rel_l2": rel})
    rel_total = (num ** 0.5) / max(total, 1e-30)
    return {"rel_l2": rel_total, "tensors": len(ref), "tensors_outside": len(outside), "worst_tensor_rel_l2": worst,
            "outside": sorted(outside, key=lambda x: -x["rel_l2"])[:5],
            "passed": rel_total <= REL_L2_MAX and not outside}


def unchanged_share(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float,
                    dtype: torch.dtype) -> dict:
    """One AdamW step (lr, no weight decay) on copies of the adapter held in ``dtype``; the share of lora_A
    (and all) elements whose value did not change."""
    names = sorted(params)
    ps = [torch.nn.Parameter(params[n].detach().to(dtype).clone()) for n in names]
    for p, n in zip(ps, names):
        p.grad = grads[n].to(dtype)
    before = [p.detach().clone() for p in ps]
    torch.optim.AdamW(ps, lr=lr, weight_decay=0.0).step()
    same = {n: (p.detach() == b) for n, p, b in zip(names, ps, before)}
    a_names = [n for n in names if "lora_A" in n]
    a_same = sum(int(same[n].sum()) for n in a_names)
    a_all = sum(same[n].numel() for n in a_names)
    has_grad = sum(int((grads[n] != 0).sum()) for n in a_names)
    return {"dtype": str(dtype).replace("torch.", ""), "lr": lr, "lora_A_elements": a_all,
            "lora_A_with_gradient": has_grad, "lora_A_unchanged_share": a_same / max(a_all, 1),
            "all_unchanged_share": sum(int(v.sum()) for v in same.values()) / sum(v.numel() for v in same.values())}
