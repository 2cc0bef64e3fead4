"""replay: re-score every stored turn under the step's input adapter (saved thoughts are inputs).

Writes replay.arrow (per turn: trainer answer log-probs, thought log-densities, loss mask). On a fresh step it also
runs the rollout parity gate (trainer vs sampler, same adapter): the report goes to parity.json and is appended
to parity_history.jsonl; rare tokens above the per-token limit are masked out of the loss; a mean above its
limit raises GateFailed. A reuse step appends the same measurement ungated (policy drift since sampling).

Memory: the plan (engine.replay.plan_for: micro-batches, a tier per micro-batch, the preflight) is made before any
scoring and refuses, naming the setting, a replay that cannot fit. Graphs of the keep and checkpoint tiers stay with
the engine for `optimize` (same process); two-pass micro-batches keep none. The summary carries the plan and, on a
GPU, the peak memory the stage reached.
"""

from __future__ import annotations

import torch

from artifacts import RunDir, append_jsonl, read_table, to_tensor_list, verify, write_json
from artifacts.tables import table_meta, write_replay
from engine import gates
from engine.replay import Turns, plan_for
from stages import faults
from stages.context import run_config, timer


def load_turns(rollouts_in: str) -> tuple[Turns, object]:
    t = read_table(rollouts_in)
    turns = Turns(
        prefixes=t.column("prefix_ids").to_pylist(),
        thoughts=to_tensor_list(t, "thoughts", torch.float32),
        answers=t.column("answer_ids").to_pylist(),
        rows=t.column("row").to_pylist(),
    )
    return turns, t


def live_key(rollouts_in: str, adapter_digest: str) -> tuple[str, str]:
    return (verify(rollouts_in), adapter_digest)


def replay(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, fresh: bool,
           keep_graph: bool = True) -> dict:
    from engine import runtime

    cfg = run_config(run_dir)
    runtime.set_threads(cfg.threads)
    rd = RunDir(run_dir)
    out = {"stage": "replay", "fresh": fresh}
    with timer(out):
        turns, table = load_turns(rollouts_in)
        sigma = float(table_meta(table)["sigma"])
        engine = runtime.trainer(cfg, base_in, base_in)
        engine.use_adapter(adapter_in)
        engine.live.clear()
        plan = plan_for(engine, turns, cfg.replay, cfg.sampler.temperature, sigma)  # raises before any scoring
        mbs = plan.microbatches
        ans_lp: list = [None] * len(turns.rows)
        logq: list = [None] * len(turns.rows)
        live = []
        for idx, tier in zip(mbs, plan.tiers):
            # two-pass micro-batches keep no graph: optimize re-forwards them (and checks them bit for bit)
            with torch.set_grad_enabled(keep_graph and tier != "two_pass"):
                a, q = engine.score(turns, idx, cfg.sampler.temperature, sigma, tier, cfg.replay)
            live.append((idx, a, q) if keep_graph and tier != "two_pass" else None)
            faults.maybe_kill("replay", step)
            for j, i in enumerate(idx):
                ans_lp[i] = a[j].detach().cpu()
                logq[i] = q[j].detach().cpu()
            del a, q
        trainer_lp = [x.tolist() for x in ans_lp]
        sampler_lp = table.column("sampler_logps").to_pylist()
        if fresh:
            report, keep = gates.rollout_parity(
                trainer_lp, sampler_lp, mean_max=cfg.gates.parity_mean_max,
                token_max=cfg.gates.parity_token_max, min_prob=cfg.gates.parity_min_prob)
            report.update(step=step, kind="fresh", gated=True)
            write_json(rd.parity(step), report)
            append_jsonl(rd.parity_history(), report | {"masked": len(report["masked_tokens"])}, replace="step")
            gates.check_parity(report)
            out.update(parity_mean=report["mean_gap"], parity_max=report["max_gap"], masked=len(report["masked_tokens"]))
        else:
            # a reuse step replays rollouts sampled under an older adapter: the same numbers measure how far the
            # policy moved since (the importance ratio's job), so they are recorded but not gated
            report, _ = gates.rollout_parity(
                trainer_lp, sampler_lp, mean_max=cfg.gates.parity_mean_max,
                token_max=cfg.gates.parity_token_max, min_prob=cfg.gates.parity_min_prob)
            report.update(step=step, kind="reuse", gated=False, passed=None)
            write_json(rd.parity(step), report)
            append_jsonl(rd.parity_history(), report | {"masked": len(report["masked_tokens"])}, replace="step")
            out.update(drift_mean=report["mean_gap"], drift_max=report["max_gap"])
            keep = [[True] * len(x) for x in trainer_lp]
        path = str(rd.replay(step))
        write_replay(path, turns.rows, [x.numpy() for x in ans_lp], [x.numpy() for x in logq], keep, step=step,
                     fresh=fresh, adapter=engine.adapter_digest, plan={"microbatches": mbs, "tiers": plan.tiers})
        if keep_graph:
            engine.live[live_key(rollouts_in, engine.adapter_digest)] = live
        out.update(path=path, turns=len(turns.rows), microbatches=len(mbs), tokens=sum(turns.lengths()),
                   plan=plan.summary())
    return out
