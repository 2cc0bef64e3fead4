"""Crash injection for recovery tests: `LGRPO_KILL_AT=<stage>:<step>` SIGKILLs this process inside that stage;
`<stage>:<step>:TERM` (or `:INT`) sends SIGTERM (SIGINT) instead, as `kill` or Ctrl-C would, after writing the time
to the file LGRPO_KILL_MARK names (when set), so a test can time the exit.

Unset in normal runs (the check is one environment lookup). Used by tests/test_rerun.py to prove that a run
killed mid-stage resumes from its artifacts with the same result as an uninterrupted run, and by
tests/test_no_orphans.py to prove that no process a killed run started survives it. Kill points: `replay:<step>`,
`bootstrap:0` (after the first supervised round of the bootstrap), `generate-turn:<step>` (after the thoughts and
answers, before the turn table; a pool worker gets it through `LGRPO_WORKER_KILL_AT=<rank>:generate-turn:<step>`,
on its first start only, engine/pool.py).
"""

from __future__ import annotations

import os
import signal


SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


def maybe_kill(stage: str, step: int) -> None:
    spec = os.environ.get("LGRPO_KILL_AT")
    if not spec or not spec.startswith(f"{stage}:{step}"):
        return
    rest = spec[len(f"{stage}:{step}"):]
    if rest not in ("", ":KILL", ":TERM", ":INT"):
        return
    mark = os.environ.get("LGRPO_KILL_MARK")
    if mark:
        import time

        with open(mark, "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), SIGNALS[rest[1:] or "KILL"])
