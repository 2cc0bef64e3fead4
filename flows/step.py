"""One GRPO step as a Prefect flow: export -> [sample-tasks -> (generate-turn -> run-gym)* -> collect-rollouts]
-> replay -> optimize.  A reuse step skips generation and replays the latest fresh step's rollouts.

Re-running a step's flow skips completed stages (Cached) and runs the failed one and what follows;
`force_from=<stage>` re-runs from a named stage. Each step publishes its per-phase timing table and metrics as
Prefect artifacts (keys `step-NNNN-timings`, `step-NNNN-metrics`, `step-NNNN-parity`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from artifacts import RunDir, append_jsonl, curves, read_json, read_table, write_json
from artifacts import metrics as step_metrics
from flows import tasks as T
from stages.context import run_config
from stages.generate import place_groups

STAGES = ["export", "sample-tasks", "generate-turn", "run-gym", "collect-rollouts", "replay", "optimize", "probe"]
Stage = Literal["export", "sample-tasks", "generate-turn", "run-gym", "collect-rollouts", "replay", "optimize", "probe"]


@contextmanager
def step_flows():
    """The `grpo-step` flow as the train and rerun flows run it, for all of a run's steps (one context: building
    settings costs ~0.1 s): without a heartbeat thread of its own, and with one async API client for all of them
    (shared_async_client). The run's top flow keeps Prefect's heartbeat (crash detection); a step
    flow's own thread sleeps in 1-s slices and Prefect joins it when the flow ends, which cost up to a second of
    every step (bench/trl_compare.py measures what is left)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), shared_async_client():
        yield grpo_step


@contextmanager
def shared_async_client():
    """One async Prefect client for every step flow started inside (each is a subflow of the run's top flow).

    Prefect records a subflow in its parent through a tracking task run that `Task.create_run` creates with
    `get_client()`; outside an `AsyncClientContext` that builds a new client each time, and a new client builds a TLS
    context from certifi's CA bundle (~20 ms here, for a plain-HTTP local server too) and opens a new connection:
    about a tenth of a small step (bench/trl_compare.py). Here the client is started once on Prefect's run-sync loop
    (where that coroutine runs) and published through `AsyncClientContext` in this thread; Prefect's calls copy this
    thread's context, so `get_client()` finds it. Closed at the end; a no-op inside an existing context."""
    from prefect.context import AsyncClientContext
    from prefect.utilities.asyncutils import run_coro_as_sync

    if AsyncClientContext.get() is not None:
        yield
        return
    ctx = AsyncClientContext()  # the client, not started yet
    run_coro_as_sync(ctx.client.__aenter__())
    try:
        with ctx:  # the context variable, set in this thread
            yield
    finally:
        run_coro_as_sync(ctx.client.__aexit__(None, None, None))


def probe_due(cfg, step: int) -> bool:
    """The teacher-forced probe runs every `gates.probe_every` steps and after the last step."""
    return (step + 1) % cfg.gates.probe_every == 0 or step == cfg.steps.total - 1


OUTPUT_KEYS = ("path", "adapter", "optimizer")  # where a stage's summary names the artifacts it wrote


def _run(task, stage: str, force_from: str | None, *args) -> dict:
    """Run a stage task; its summary says whether Prefect returned it from the cache (it then cost no time).

    A cached summary whose artifacts are gone from the run directory (deleted by hand, a copied or restored run
    directory) or no longer verify against their checksums (a flipped byte on disk) is not trusted: the stage runs
    again, with a warning naming the file, instead of the next stage failing on a missing or corrupted input."""
    state = _refresh(task, stage, force_from)(*args, return_state=True)
    result = state.result()  # re-raises a failed task's error
    if state.name == "Cached" and _untrusted(stage, result):
        state = task.with_options(refresh_cache=True)(*args, return_state=True)
        result = state.result()
    return result | {"cached": state.name == "Cached"}


def _untrusted(stage: str, result: dict) -> bool:
    """True (with a warning naming the files) when a cached stage's artifacts are missing or do not verify."""
    bad = unusable_outputs(result, contents=stage != "export")
    if bad:
        import logging

        from prefect.logging import get_run_logger

        msg = f"stage {stage}: the cached result's artifacts are unusable ({'; '.join(bad)}); running it again"
        get_run_logger().warning(msg)
        logging.getLogger("lgrpo.rerun").warning(msg)
    return bool(bad)


def unusable_outputs(result: dict, contents: bool = True) -> list[str]:
    """What is wrong with the artifacts a stage summary names (OUTPUT_KEYS): missing, or (with `contents`; files
    with a checksum sidecar, also inside a named directory) not verifying. Empty when all are usable. The export
    is checked for presence only: at full size it is the base's weights (tens of GB), verified where it is loaded."""
    from artifacts import ArtifactError, sidecar_path, verify

    bad = []
    for key in OUTPUT_KEYS:
        if not isinstance(result.get(key), str):
            continue
        p = Path(result[key])
        if not p.exists():
            bad.append(f"{p}: missing")
            continue
        if not contents:
            continue
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            if sidecar_path(f).is_file():
                try:
                    verify(f)
                except ArtifactError as exc:
                    bad.append(str(exc))
    return bad


def _refresh(task, stage: str, force_from: str | None):
    if force_from is None:
        return task
    if force_from not in STAGES:
        raise ValueError(f"force_from={force_from!r}: pick one of {', '.join(STAGES)}")
    first = STAGES.index(force_from)
    if force_from == "run-gym":
        first = STAGES.index("generate-turn")  # turns interleave: regenerate from the first turn's gym on
    return task.with_options(refresh_cache=True) if STAGES.index(stage) >= first else task


def step_inputs(run_dir: str, step: int) -> dict:
    """Where step `step` reads its adapter, optimizer state and (reuse steps) rollouts from."""
    rd = RunDir(Path(run_dir))
    prep = read_json(rd.prepared())
    cfg = run_config(run_dir)
    kind = cfg.steps.kind_of(step)
    out = {
        "kind": kind,
        "base": prep["base"],
        "adapter": str(rd.adapter(step - 1)) if step > 0 else prep["adapter_init"],
        "optimizer": str(rd.optimizer(step - 1)) if step > 0 else None,
    }
    if kind == "reuse":
        fresh = max(s for s in range(step) if cfg.steps.kind_of(s) == "fresh")
        out["rollouts"], out["old_replay"] = str(rd.rollouts(fresh)), str(rd.replay(fresh))
    return out


@flow(name="grpo-step", flow_run_name="step-{step}", log_prints=True)
def grpo_step(run_dir: str, step: int, force_from: Stage | None = None) -> dict:
    cfg = run_config(run_dir)
    RunDir(Path(run_dir)).ensure(step)
    inp = step_inputs(run_dir, step)
    base = inp["base"]
    summaries = []
    ex = _run(T.export_base, "export", force_from, run_dir, base)
    summaries.append(ex)
    fresh = inp["kind"] == "fresh"
    if fresh:
        st = _run(T.sample_tasks, "sample-tasks", force_from, run_dir, step, base)
        summaries.append(st)
        state, turn_paths, gym_paths = st["path"], [], []
        placement = place_groups(st["path"], cfg.workers) if cfg.workers else None
        for turn in range(cfg.gym.max_turns):
            if placement is None:
                tr = _run(T.generate_turn, "generate-turn", force_from,
                          run_dir, step, turn, state, inp["adapter"], ex["path"], base)
            else:
                tr, gather = _generate_on_workers(run_dir, step, turn, state, inp["adapter"], ex["path"], base,
                                                  placement, force_from)
                summaries.append(gather)
            gr = _run(T.run_gym, "run-gym", force_from, run_dir, step, turn, state, tr["path"], base)
            summaries += [tr, gr]
            turn_paths.append(tr["path"])
            gym_paths.append(gr["path"])
            state = gr["path"]
            if gr["all_done"]:
                break
        ro = _run(T.collect_rollouts, "collect-rollouts", force_from, run_dir, step, turn_paths, gym_paths)
        summaries.append(ro)
        rollouts = ro["path"]
    else:
        rollouts = inp["rollouts"]
    if cfg.workers:
        rp = _replay_on_workers(run_dir, step, rollouts, inp["adapter"], base, fresh, cfg.workers, force_from)
    else:
        rp = _run(T.replay, "replay", force_from, run_dir, step, rollouts, inp["adapter"], base, fresh,
                  None if fresh else inp["old_replay"])
    summaries.append(rp)
    old_replay = rp["path"] if fresh else inp["old_replay"]
    op = _run(T.optimize, "optimize", force_from,
              run_dir, step, rollouts, rp["path"], old_replay, inp["adapter"], inp["optimizer"], base)
    summaries.append(op)
    if probe_due(cfg, step):
        summaries.append(_run(T.probe, "probe", force_from, run_dir, step, str(RunDir(Path(run_dir)).adapter(step)),
                              ex["path"], base))
    return publish(run_dir, step, inp["kind"], summaries)


def _fan_out(task, stage: str, force_from: str | None, arglists: list[tuple]) -> list[dict]:
    """One run of `task` per argument list, concurrently (one per worker), as `_run` runs one: a failed one re-raises
    its error, and a cached one whose artifacts are gone or do not verify runs again."""
    futures = [_refresh(task, stage, force_from).submit(*args) for args in arglists]
    for f in futures:
        f.wait()
    results = []
    for f, args in zip(futures, arglists):
        result = f.state.result() | {"cached": f.state.name == "Cached"}
        if result["cached"] and _untrusted(stage, result):
            result = task.with_options(refresh_cache=True)(*args) | {"cached": False}
        results.append(result)
    return results


def _generate_on_workers(run_dir: str, step: int, turn: int, state: str, adapter: str, export: str, base: str,
                         placement: dict[int, list[int]], force_from: str | None) -> tuple[dict, dict]:
    """One model turn on the pool: a generate-turn task per worker with active rows, run concurrently (the UI shows
    them side by side), then gather-turn joins their shards into the turn table. Returns (the turn's summary: wall,
    latent and answers seconds as the slowest worker's, counts summed, per-worker figures under "workers"; the
    gather summary)."""
    done = read_table(state).column("done").to_pylist()
    turn_path = str(RunDir(Path(run_dir)).turn(step, turn))
    jobs = [(w, [r for r in rows if not done[r]]) for w, rows in sorted(placement.items())]
    jobs = [(w, rows) for w, rows in jobs if rows]
    shards = [turn_path.replace(".arrow", f".w{w}.arrow") for w, _ in jobs]
    results = _fan_out(T.generate_turn_on_worker, "generate-turn", force_from,
                       [(run_dir, step, turn, state, adapter, export, base, w, rows, shard)
                        for (w, rows), shard in zip(jobs, shards)])
    gather = _run(T.gather_turn, "generate-turn", force_from, run_dir, step, shards, turn_path)
    keys_max = ("wall_s", "latent_s", "answers_s", "latent_prefill_s", "answers_prefill_s", "answers_draw_s",
                "answers_wait_s")
    keys_sum = ("rows", "answer_tokens", "prefix_tokens", "prefix_input_tokens", "prefix_computed_tokens")
    combined = {"stage": "generate-turn", "turn": turn, "path": gather["path"],
                "cached": all(r["cached"] for r in results)}
    for k in keys_max:
        if any(k in r for r in results):
            combined[k] = max(r.get(k, 0.0) for r in results)
    for k in keys_sum:
        if any(k in r for r in results):
            combined[k] = sum(r.get(k, 0) for r in results)
    engines = {r["latent_engine"] for r in results if "latent_engine" in r}
    if engines:  # latent.engine resolves the same way on every worker
        combined["latent_engine"] = "/".join(sorted(engines))
    combined["workers"] = [{k: r[k] for k in ("worker", "rows", "wall_s", "latent_s", "answers_s") if k in r}
                           for r in results]
    return combined, gather


def _replay_on_workers(run_dir: str, step: int, rollouts: str, adapter: str, base: str, fresh: bool, workers: int,
                       force_from: str | None) -> dict:
    """Replay on the pool: the turns split across the workers by token count, a replay task per worker (concurrent),
    then gather-replay (every turn once; the parity gate). The graphs stay in the workers for optimize. Returns one
    replay summary: wall seconds of the slowest worker plus the gather, per-worker figures under "workers"."""
    from stages.replay import shared_units, split_turns, turns_of

    table = read_table(rollouts)
    lengths = [len(p) + len(a) + 1 for p, a in zip(table.column("prefix_ids").to_pylist(),
                                                   table.column("answer_ids").to_pylist())]
    units = shared_units(turns_of(table)) if run_config(run_dir).replay.share_prefix else None
    parts = [(w, ids) for w, ids in sorted(split_turns(lengths, workers, units).items()) if ids]
    rd = RunDir(Path(run_dir))
    shards = [str(rd.replay(step)).replace(".arrow", f".w{w}.safetensors") for w, _ in parts]
    results = _fan_out(T.replay_on_worker, "replay", force_from,
                       [(run_dir, step, rollouts, adapter, base, w, ids, shard) for (w, ids), shard in zip(parts, shards)])
    g = _run(T.gather_replay, "replay", force_from, run_dir, step, rollouts, shards, [w for w, _ in parts], fresh,
             adapter, base)
    out = dict(g)
    out["wall_s"] = max(r["wall_s"] for r in results) + g["wall_s"]
    out["cached"] = g["cached"] and all(r["cached"] for r in results)
    out["workers"] = [{k: r[k] for k in ("worker", "turns", "tokens", "microbatches", "wall_s") if k in r}
                      for r in results]
    return out


def phase_times(summaries: list[dict]) -> dict[str, float]:
    """Seconds per phase, as measured by the stages (generation split into latent loop and answers, and -- where the
    engines prefill rows apart from their loops, the CUDA-graphed paths -- into prefill, latent and answers).

    Stages Prefect returned from the cache cost nothing in this run and are left out."""
    ph: dict[str, float] = {}

    def add(k, v):
        ph[k] = round(ph.get(k, 0.0) + v, 4)

    for s in summaries:
        if s.get("cached"):
            continue
        name = s["stage"]
        if name == "generate-turn":
            pre_l, pre_a = s.get("latent_prefill_s"), s.get("answers_prefill_s")
            if pre_l is not None or pre_a is not None:
                add("prefill", (pre_l or 0.0) + (pre_a or 0.0))
            add("latent", s.get("latent_s", 0.0) - (pre_l or 0.0))
            add("answers", s.get("answers_s", 0.0) - (pre_a or 0.0))
            add("generate-other", s["wall_s"] - s.get("latent_s", 0.0) - s.get("answers_s", 0.0))
        else:
            add(name, s["wall_s"])
    return ph


def publish(run_dir: str, step: int, kind: str, summaries: list[dict]) -> dict:
    rd = RunDir(Path(run_dir))
    ph = phase_times(summaries)
    by = {s["stage"]: s for s in summaries}
    metrics = {"step": step, "kind": kind, "stage_seconds": round(sum(ph.values()), 4),
               "cached": sorted({s["stage"] for s in summaries if s.get("cached")})}
    metrics.update(step_metrics.from_summaries(by))  # every metric declared in artifacts/metrics.py
    gens = [s for s in summaries if s["stage"] == "generate-turn" and "prefix_input_tokens" in s]
    if gens:  # the prefix cache: prefix tokens asked for vs computed, over the step's turns and both engines
        n_in = sum(s["prefix_input_tokens"] for s in gens)
        n_comp = sum(s["prefix_computed_tokens"] for s in gens)
        metrics.update(prefix_input_tokens=n_in, prefix_computed_tokens=n_comp,
                       prefix_computed_share=round(n_comp / max(1, n_in), 4))
    turn_keys = ("turn", "rows", "latent_engine", "prefix_tokens", "answer_tokens", "latent_prefill_s", "latent_s",
                 "answers_prefill_s", "answers_draw_s", "answers_wait_s", "answers_s", "wall_s",
                 "latent_graph_captures", "answers_graph_captures",
                 "latent_graph_setup_s", "answers_graph_setup_s", "workers")
    turns = [{k: s[k] for k in turn_keys if k in s} for s in summaries
             if s["stage"] == "generate-turn" and not s.get("cached")]
    if turns:  # per model turn: where the generate-turn seconds went (bench/step_27b.py prints them)
        metrics["generate_turns"] = turns
    # GPU, per stage (the highest of a stage's runs): peak allocated and reserved memory, allocator retries
    for key in ("peak_gb", "peak_reserved_gb", "alloc_retries"):
        stages = {s["stage"] for s in summaries if key in s and not s.get("cached")}
        if stages:
            metrics[key] = {k: max(s[key] for s in summaries if s["stage"] == k and key in s) for k in stages}
    write_json(rd.timings(step), ph)
    write_json(rd.metrics(step), metrics)
    append_jsonl(rd.metrics_history(), metrics | {"phases": ph}, replace="step")
    curves.write_scalars(run_dir, step, step_metrics.scalars(metrics | {"phases": ph}))
    create_table_artifact(
        key=f"step-{step:04d}-timings",
        table=[{"phase": k, "seconds": v} for k, v in ph.items()],
        description=f"Per-phase wall seconds of {kind} step {step} (measured by the stages)",
    )
    create_markdown_artifact(
        key=f"step-{step:04d}-metrics",
        markdown="| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in metrics.items()),
        description=f"Metrics of step {step}",
    )
    return metrics | {"phases": ph}
