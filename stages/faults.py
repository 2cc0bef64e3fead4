"""Crash injection for recovery tests: `LGRPO_KILL_AT=<stage>:<step>` SIGKILLs this process inside that stage;
`<stage>:<step>:TERM` (or `:INT`) sends SIGTERM (SIGINT) instead, as `kill` or Ctrl-C would, after writing the time
to the file LGRPO_KILL_MARK names (when set), so a test can time the exit.

Unset in normal runs (the check is one environment lookup). Used by tests/test_rerun.py to prove that a run
killed mid-stage resumes from its artifacts with the same result as an uninterrupted run, and by
tests/test_no_orphans.py to prove that no process a killed run started survives it. Kill points: `replay:<step>`,
`bootstrap:0` (after the first supervised round of the bootstrap), `generate-turn:<step>` (after the thoughts and
answers, before the turn table; a pool worker gets it through `LGRPO_WORKER_KILL_AT=<rank>:generate-turn:<step>`,
on its first start only, engine/pool.py).

Kill windows (drills, bench/soak.py): `LGRPO_KILL_AT=<stage>:<step>[:SIG]@<seconds>` sends the signal <seconds> after
that stage started, or as it ends when it ends sooner -- always inside the stage. Stages with a window:
`generate-turn`, `gym`, `replay`, `optimize`, `probe` (each with the step number) and `checkpoint:final` (the
end-of-run verified checkpoint).
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import threading


SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


def maybe_kill(stage: str, step: int) -> None:
    spec = os.environ.get("LGRPO_KILL_AT")
    if not spec or not spec.startswith(f"{stage}:{step}"):
        return
    rest = spec[len(f"{stage}:{step}"):]
    if rest not in ("", ":KILL", ":TERM", ":INT"):  # a window ("@<seconds>") is kill_window's
        return
    mark = os.environ.get("LGRPO_KILL_MARK")
    if mark:
        import time

        with open(mark, "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), SIGNALS[rest[1:] or "KILL"])


def _window(stage: str, step) -> tuple[str, float] | None:
    """(signal name, delay) when LGRPO_KILL_AT asks for a kill window in this stage and step, else None."""
    spec = os.environ.get("LGRPO_KILL_AT", "")
    head, at, delay = spec.partition("@")
    if not at or not head.startswith(f"{stage}:{step}"):
        return None
    rest = head[len(f"{stage}:{step}"):]
    if rest not in ("", ":KILL", ":TERM", ":INT"):
        return None
    return rest[1:] or "KILL", float(delay)


def kill_window(stage: str):
    """Decorator for a stage function with a `step` argument (or none: step `final`): the kill window above."""

    def wrap(fn):
        sig_of = inspect.signature(fn)
        takes_step = "step" in sig_of.parameters

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if "@" not in os.environ.get("LGRPO_KILL_AT", ""):  # normal runs: one lookup
                return fn(*args, **kwargs)
            step = sig_of.bind_partial(*args, **kwargs).arguments.get("step", "final") if takes_step else "final"
            w = _window(stage, step)
            if w is None:
                return fn(*args, **kwargs)
            sig, delay = w
            fired = threading.Event()

            def fire() -> None:
                if not fired.is_set():
                    fired.set()
                    os.kill(os.getpid(), SIGNALS[sig])

            timer = threading.Timer(delay, fire)
            timer.daemon = True
            timer.start()
            try:
                return fn(*args, **kwargs)
            finally:  # the stage ended before the delay: the kill still lands inside it
                timer.cancel()
                fire()

        return inner

    return wrap
