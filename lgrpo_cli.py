"""`lgrpo`: train, rerun a stored step, evaluate an adapter on the held-out split."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import yaml

from artifacts import metrics as step_metrics


def _quiet(verbose: bool) -> None:
    """Keep the console for the progress display: Prefect at WARNING, no HF progress bars or deprecation noise."""
    import warnings

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not verbose:  # tracebacks go to the Prefect log and <run>/errors/, not over the console (flows/console.py)
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS", "flows.console.BriefConsoleHandler")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # a fresh ephemeral API server migrates its DB first: ~20 s on 2 busy cores, more than the default wait
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _parse_set(items: list[str]) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--set {it!r}: expected key=value, e.g. --set grpo.loss_type=grpo")
        k, v = it.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _records(run_dir: Path) -> dict[int, dict]:
    """Latest metrics record per step (a re-run step appends a newer one)."""
    from artifacts import RunDir

    p = RunDir(run_dir).metrics_history()
    if not p.exists():
        return {}
    out = {}
    for line in p.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["step"]] = r
    return out


def _watch(run_dir: Path, stop: threading.Event, progress, task_id, total: int) -> None:
    """One line per finished step (plain lines when the output is not a terminal), with the run's ETA."""
    from artifacts.progress import _fmt

    seen: set[int] = set()
    first = None  # when the first step finished: later steps' wall time per step includes Prefect's share
    while not stop.is_set():
        for s, r in sorted(_records(run_dir).items()):
            if s in seen:
                continue
            seen.add(s)
            ph = " ".join(f"{k}={v:.2f}s" for k, v in r["phases"].items())
            now = time.monotonic()
            first = now if first is None else first
            per_step = (now - first) / (len(seen) - 1) if len(seen) > 1 else sum(r["phases"].values())
            eta = f", ETA {_fmt(per_step * (total - len(seen)))}" if len(seen) < total else ""
            progress.console.print(f"step {s:3d} {r['kind']:5s} {step_metrics.line(r)} | {ph} | "
                                   f"{len(seen)}/{total} steps{eta}")
            progress.update(task_id, completed=len(seen))
        stop.wait(0.5)


def summary_tables(summary: dict):
    from rich.table import Table

    steps = summary["steps"]
    phases: dict[str, dict[str, list[float]]] = {}
    for s in steps:
        for k, v in s["phases"].items():
            phases.setdefault(k, {}).setdefault(s["kind"], []).append(v)
    t1 = Table(title="Per-phase wall seconds (mean per step, measured by the stages)")
    t1.add_column("phase")
    kinds = sorted({s["kind"] for s in steps})
    for k in kinds:
        t1.add_column(f"{k} steps", justify="right")
    for ph, by in phases.items():
        t1.add_row(ph, *[f"{sum(by.get(k, [0])) / max(len(by.get(k, [])), 1):.3f}" if k in by else "-" for k in kinds])
    t2 = Table(title="Reward per step")
    cols = step_metrics.columns()  # declared in artifacts/metrics.py
    for c in ("step", "kind", *(m.column for m in cols)):
        t2.add_column(c, justify="right")
    for s in steps:
        t2.add_row(str(s["step"]), s["kind"], *(m.format(s) for m in cols))
    return t1, t2


def cmd_train(args) -> int:
    from configs.schema import ConfigError, load_config

    overrides = _parse_set(args.set)
    if args.steps is not None:
        overrides["steps.total"] = args.steps
    if args.run_dir is not None:
        overrides["run_dir"] = args.run_dir
    cfg = load_config(args.config, overrides)  # fail fast on a bad config, before Prefect starts
    args.run_dir_resolved = cfg.run_dir  # where a failure's traceback is written
    from stages.context import reward_functions

    try:
        reward_functions(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from transformers.utils import logging as hf_logging

    from flows.api_server import api_server

    hf_logging.disable_progress_bar()
    with api_server():  # the run's Prefect API: a child that dies with this process (or the user's own server)
        return _train(args, cfg, overrides)


def _train(args, cfg, overrides) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from configs.params import TrainParameters
    from flows.train import train

    console = Console()
    run_dir = Path(cfg.run_dir)
    stop = threading.Event()
    t0 = time.time()
    with Progress(TextColumn("[bold]latent GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        tid = progress.add_task("steps", total=cfg.steps.total)
        th = threading.Thread(target=_watch, args=(run_dir, stop, progress, tid, cfg.steps.total), daemon=True)
        th.start()
        try:
            summary = train(params=TrainParameters(config=args.config, overrides=overrides))
        finally:
            time.sleep(0.6)
            stop.set()
            th.join()
    t1, t2 = summary_tables(summary)
    console = Console(width=max(console.width, 140))  # tables of numbers: never elide them
    console.print(t1)
    console.print(t2)
    rewards = [s.get("reward_mean") for s in summary["steps"] if "reward_mean" in s]
    if len(rewards) >= 2:
        n = min(5, len(rewards) // 2)
        console.print(f"fresh-step reward: first {n} mean {sum(rewards[:n]) / n:.3f}, last {n} mean "
                      f"{sum(rewards[-n:]) / n:.3f} (seed {summary['seed']})")
    b, a = summary["eval_before"], summary["eval_after"]
    console.print(f"held-out eval ({a['episodes']} tasks): success {b['success_rate']:.3f} -> "
                  f"{a['success_rate']:.3f}, reward {b['reward_mean']:.3f} -> {a['reward_mean']:.3f}, "
                  f"completion {b['completion_rate']:.2f} -> {a['completion_rate']:.2f}, tokens "
                  f"{b['mean_tokens']:.0f} -> {a['mean_tokens']:.0f}, tool errors "
                  f"{b['tool_error_rate']:.2f} -> {a['tool_error_rate']:.2f}, tool-result token share "
                  f"{b['tool_token_share']:.2f} -> {a['tool_token_share']:.2f}")
    console.print(f"curves: {summary['curves_png']} (reward and parity per step; also the Prefect artifact "
                  f"run-curves); TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
    console.print(f"run dir {summary['run_dir']}; total {time.time() - t0:.1f}s")
    return 0


def cmd_rerun(args) -> int:
    from flows.api_server import api_server

    args.run_dir_resolved = args.run_dir

    with api_server():
        from flows.rerun import rerun_stage

        res = rerun_stage(run_dir=args.run_dir, step=args.step, stage=args.stage)
    print(json.dumps(res, indent=2, default=str))
    return 0


def cmd_eval(args) -> int:
    from artifacts import RunDir, read_json
    from stages.evaluate import evaluate
    from stages.export import export_base

    rd = RunDir(Path(args.run_dir))
    prep = read_json(rd.prepared())
    steps = [s for s in rd.steps() if rd.adapter(s).exists()]
    if args.step is None and not steps:
        adapter, tag = prep["adapter_init"], "before"
    else:
        step = args.step if args.step is not None else steps[-1]
        adapter, tag = str(rd.adapter(step)), f"step-{step:04d}"
    export = export_base(str(rd.root), prep["base"])["path"]  # exists after training: returns its path
    res = evaluate(str(rd.root), tag, adapter, export, prep["base"])
    print(json.dumps(res, indent=2))
    return 0


def cmd_gates(args) -> int:
    """Per-step gate history of a run: rollout parity (fresh: gated; reuse: drift), probes, verified checkpoint."""
    from rich.console import Console
    from rich.table import Table

    from artifacts import RunDir, read_json, read_jsonl

    rd = RunDir(Path(args.run_dir))
    parity = read_jsonl(rd.parity_history()) if rd.parity_history().exists() else []
    probes = {p["step"]: p for p in read_jsonl(rd.probe_history())} if rd.probe_history().exists() else {}
    t = Table(title=f"gates of {rd.root}")
    for col in ("step", "kind", "tokens", "mean gap", "max gap", "masked", "k3 KL", "IS ratio min/max", "parity",
                "probe max gap", "probe argmax"):
        t.add_column(col, justify="right")
    for p in parity:
        pr = probes.get(p["step"])
        verdict = "-" if not p.get("gated", True) else ("pass" if p["passed"] else "FAIL")
        t.add_row(str(p["step"]), p.get("kind", "fresh"), str(p["tokens_considered"]), f"{p['mean_gap']:.2e}",
                  f"{p['max_gap']:.2e}", str(p["masked"]), f"{p['k3_kl']:.1e}",
                  f"{p['is_ratio_min']:.3f}/{p['is_ratio_max']:.3f}", verdict,
                  f"{pr['max_gap']:.2e}" if pr else "", f"{pr['argmax_agreement']:.3f}" if pr else "")
    console = Console(width=max(Console().width, 150))  # a table of numbers: never elide them
    console.print(t)
    fresh = [p for p in parity if p.get("gated", True)]
    if fresh:
        console.print(f"rollout parity over {len(fresh)} fresh steps: all passed = {all(p['passed'] for p in fresh)}, "
                      f"max of per-step mean gaps {max(p['mean_gap'] for p in fresh):.2e} (limit "
                      f"{fresh[0]['limits']['mean_max']}), largest token gap {max(p['max_gap'] for p in fresh):.2e}, "
                      f"masked tokens {sum(p['masked'] for p in fresh)}")
    if probes:
        console.print(f"probes: {len(probes)}, all passed = {all(p['passed'] for p in probes.values())}, "
                      f"max gap {max(p['max_gap'] for p in probes.values()):.2e}")
    vc = rd.verified_checkpoint()
    if vc.exists():
        console.print(f"verified checkpoint: {read_json(vc)}")
    return 0


def cmd_verify_trace(args) -> int:
    from gyms.trace import TraceError, verify_trace

    bad = 0
    for path in args.paths:
        try:
            summary = verify_trace(path)
        except (TraceError, OSError) as e:
            print(f"FAILED {e}")
            bad += 1
        else:
            print(f"ok {path}: episode {summary.episode}, {summary.calls} calls, "
                  f"{len(summary.read_records)} receipts, head {summary.head[:16]}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lgrpo", description="latent-GRPO trainer (one Prefect flow per step)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show Prefect's INFO logs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run a training job")
    t.add_argument("--config", default="tiny", help="preset name (configs/*.yaml) or a YAML path")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--run-dir", default=None)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. grpo.loss_type=grpo")
    r = sub.add_parser("rerun", help="re-run a stored step from its artifacts")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--step", type=int, required=True)
    r.add_argument("--stage", default=None, help="force this stage and all later ones to re-run")
    e = sub.add_parser("eval", help="held-out evaluation of a step's adapter")
    e.add_argument("--run-dir", required=True)
    e.add_argument("--step", type=int, default=None)
    gt = sub.add_parser("gates", help="per-step gate history of a run (parity, drift, probes, checkpoint)")
    gt.add_argument("--run-dir", required=True)
    v = sub.add_parser("verify-trace", help="verify stored provenance traces (hash chain and seal)")
    v.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # user gyms and reward functions import from here, as with python -m
    _quiet(args.verbose)
    from engine.pool import install_stack_dumps

    install_stack_dumps()  # SIGUSR1: every thread's stack, here and in each pool worker (their logs)
    from configs.schema import ConfigError

    try:
        return {"train": cmd_train, "rerun": cmd_rerun, "eval": cmd_eval,
                "verify-trace": cmd_verify_trace, "gates": cmd_gates}[args.cmd](args)
    except ConfigError as e:
        print(f"lgrpo: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - reported in one line, the traceback kept in the run directory
        if getattr(args, "run_dir_resolved", None) is None:
            raise
        print(failure_line(e, args.run_dir_resolved), file=sys.stderr)
        return 1


def failure_line(exc: BaseException, run_dir: str) -> str:
    """One line naming the failed task and the cause; the full traceback goes to <run>/errors/<UTC time>.txt."""
    import traceback

    from artifacts import RunDir
    from flows.tasks import failed_task

    path = RunDir(Path(run_dir)).error_log(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)))
    cause = str(exc).strip().splitlines()
    cause = f"{type(exc).__name__}: {cause[0]}" if cause else type(exc).__name__
    where = f"task {task} failed" if (task := failed_task(exc)) else "the run failed outside any task"
    return f"lgrpo: {where}: {cause} (full traceback: {path}; Prefect's log has it too)"


if __name__ == "__main__":
    sys.exit(main())
