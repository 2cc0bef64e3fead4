"""Prefect tasks: thin wrappers around `stages/` functions. Importable without torch (stages load lazily).

Cache keys hash the *contents* of input artifacts (parameters named `*_in`, paths or lists of paths), the other
parameters, the run's id, the stage code and the task's source. Re-running a step therefore skips every stage whose inputs are
unchanged (state Cached) and re-runs the failed one and what follows. `GateFailed` is never retried.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy

from artifacts import RunDir, dir_digest, read_json, verify
from engine.gates import GateFailed


def _content(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_content(v) for v in value]
    p = Path(value)
    return dir_digest(p) if p.is_dir() else verify(p)


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
            h.update(path.encode() + b"\0" + Path(spec.origin).read_bytes())
    return h.hexdigest()


def artifact_cache_key(ctx, parameters: dict[str, Any]) -> str:
    """Hash of the run id, the stage code (project and user), plain parameters and the contents of every `*_in`
    artifact."""
    run_dir = parameters.get("run_dir")
    run_id = read_json(RunDir(run_dir).run_info())["run_id"] if run_dir else ""
    user = user_code_digest(run_dir) if run_dir else ""
    keyed = {k: (_content(v) if k.endswith("_in") else v) for k, v in sorted(parameters.items())}
    blob = json.dumps({"run": run_id, "code": code_digest(), "user": user, "task": ctx.task.name, "params": keyed},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


ARTIFACT_CACHE = CacheKeyFnPolicy(cache_key_fn=artifact_cache_key) + TASK_SOURCE


def retry_unless_gate(task, task_run, state) -> bool:
    """Retry transient failures; a failed correctness gate is final."""
    return not isinstance(state.result(raise_on_failure=False), GateFailed)


def _stage_task(name: str, retries: int, delays: list[float]):
    return task(name=name, cache_policy=ARTIFACT_CACHE, persist_result=True, retries=retries,
                retry_delay_seconds=delays, retry_jitter_factor=0.5, retry_condition_fn=retry_unless_gate,
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
    from stages.export import export_base as fn

    return fn(run_dir, base_in)


@_stage_task("sample-tasks", 1, [2])
def sample_tasks(run_dir: str, step: int, base_in: str) -> dict:
    from stages.generate import sample_tasks as fn

    return fn(run_dir, step, base_in)


@task(name="generate-turn", cache_policy=ARTIFACT_CACHE, persist_result=True, retries=1, retry_delay_seconds=[2],
      retry_condition_fn=retry_unless_gate, task_run_name="generate-turn-{step}-{turn}")
def generate_turn(run_dir: str, step: int, turn: int, state_in: str, adapter_in: str, export_in: str,
                  base_in: str) -> dict:
    from stages.generate import generate_turn as fn

    return fn(run_dir, step, turn, state_in, adapter_in, export_in, base_in)


@task(name="run-gym", cache_policy=ARTIFACT_CACHE, persist_result=True, retries=3, retry_delay_seconds=[1, 2, 4],
      retry_jitter_factor=0.5, retry_condition_fn=retry_unless_gate, task_run_name="run-gym-{step}-{turn}")
def run_gym(run_dir: str, step: int, turn: int, state_in: str, turn_in: str, base_in: str) -> dict:
    from stages.gym import run_gym as fn

    return fn(run_dir, step, turn, state_in, turn_in, base_in)


@_stage_task("collect-rollouts", 1, [2])
def collect_rollouts(run_dir: str, step: int, turn_in: list[str], gym_in: list[str]) -> dict:
    from stages.rollouts import collect_rollouts as fn

    return fn(run_dir, step, turn_in, gym_in)


def report_gate_failure(run_dir: str, step: int, exc: GateFailed, adapter_in: str, base_in: str,
                        rollouts_in: str | None = None) -> None:
    """Attach the failed gate's report as a Prefect artifact, run the diagnostic and attach its verdict.

    The gate failure is re-raised by the caller whatever happens here; a diagnostic that itself fails is logged
    (with its error) and never replaces the gate's error."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.logging import get_run_logger

    from artifacts import dumps_json

    logger = get_run_logger()
    summary = {k: v for k, v in exc.report.items() if not isinstance(v, (list, dict))}
    create_markdown_artifact(
        key=f"step-{step:04d}-gate-{exc.gate}",
        markdown=f"**gate `{exc.gate}` failed** at step {step}: {exc}\n\n| field | value |\n|---|---|\n"
                 + "\n".join(f"| {k} | {v} |" for k, v in summary.items())
                 + f"\n\n```json\n{dumps_json(exc.report)[:20000]}\n```",
        description=f"Report of the failed gate {exc.gate} (step {step})")
    try:
        from stages.diagnose import diagnose

        d = diagnose(run_dir, step, exc.gate, exc.report, adapter_in, base_in, rollouts_in)
    except Exception as diag_exc:  # noqa: BLE001 - the gate's own error is what the task raises
        logger.error("diagnostic for gate %s failed: %r", exc.gate, diag_exc)
        return
    logger.error("diagnostic for gate %s: %s (disagreeing paths: %s)", exc.gate, d["verdict"],
                 ", ".join(d["disagreeing_paths"]) or "none")
    create_markdown_artifact(
        key=f"step-{step:04d}-diagnostic",
        markdown=f"**verdict:** {d['verdict']}\n\n**disagreeing paths:** {', '.join(d['disagreeing_paths']) or 'none'}"
                 f"\n\nfull report: `{d['path']}`",
        description=f"Failure diagnostic of gate {exc.gate} (step {step})")


@_stage_task("replay", 1, [2])
def replay(run_dir: str, step: int, rollouts_in: str, adapter_in: str, base_in: str, fresh: bool) -> dict:
    from stages.replay import replay as fn

    try:
        return fn(run_dir, step, rollouts_in, adapter_in, base_in, fresh)
    except GateFailed as exc:
        report_gate_failure(run_dir, step, exc, adapter_in, base_in, rollouts_in)
        raise


@_stage_task("probe", 1, [2])
def probe(run_dir: str, step: int, adapter_in: str, export_in: str, base_in: str) -> dict:
    from stages.probe import probe as fn

    try:
        return fn(run_dir, step, adapter_in, export_in, base_in)
    except GateFailed as exc:
        report_gate_failure(run_dir, step, exc, adapter_in, base_in)
        raise


@task(name="verify-checkpoint", cache_policy=ARTIFACT_CACHE, persist_result=True, retries=1, retry_delay_seconds=[2],
      retry_condition_fn=retry_unless_gate)
def verify_checkpoint(run_dir: str, adapter_in: str, base_in: str) -> dict:
    from stages.probe import verify_checkpoint as fn

    return fn(run_dir, adapter_in, base_in)


@_stage_task("optimize", 1, [2])
def optimize(run_dir: str, step: int, rollouts_in: str, replay_in: str, old_replay_in: str, adapter_in: str,
             optimizer_in: str | None, base_in: str) -> dict:
    from stages.optimize import optimize as fn

    return fn(run_dir, step, rollouts_in, replay_in, old_replay_in, adapter_in, optimizer_in, base_in)


@task(name="evaluate", cache_policy=ARTIFACT_CACHE, persist_result=True, retries=1, retry_delay_seconds=[2],
      retry_condition_fn=retry_unless_gate, task_run_name="evaluate-{tag}")
def evaluate(run_dir: str, tag: str, adapter_in: str, export_in: str, base_in: str) -> dict:
    from stages.evaluate import evaluate as fn

    return fn(run_dir, tag, adapter_in, export_in, base_in)
