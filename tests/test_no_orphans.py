"""A SIGKILLed run leaves no process behind: the run's Prefect API server (flows/api_server.py) and the tool server
(gyms/server.py) die with the CLI, whichever phase it was killed in (the bootstrap; a step's replay), and their
scratch folders go with them. Processes are found by session: the CLI runs in a session of its own, so every
process it started carries its session id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]


def _session_members(sid: int) -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux) to list a session")
@pytest.mark.parametrize("kill_at", ["bootstrap:0", "replay:1"])
def test_a_killed_run_leaves_no_process_behind(tmp_path, kill_at):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", LGRPO_KILL_AT=kill_at,
               TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    sets = [a for k, v in {**SMALL, "steps.pattern": "[fresh]"}.items() for a in ("--set", f"{k}={v}")]
    with open(tmp_path / "out", "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "lgrpo_cli", "train", "--run-dir", str(tmp_path / "run"),
                              "--steps", "2", *sets], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        assert p.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "out").read_text()[-3000:]
        deadline = time.monotonic() + 10
        while _session_members(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _session_members(p.pid)
        assert not left, f"processes of the killed run still alive 10 s later: {left}"
        left = [p.name for pat in ("lgrpo-prefect-api-*", "gym-tool-server-*") for p in (tmp_path / "tmp").glob(pat)]
        assert not left, f"scratch folders of the run's servers are left: {left}"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # never leak into the rest of the suite
        except ProcessLookupError:
            pass
