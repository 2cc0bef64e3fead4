"""Progress of long work (the bootstrap, a held-out evaluation) as plain lines, so that a run whose output goes to a
file (a scheduled deployment, CI, `| tee`) never goes quiet for minutes:

    bootstrap-base: 240/600 updates (40%), 1m12s elapsed, ETA 1m48s

At most one line per `LGRPO_PROGRESS_EVERY_S` seconds (default 20; 0 prints every update), plus the last. Lines go
to stderr (the CLI's rich display prints them above its bar on a terminal) and, inside a Prefect task, to the task's
run logger at INFO, so the UI shows them too. Torch-free."""

from __future__ import annotations

import logging
import os
import sys
import time


def _fmt(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class Progress:
    def __init__(self, label: str, total: int, unit: str, every_s: float | None = None, clock=time.monotonic):
        self.label, self.total, self.unit, self.clock = label, max(int(total), 1), unit, clock
        self.every_s = float(os.environ.get("LGRPO_PROGRESS_EVERY_S", "20")) if every_s is None else every_s
        self.t0 = self.last = clock()
        self.done = 0
        self.lines: list[str] = []

    def line(self, now: float | None = None) -> str:
        el = (self.clock() if now is None else now) - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        pct = 100 * self.done // self.total
        tail = f", ETA {_fmt(eta)}" if 0 < self.done < self.total else ""
        return f"{self.label}: {self.done}/{self.total} {self.unit} ({pct}%), {_fmt(el)} elapsed{tail}"

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        now = self.clock()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            self._emit(self.line(now))

    def finish(self) -> None:
        """Work that ended early (every episode done before the last turn): the closing line, as complete."""
        if self.done < self.total:
            self.update(self.total - self.done)

    def _emit(self, text: str) -> None:
        self.lines.append(text)
        # sys.stderr.write, not print: flows with log_prints=True turn print() (to stdout or stderr) into INFO records
        # of the run logger, which the CLI's console shows only with -v
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        task_log(logging.INFO, text)


def warn(logger, text: str) -> None:
    """A warning in `logger` and in the running Prefect task's log."""
    logger.warning(text)
    task_log(logging.WARNING, text)


def task_log(level: int, text: str) -> None:
    """Also log `text` to the running Prefect task's log (the UI shows it); nothing outside a task."""
    try:
        from prefect.context import TaskRunContext
        from prefect.logging import get_run_logger
    except ImportError:  # Prefect is optional for the stages
        return
    if TaskRunContext.get() is not None:
        get_run_logger().log(level, text)
