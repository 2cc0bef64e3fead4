"""collect-rollouts: one record per (rollout, turn) with the rollout's reward and group-relative advantage
(rollouts.arrow), after every stored episode trace verifies (the provenance gate); the episode metrics of a step.
"""

from __future__ import annotations

from artifacts import RunDir, read_table
from artifacts.tables import table_meta, write_rollouts
from gyms.trace import TraceError, verify_trace
from stages.context import run_config, timer


def episode_stats(final: list[dict]) -> dict:
    """Episode-level metrics of a finished row state: completion, tokens, tool-result share, end reasons."""
    n = max(len(final), 1)
    model = sum(int(r["model_tokens"]) for r in final)
    tool = sum(int(r["tool_tokens"]) for r in final)
    reasons: dict[str, int] = {}
    for r in final:
        reasons[r["reason"] or "unfinished"] = reasons.get(r["reason"] or "unfinished", 0) + 1
    return {
        "completion_rate": sum(r["reason"] == "answer" for r in final) / n,
        # share of episodes that ended with a correct final answer (tables written before the column: False)
        "success_rate": sum(bool(r.get("success", False)) for r in final) / n,
        "mean_tokens": (model + tool) / n,
        "tool_token_share": tool / max(model + tool, 1),
        "end_reasons": reasons,
        "transport_retries": sum(int(r.get("transport_retries", 0)) for r in final),
    }


def verify_traces(final: list[dict]) -> int:
    """Verify the stored sealed trace of every finished episode that has one; returns how many were checked.

    A trace that fails verification means the stored provenance was changed: the ``provenance`` gate fails."""
    from engine.gates import GateFailed

    checked = 0
    for r in final:
        if r["trace"]:
            try:
                verify_trace(r["trace"], episode=r["episode"])
            except (TraceError, OSError) as exc:
                raise GateFailed("provenance", f"row {r['row']}: {exc}", {"row": r["row"], "trace": r["trace"]}) from exc
            checked += 1
    return checked


def collect_rollouts(run_dir: str, step: int, turn_ins: list[str], gym_ins: list[str],
                     out_path: str | None = None) -> dict:
    """One record per (rollout, turn) with the rollout's reward and group-relative advantage (rollouts.arrow)."""
    import torch

    from engine.loss import group_advantages, scale_negative_advantages

    cfg = run_config(run_dir)
    out = {"stage": "collect-rollouts"}
    with timer(out):
        final = read_table(gym_ins[-1]).to_pylist()
        rewards = torch.tensor([r["reward"] for r in final], dtype=torch.float32)
        groups = [r["group"] for r in final]
        G = cfg.grpo.num_generations
        if any(groups[i] != groups[i - i % G] for i in range(len(groups))):
            raise ValueError(f"rows are not laid out in groups of num_generations={G}")
        adv = scale_negative_advantages(group_advantages(rewards, G, cfg.grpo.scale_rewards),
                                        cfg.grpo.negative_advantage_scale)
        recs = []
        tool_errors = 0
        for t, (tin, gin) in enumerate(zip(turn_ins, gym_ins)):
            errs = {r["row"]: r["tool_error"] for r in read_table(gin).to_pylist()}
            for r in read_table(tin).to_pylist():
                tool_errors += int(errs[r["row"]])
                recs.append((r["row"], t, r))
        recs.sort(key=lambda x: (x[0], x[1]))
        meta = table_meta(turn_ins[0])  # K, d and sigma are the same in every turn file
        K, d = int(meta["K"]), int(meta["d"])
        traces = verify_traces(final)
        path = out_path or str(RunDir(run_dir).rollouts(step))
        write_rollouts(path, [{**x, "row": r, "group": groups[r], "turn": t, "reward": float(rewards[r]),
                               "advantage": float(adv[r])} for r, t, x in recs],
                       step=step, K=K, d=d, rows=len(final), num_generations=G, sigma=meta["sigma"])
        n = len(final)
        out.update(
            path=path, rollouts=n, turns=len(recs),
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if n > 1 else 0.0,
            tool_error_rate=tool_errors / max(len(recs), 1),
            mean_turns=len(recs) / n,
            answer_tokens=sum(len(x["answer_ids"]) for _, _, x in recs),
            traces_verified=traces,
            **episode_stats(final),
        )
    return out
