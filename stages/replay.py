"""replay: re-score every stored turn under the step's input adapter (saved thoughts are inputs).

Writes replay.arrow (per turn: trainer answer log-probs, thought log-densities, loss mask). On a fresh step it also
runs the rollout parity gate (trainer vs sampler, same adapter): the report goes to parity.json and is appended
to parity_history.jsonl; rare tokens above the per-token limit are masked out of the loss; a mean above its
limit raises GateFailed. A reuse step appends the same measurement ungated (policy drift since sampling).

Memory: the plan (engine.replay.plan_for: micro-batches, a tier per micro-batch, the preflight) is made before any
scoring and refuses, naming the setting, a replay that cannot fit. Graphs of the keep and checkpoint tiers stay with
the engine for `optimize` (same process); two-pass micro-batches keep none. A one-pass plan (replay.one_pass)
back-propagates each micro-batch here, right after its forward, with the loss weights the driver will compute
(stages.optimize.PredictedWeights), so optimize only checks those weights and updates. The summary carries the plan
and, on a GPU, the peak memory the stage reached.
"""

from __future__ import annotations

import torch

from artifacts import RunDir, append_jsonl, read_table, to_tensor_list, verify, write_json
from artifacts.tables import table_meta, write_replay
from engine import gates
from engine.replay import GiB, LiveGraphs, OnePass, ReplayMemoryError, Turns, plan_for
from stages import faults
from stages.context import run_config, timer


def load_turns(rollouts_in: str) -> tuple[Turns, object]:
    t = read_table(rollouts_in)
    return turns_of(t), t


def turns_of(t) -> Turns:
    """The stored turns of a rollouts table."""
    return Turns(
        prefixes=t.column("prefix_ids").to_pylist(),
        thoughts=to_tensor_list(t, "thoughts", torch.float32),
        answers=t.column("answer_ids").to_pylist(),
        rows=t.column("row").to_pylist(),
    )


def live_key(rollouts_in: str, adapter_digest: str) -> tuple[str, str]:
    return (verify(rollouts_in), adapter_digest)


def one_pass_wanted(cfg, fresh: bool, old_replay_in: str | None) -> bool:
    """replay.one_pass, where replay can compute the weights: a reuse step's need the old policy's replay."""
    return cfg.replay.one_pass and (fresh or old_replay_in is not None)


def _scored(cfg, step: int, rollouts_in: str, adapter_in: str, base_in: str, keep_graph: bool,
            turn_ids: list[int] | None = None, fresh: bool = True, old_replay_in: str | None = None,
            one_pass: bool = False):
    """The trainer engine under `adapter_in` scores `turn_ids` (default: every turn) of the stored rollouts, micro-batch
    by micro-batch as planned. Returns (engine, turns, rollouts table, {turn: answer lp}, {turn: thought logq}, live
    graphs per micro-batch, global micro-batches, tiers, the plan's summary, graphs per micro-batch or None).

    one_pass (with keep_graph, every turn): each micro-batch is back-propagated right after its forward with the
    weights PredictedWeights gives (into fresh zeroed .grad tensors), and its graph freed."""
    from engine import runtime

    runtime.set_threads(cfg.threads)
    turns, table = load_turns(rollouts_in)
    sigma = float(table_meta(table)["sigma"])
    engine = runtime.trainer(cfg, base_in, base_in)
    engine.use_adapter(adapter_in)
    engine.live.clear()
    runtime.release_prefix_caches()  # generation is over for this adapter: replay plans with that memory
    ids = list(range(len(turns.rows))) if turn_ids is None else list(turn_ids)
    sub = Turns(prefixes=[turns.prefixes[i] for i in ids], thoughts=[turns.thoughts[i] for i in ids],
                answers=[turns.answers[i] for i in ids], rows=[turns.rows[i] for i in ids])
    one_pass = one_pass and keep_graph and turn_ids is None
    try:
        plan = plan_for(engine, sub, cfg.replay, cfg.sampler.temperature, sigma, one_pass)  # raises before scoring
    except ReplayMemoryError as exc:
        held = runtime.other_models_bytes(engine) if cfg.sampler.kind == "hf" else 0
        if not held:
            raise
        raise ReplayMemoryError(
            f"{exc}. Of the memory resident, {held / GiB:.1f} GiB is the hf sampler's own copy of the base "
            "(sampler.weights: export): --set sampler.weights=trainer makes the sampler generate on the trainer's "
            "model instead (one copy of the base; the 27B step on one 80 GB GPU runs so)") from exc
    mbs = [[ids[j] for j in mb] for mb in plan.microbatches]
    graphs = plan.graphs or [None] * len(mbs)
    ans_lp, logq, live = {}, {}, LiveGraphs()
    if one_pass:
        from stages.optimize import PredictedWeights, _adapter_params, backward_microbatch

        predict = PredictedWeights(cfg, turns, table, fresh, old_replay_in)
        params = _adapter_params(engine.model)
        for _, p in params:
            p.grad = torch.zeros_like(p)
    for idx, tier, graph in zip(mbs, plan.tiers, graphs):
        # two-pass micro-batches keep no graph: optimize re-forwards them (and checks them bit for bit)
        with torch.set_grad_enabled(keep_graph and tier != "two_pass"):
            a, q = engine.score(turns, idx, cfg.sampler.temperature, sigma, tier, cfg.replay, graph or "keep")
        for j, i in enumerate(idx):
            ans_lp[i] = a[j].detach().cpu()
            logq[i] = q[j].detach().cpu()
        if tier == "one_pass":
            w_thought, w_answer = predict(ans_lp, logq, idx)
            wt, wa = dict(zip(idx, w_thought)), dict(zip(idx, w_answer))
            backward_microbatch(idx, a, q, wt, wa)
            live.append(OnePass(idx, w_thought, w_answer))
        else:
            live.append((idx, a, q) if keep_graph and tier != "two_pass" else None)
        faults.maybe_kill("replay", step)
        del a, q
    if one_pass:
        live.grads = [(p.grad, p.grad._version) for _, p in params]
    return engine, turns, table, ans_lp, logq, live, mbs, list(plan.tiers), plan.summary(), plan.graphs


@faults.kill_window("replay")
def replay(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, fresh: bool,
           keep_graph: bool = True, old_replay_in: str | None = None) -> dict:
    """old_replay_in: a reuse step's old-policy replay (the fresh step's), which a one-pass replay's weights need."""
    cfg = run_config(run_dir)
    out = {"stage": "replay", "fresh": fresh}
    with timer(out):
        one_pass = keep_graph and one_pass_wanted(cfg, fresh, old_replay_in)
        engine, turns, table, ans, lq, live, mbs, tiers, summary, graphs = _scored(
            cfg, step, rollouts_in, adapter_in, base_in, keep_graph, None, fresh, old_replay_in, one_pass)
        n = len(turns.rows)
        stored = {"microbatches": mbs, "tiers": tiers, **({"graphs": graphs} if graphs else {})}
        _finish(cfg, run_dir, step, turns, table, [ans[i] for i in range(n)], [lq[i] for i in range(n)], fresh,
                engine.adapter_digest, stored, out)
        if keep_graph:
            engine.live[live_key(rollouts_in, engine.adapter_digest)] = live
        out.update(microbatches=len(mbs), plan=summary)
    return out


def split_turns(lengths: list[int], workers: int, units: list[tuple[list[int], int]] | None = None
                ) -> dict[int, list[int]]:
    """Turns per worker, balanced by token count (longest first onto the least loaded worker; ties by index).

    units: (turn ids, tokens) that stay on one worker (replay.share_prefix: a group's turns share its prompt only
    where they are scored together), placed the same way by their token counts; default: every turn alone."""
    if units is None:
        units = [([i], n) for i, n in enumerate(lengths)]
    load = [0] * workers
    out: dict[int, list[int]] = {w: [] for w in range(workers)}
    for ids, n in sorted(units, key=lambda u: (-u[1], u[0][0])):
        w = min(range(workers), key=lambda w: (load[w], w))
        out[w].extend(ids)
        load[w] += n
    return {w: sorted(ids) for w, ids in out.items()}


def shared_units(turns: Turns) -> list[tuple[list[int], int]]:
    """split_turns' units for replay.share_prefix: the trees of shared prefixes (engine.shared_replay.units) and the
    tokens each forwards."""
    from engine.shared_replay import footprint, units

    t = (turns.prefixes, turns.thoughts, turns.answers, turns.rows)
    return [(ids, footprint(*t, ids)[0]) for ids in units(turns.prefixes, turns.rows)]


def replay_shard(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, turn_ids: list[int],
                 out_path: str, keep_graph: bool = True) -> dict:
    """A pool worker's share of replay (engine/pool.py): its turns scored as planned for its device, the graphs kept
    in this worker for its part of optimize, the values written to `out_path` (gather_replay joins the shards)."""
    import json

    from artifacts import write_tensors

    cfg = run_config(run_dir)
    out = {"stage": "replay"}
    with timer(out):
        engine, turns, _, ans, lq, live, mbs, tiers, summary, _ = _scored(cfg, step, rollouts_in, adapter_in, base_in,
                                                                         keep_graph, turn_ids)
        tensors = {**{f"a.{i}": ans[i] for i in turn_ids}, **{f"q.{i}": lq[i] for i in turn_ids}}
        write_tensors(out_path, tensors, {"turns": json.dumps(list(turn_ids)), "adapter": engine.adapter_digest,
                                          "plan": json.dumps({"microbatches": mbs, "tiers": tiers})})
        if keep_graph:
            engine.live[live_key(rollouts_in, engine.adapter_digest)] = live
        out.update(path=out_path, turns=len(turn_ids), microbatches=len(mbs), tokens=sum(turns.lengths()[i] for i in turn_ids),
                   plan=summary)
    return out


def gather_replay(run_dir: str, step: int, rollouts_in: str, shards: list[str], workers: list[int], fresh: bool) -> dict:
    """replay.arrow from the workers' shards (every turn exactly once), with the parity gate and report as replay
    writes them; the plan records each micro-batch's worker, so optimize back-propagates where the graph lives."""
    import json

    from artifacts import read_tensors

    cfg = run_config(run_dir)
    out = {"stage": "replay", "fresh": fresh}
    with timer(out):
        turns, table = load_turns(rollouts_in)
        n = len(turns.rows)
        ans, lq, mbs, tiers, owners, adapters = {}, {}, [], [], [], set()
        for w, path in zip(workers, shards):
            tensors, meta = read_tensors(path)
            for i in json.loads(meta["turns"]):
                if i in ans:
                    raise ValueError(f"turn {i} was replayed by two workers ({path})")
                ans[i], lq[i] = tensors[f"a.{i}"], tensors[f"q.{i}"]
            plan = json.loads(meta["plan"])
            mbs += plan["microbatches"]
            tiers += plan["tiers"]
            owners += [w] * len(plan["microbatches"])
            adapters.add(meta["adapter"])
        missing = sorted(set(range(n)) - set(ans))
        if missing or len(adapters) != 1:
            raise ValueError(f"replay shards: turns {missing[:10]} missing, adapters {sorted(adapters)}")
        _finish(cfg, run_dir, step, turns, table, [ans[i] for i in range(n)], [lq[i] for i in range(n)], fresh,
                adapters.pop(), {"microbatches": mbs, "tiers": tiers, "workers": owners}, out)
        out.update(microbatches=len(mbs), workers=len(shards))
    return out


def _finish(cfg, run_dir: str, step: int, turns: Turns, table, ans_lp: list, logq: list, fresh: bool, adapter: str,
            plan: dict, out: dict) -> None:
    """The parity gate (fresh step) or the drift record (reuse step), then replay.arrow."""
    rd = RunDir(run_dir)
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
                 fresh=fresh, adapter=adapter, plan=plan)
    out.update(path=path, turns=len(turns.rows), tokens=sum(turns.lengths()))
