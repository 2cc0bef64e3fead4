"""Prefect tasks: thin wrappers around `stages/` functions. Importable without torch (stages load lazily).

Cache keys hash the *contents* of input artifacts (parameters named `*_in`, paths or lists of paths), the other
parameters, the run's id, the stage code and the task's source. Re-running a step therefore skips every stage whose inputs are
unchanged (state Cached) and re-runs the failed one and what follows. `GateFailed` is never retried.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy

from artifacts import RunDir, content_digest, read_json
from engine.gates import GateFailed


def _content(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_content(v) for v in value]
    return content_digest(value)  # verified; remembered while the files keep their stat signature


@lru_cache(maxsize=1)
def code_digest() -> str:
    """Digest of the code a stage runs (stages/, engine/, gyms/, artifacts/): new code never reuses old results."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in ("stages", "engine", "gyms", "artifacts"):
        if not (root / pkg / "__init__.py").exists():  # a renamed package must not drop out of the digest silently
            raise RuntimeError(f"code_digest: package {pkg}/ not found under {root}")
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def user_code_digest(run_dir: str) -> str:
    """Digest of the source files of a user gym and reward functions the run names by import path (edited user
    code re-runs its stages like edited project code does)."""
    import importlib.util

    from stages.context import run_config

    cfg = run_config(run_dir)
    h = hashlib.sha256()
    for path in [cfg.gym.name, *cfg.gym.reward_funcs]:
        module = path.partition(":")[0] if ":" in path else None
        spec = importlib.util.find_spec(module) if module else None
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            h.update(path.encode() + b"\0" + _file_digest(spec.origin))
    return h.hexdigest()


_FILE_DIGESTS: dict[str, tuple[tuple, bytes]] = {}


def _file_digest(path: str) -> bytes:
    """sha256 of a source file, remembered while it keeps its inode, size, mtime and ctime (every task's cache key
    asks for the same few user files)."""
    import os

    st = os.stat(path)
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    hit = _FILE_DIGESTS.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    digest = hashlib.sha256(Path(path).read_bytes()).digest()
    if os.stat(path).st_mtime_ns == st.st_mtime_ns:  # not written while it was read
        _FILE_DIGESTS[path] = (sig, digest)
    return digest


_RUN_IDS: dict[str, str] = {}


def run_id(run_dir: str) -> str:
    """The run's id from run.json, verified (artifacts.verified_digest remembers the check while the file keeps its
    stat signature, so the cache key of every task does not hash and parse it again)."""
    from artifacts import verified_digest

    p = RunDir(run_dir).run_info()
    digest = verified_digest(p)
    if digest not in _RUN_IDS:
        _RUN_IDS[digest] = read_json(p)["run_id"]
    return _RUN_IDS[digest]


def artifact_cache_key(ctx, parameters: dict[str, Any]) -> str:
    """Hash of the run id, the stage code (project and user), plain parameters and the contents of every `*_in`
    artifact."""
    run_dir = parameters.get("run_dir")
    run = run_id(run_dir) if run_dir else ""
    user = user_code_digest(run_dir) if run_dir else ""
    keyed = {k: (_content(v) if k.endswith("_in") else v) for k, v in sorted(parameters.items())}
    blob = json.dumps({"run": run, "code": code_digest(), "user": user, "task": ctx.task.name, "params": keyed},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


ARTIFACT_CACHE = CacheKeyFnPolicy(cache_key_fn=artifact_cache_key) + TASK_SOURCE


def retry_unless_gate(task, task_run, state) -> bool:
    """Retry transient failures; a failed correctness gate is final."""
    return not isinstance(state.result(raise_on_failure=False), GateFailed)


def name_failed_task(task, task_run, state) -> None:
    """on_failure hook (after the last retry): the error carries the name of the task run that raised it, so the CLI
    can end a failed run with one line naming the task and the cause (`failed_task`)."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, BaseException) and failed_task(exc) is None:
        exc.add_note(f"{_TASK_NOTE}{task_run.name}")


_TASK_NOTE = "lgrpo: raised by Prefect task "


def failed_task(exc: BaseException) -> str | None:
    """The task run named by `name_failed_task` on this error or the errors it chains from, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for note in getattr(exc, "__notes__", ()):
            if note.startswith(_TASK_NOTE):
                return note[len(_TASK_NOTE):]
        exc = exc.__cause__ or exc.__context__
    return None


# Every stage task: content-keyed cache, results persisted as JSON (paths and small summaries; no pickles on disk),
# transient failures retried but never a failed gate, and the failing task's name carried by its error.
TASK_OPTIONS = dict(cache_policy=ARTIFACT_CACHE, persist_result=True, result_serializer="json",
                    retry_condition_fn=retry_unless_gate, on_failure=[name_failed_task])


def _stage_task(name: str, retries: int, delays: list[float]):
    return task(name=name, retries=retries, retry_delay_seconds=delays, retry_jitter_factor=0.5, **TASK_OPTIONS,
                task_run_name=name + "-{step}" if name not in ("prepare-tokenizer", "bootstrap-base", "init-adapter", "export") else name)


@_stage_task("prepare-tokenizer", 1, [2])
def prepare_tokenizer(run_dir: str) -> dict:
    from stages.tokenizer import prepare_tokenizer as fn

    return fn(run_dir)


@_stage_task("bootstrap-base", 1, [2])
def bootstrap_base(run_dir: str, tok_in: str) -> dict:
    from stages.bootstrap import bootstrap_base as fn

    return fn(run_dir, tok_in)


@_stage_task("init-adapter", 1, [2])
def init_adapter(run_dir: str, base_in: str) -> dict:
    from stages.prepare import init_adapter as fn

    return fn(run_dir, base_in)


@_stage_task("export", 1, [2])
def export_base(run_dir: str, base_in: str) -> dict:
    return on_pool_or_here("stages.export.export_base", run_dir=run_dir, base_dir=base_in)  # may load the base


@_stage_task("sample-tasks", 1, [2])
def sample_tasks(run_dir: str, step: int, base_in: str) -> dict:
    from stages.generate import sample_tasks as fn

    return fn(run_dir, step, base_in)


@task(name="generate-turn", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS, task_run_name="generate-turn-{step}-{turn}")
def generate_turn(run_dir: str, step: int, turn: int, state_in: str, adapter_in: str, export_in: str,
                  base_in: str) -> dict:
    from stages.generate import generate_turn as fn

    return fn(run_dir, step, turn, state_in, adapter_in, export_in, base_in)


@task(name="generate-turn", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS,
      task_run_name="generate-turn-{step}-{turn}-w{worker}")
def generate_turn_on_worker(run_dir: str, step: int, turn: int, state_in: str, adapter_in: str, export_in: str,
                            base_in: str, worker: int, rows: list[int], out_path: str) -> dict:
    """One model turn for `rows` (the worker's GRPO groups) in pool worker `worker` (engine/pool.py): a dead worker
    fails this task naming it, and the retry runs on a restarted one."""
    from stages.context import run_config

    out = run_pool(run_config(run_dir), run_dir).call(
        worker, "stages.generate.generate_turn", run_dir=run_dir, step=step, turn=turn, state_in=state_in,
        adapter_in=adapter_in, export_in=export_in, base_in=base_in, out_path=out_path, rows=rows)
    return out | {"worker": worker}


def run_pool(cfg, run_dir: str):
    """The run's worker pool (engine/pool.py), started on first use."""
    from engine.pool import pool_for

    return pool_for(run_dir, cfg.workers, cfg.device, worker_threads(cfg))


def worker_threads(cfg) -> int | None:
    """torch threads per CPU worker: `threads`, else the cores shared out (two all-core trainings on the same cores
    slow each other about 5x)."""
    if cfg.device == "cuda":
        return cfg.threads
    import os

    return cfg.threads or max(1, (os.cpu_count() or 1) // max(1, cfg.workers))


@_stage_task("gather-turn", 1, [2])
def gather_turn(run_dir: str, step: int, shards: list[str], out_path: str) -> dict:
    from stages.generate import gather_turn as fn

    return fn(shards, out_path)


@task(name="replay", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS, task_run_name="replay-{step}-w{worker}")
def replay_on_worker(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, worker: int,
                     turn_ids: list[int], out_path: str) -> dict:
    """Worker `worker`'s turns of replay, scored in that worker (its graphs stay there for optimize)."""
    from stages.context import run_config

    cfg = run_config(run_dir)
    with gate_reports(run_dir, step, "", ""):
        out = run_pool(cfg, run_dir).call(
            worker, "stages.replay.replay_shard", run_dir=run_dir, step=step, rollouts_in=rollouts_in,
            adapter_in=adapter_in, base_in=base_in, turn_ids=turn_ids, out_path=out_path)
    return out | {"worker": worker}


@task(name="gather-replay", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS, task_run_name="gather-replay-{step}")
def gather_replay(run_dir: str, step: int, rollouts_in: str, shards: list[str], workers: list[int], fresh: bool,
                  adapter_in: str, base_in: str) -> dict:
    from stages.replay import gather_replay as fn

    with gate_reports(run_dir, step, adapter_in, base_in, rollouts_in):  # rollout parity, on the pool's replay
        return fn(run_dir, step, rollouts_in, shards, workers, fresh)


@task(name="run-gym", retries=3, retry_delay_seconds=[1, 2, 4], retry_jitter_factor=0.5, **TASK_OPTIONS,
      task_run_name="run-gym-{step}-{turn}")
def run_gym(run_dir: str, step: int, turn: int, state_in: str, turn_in: str, base_in: str) -> dict:
    from stages.gym import run_gym as fn

    return fn(run_dir, step, turn, state_in, turn_in, base_in)


@_stage_task("collect-rollouts", 1, [2])
def collect_rollouts(run_dir: str, step: int, turn_in: list[str], gym_in: list[str]) -> dict:
    from stages.rollouts import collect_rollouts as fn

    with gate_reports(run_dir, step, "", ""):  # provenance: a trace that does not verify
        return fn(run_dir, step, turn_in, gym_in)


DIAGNOSED_GATES = ("rollout-parity", "teacher-forced-probe")  # stages/diagnose.py rebuilds their worst tokens


def report_gate_failure(run_dir: str, step: int | None, exc: GateFailed, adapter_in: str, base_in: str,
                        rollouts_in: str | None = None) -> None:
    """Attach the failed gate's report as a Prefect artifact (key `step-NNNN-gate-<gate>`, `final-gate-<gate>` for the
    end-of-run checkpoint) and, for the gates that have one, run the diagnostic and attach its verdict.

    The gate failure is re-raised by the caller whatever happens here; a diagnostic that itself fails is logged
    (with its error) and never replaces the gate's error."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.logging import get_run_logger

    from artifacts import dumps_json

    logger = get_run_logger()
    where = f"step-{step:04d}" if step is not None else "final"
    summary = {k: v for k, v in exc.report.items() if not isinstance(v, (list, dict))}
    diagnosed = exc.gate in DIAGNOSED_GATES
    create_markdown_artifact(
        key=f"{where}-gate-{exc.gate}",
        markdown=f"**gate `{exc.gate}` failed** at {where}: {exc}\n\n| field | value |\n|---|---|\n"
                 + "\n".join(f"| {k} | {v} |" for k, v in summary.items())
                 + f"\n\n```json\n{dumps_json(exc.report)[:20000]}\n```\n\n"
                 + (f"diagnostic: artifact `{where}-diagnostic`" if diagnosed else
                    f"no token-level diagnostic applies to `{exc.gate}` (stages/diagnose.py covers "
                    f"{', '.join(DIAGNOSED_GATES)}); the message above names what to check"),
        description=f"Report of the failed gate {exc.gate} ({where})")
    if not diagnosed:
        return
    try:
        d = on_pool_or_here("stages.diagnose.diagnose", run_dir=run_dir, step=step, gate=exc.gate, report=exc.report,
                            adapter_in=adapter_in, base_in=base_in, rollouts_in=rollouts_in)
    except Exception as diag_exc:  # noqa: BLE001 - the gate's own error is what the task raises
        logger.error("diagnostic for gate %s failed: %r", exc.gate, diag_exc)
        return
    logger.error("diagnostic for gate %s: %s (disagreeing paths: %s)", exc.gate, d["verdict"],
                 ", ".join(d["disagreeing_paths"]) or "none")
    create_markdown_artifact(
        key=f"{where}-diagnostic",
        markdown=f"**verdict:** {d['verdict']}\n\n**disagreeing paths:** {', '.join(d['disagreeing_paths']) or 'none'}"
                 f"\n\nfull report: `{d['path']}`",
        description=f"Failure diagnostic of gate {exc.gate} ({where})")


@contextmanager
def gate_reports(run_dir: str, step: int | None, adapter_in: str, base_in: str, rollouts_in: str | None = None):
    """Around a stage that checks gates: a GateFailed leaves its report (and diagnostic) in Prefect, then propagates."""
    try:
        yield
    except GateFailed as exc:
        report_gate_failure(run_dir, step, exc, adapter_in, base_in, rollouts_in)
        raise


@_stage_task("replay", 1, [2])
def replay(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, fresh: bool,
           old_replay_in: str | None = None) -> dict:
    from stages.replay import replay as fn

    with gate_reports(run_dir, step, adapter_in, base_in, rollouts_in):
        return fn(run_dir, step, rollouts_in, adapter_in, base_in, fresh, old_replay_in=old_replay_in)


@_stage_task("probe", 1, [2])
def probe(run_dir: str, step: int, adapter_in: str, export_in: str, base_in: str) -> dict:
    with gate_reports(run_dir, step, adapter_in, base_in):
        return on_pool_or_here("stages.probe.probe", run_dir=run_dir, step=step, adapter_in=adapter_in,
                               export_in=export_in, base_in=base_in)


@task(name="verify-checkpoint", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS)
def verify_checkpoint(run_dir: str, adapter_in: str, base_in: str) -> dict:
    with gate_reports(run_dir, None, adapter_in, base_in):
        return on_pool_or_here("stages.probe.verify_checkpoint", run_dir=run_dir, adapter_in=adapter_in,
                               base_in=base_in)


@_stage_task("optimize", 1, [2])
def optimize(run_dir: str, step: int, rollouts_in: str, replay_in: str, old_replay_in: str, adapter_in: str,
             optimizer_in: str | None, base_in: str) -> dict:
    from stages.context import run_config
    from stages.optimize import optimize as fn
    from stages.optimize import optimize_on_workers

    cfg = run_config(run_dir)
    with gate_reports(run_dir, step, adapter_in, base_in, rollouts_in):  # finite/nonzero gradients, determinism, ...
        if cfg.workers:  # the loss here, the backward in the workers that hold the graphs (engine/pool.py)
            return optimize_on_workers(run_dir, step, rollouts_in, replay_in, old_replay_in, adapter_in, optimizer_in,
                                       base_in, run_pool(cfg, run_dir))
        return fn(run_dir, step, rollouts_in, replay_in, old_replay_in, adapter_in, optimizer_in, base_in)


@task(name="evaluate", retries=1, retry_delay_seconds=[2], **TASK_OPTIONS, task_run_name="evaluate-{tag}")
def evaluate(run_dir: str, tag: str, adapter_in: str, export_in: str, base_in: str) -> dict:
    return on_pool_or_here("stages.evaluate.evaluate", run_dir=run_dir, tag=tag, adapter_in=adapter_in,
                           export_in=export_in, base_in=base_in)


def on_pool_or_here(fn: str, **kwargs):
    """A stage that builds engines (`fn`, a dotted path, called with kwargs, run_dir among them): in worker 0 when the
    run has a pool (the driver then never holds a model), else in this process."""
    import importlib

    from stages.context import run_config

    run_dir = kwargs["run_dir"]
    cfg = run_config(run_dir)
    if cfg.workers:
        return run_pool(cfg, run_dir).call(0, fn, **kwargs)
    mod, _, name = fn.rpartition(".")
    return getattr(importlib.import_module(mod), name)(**kwargs)
