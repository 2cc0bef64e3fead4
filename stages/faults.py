"""Crash injection for recovery tests: `LGRPO_KILL_AT=<stage>:<step>` SIGKILLs this process inside that stage.

Unset in normal runs (the check is one environment lookup). Used by tests/test_rerun.py to prove that a run
killed mid-stage resumes from its artifacts with the same result as an uninterrupted run, and by
tests/test_no_orphans.py to prove that no process a killed run started survives it. Kill points: `replay:<step>`,
`bootstrap:0` (after the first supervised round of the bootstrap).
"""

from __future__ import annotations

import os
import signal


def maybe_kill(stage: str, step: int) -> None:
    if os.environ.get("LGRPO_KILL_AT") == f"{stage}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
