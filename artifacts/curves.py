"""Curves of a run: TensorBoard event files (``<run>/tensorboard/``) and a PNG of reward and parity per step
(``<run>/curves.png``). Imports neither torch nor TensorFlow: events are written with the `tensorboard` package's
own event-file writer, the PNG with matplotlib's Agg backend.

Scalars (x = step; held-out points at step 0 = before training and step N = after N steps):

    train/reward, train/success, train/completion       fresh steps (the step's rollouts)
    heldout/reward, heldout/success, heldout/completion  held-out evaluation, before and after
    parity/mean, parity/max                              trainer vs sampler log-prob gap (fresh steps)
    optim/loss, optim/grad_norm                          every step
    prefix_cache/computed_share                          share of prefix tokens run through a model
    seconds/<phase>, seconds/step                        per-phase wall seconds measured by the stages

View with ``tensorboard --logdir <run>/tensorboard``.
"""

from __future__ import annotations

import time
from pathlib import Path

from artifacts.layout import RunDir
from artifacts.store import atomic_write, read_jsonl

_WRITERS: dict[str, object] = {}


def _writer(run_dir: str | Path):
    """This process's event-file writer of the run (one file per process; a resumed run adds a file)."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    d = RunDir(Path(run_dir)).tensorboard_dir()
    key = str(d.resolve())
    if key not in _WRITERS:
        d.mkdir(parents=True, exist_ok=True)
        _WRITERS[key] = EventFileWriter(str(d))
    return _WRITERS[key]


def write_scalars(run_dir: str | Path, step: int, values: dict[str, float | None]) -> None:
    """Append one event with the given scalars at `step` (None values are left out) and flush it to disk."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    vals = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if v is not None]
    if not vals:
        return
    w = _writer(run_dir)
    w.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=vals)))
    w.flush()


def close(run_dir: str | Path) -> None:
    w = _WRITERS.pop(str(RunDir(Path(run_dir)).tensorboard_dir().resolve()), None)
    if w is not None:
        w.close()


def eval_scalars(report: dict) -> dict[str, float | None]:
    """The TensorBoard scalars of a held-out evaluation report (stages/evaluate.py)."""
    return {"heldout/reward": report.get("reward_mean"), "heldout/success": report.get("success_rate"),
            "heldout/completion": report.get("completion_rate")}


def plot_run(run_dir: str | Path, eval_before: dict | None = None, eval_after: dict | None = None) -> Path:
    """Draw `<run>/curves.png` from `<run>/metrics.jsonl`: fresh-step reward and success (with the held-out
    evaluation before and after training), and trainer-vs-sampler parity per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rd = RunDir(Path(run_dir))
    recs = {r["step"]: r for r in read_jsonl(rd.metrics_history())} if rd.metrics_history().exists() else {}
    steps = sorted(recs)
    fresh = [s for s in steps if recs[s].get("reward_mean") is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True, height_ratios=[3, 2])
    ax1.plot(fresh, [recs[s]["reward_mean"] for s in fresh], "o-", color="tab:blue", label="fresh-step reward")
    if fresh and all(recs[s].get("success_rate") is not None for s in fresh):
        ax1.plot(fresh, [recs[s]["success_rate"] for s in fresh], "s--", color="tab:green", alpha=0.7,
                 label="fresh-step success")
    end = (steps[-1] + 1) if steps else 1
    for rep, x, mk in ((eval_before, 0, "<"), (eval_after, end, ">")):
        if rep:
            ax1.plot([x], [rep["reward_mean"]], mk, color="tab:red", ms=10,
                     label="held-out reward" if x == 0 else None)
            if rep.get("success_rate") is not None:
                ax1.plot([x], [rep["success_rate"]], mk, color="tab:orange", ms=10,
                         label="held-out success" if x == 0 else None)
    ax1.set_ylabel("reward / success rate")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="best")
    ax1.set_title(f"{rd.root.name}: reward and parity per step")
    par = [s for s in steps if recs[s].get("parity_mean") is not None]
    if par:
        floor = 1e-12  # parity is exactly 0 when both engines compute identically; draw it at the floor
        ax2.semilogy(par, [max(recs[s]["parity_mean"], floor) for s in par], "o-", label="parity mean gap (nat)")
        ax2.semilogy(par, [max(recs[s]["parity_max"], floor) for s in par], "^-", label="parity max gap (nat)")
        ax2.legend(fontsize=8, loc="best")
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("trainer vs sampler")
    ax2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = rd.curves_png()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return path


def png_markdown(path: Path, title: str) -> str:
    """A Markdown document showing a PNG inline (base64 data URI) for a Prefect markdown artifact."""
    import base64

    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\nfile: `{path}`\n"


def summary_paths(run_dir: str | Path) -> dict[str, str]:
    rd = RunDir(Path(run_dir))
    return {"tensorboard_dir": str(rd.tensorboard_dir()), "curves_png": str(rd.curves_png())}


__all__ = ["close", "eval_scalars", "plot_run", "png_markdown", "summary_paths", "write_scalars"]
