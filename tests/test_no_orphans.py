"""A killed run leaves nothing behind, and a stopped run stops promptly.

* SIGKILL: the run's Prefect API server (flows/api_server.py) and the tool server (gyms/server.py) die with the CLI,
  whichever phase it was killed in (the bootstrap; a step's replay), and their scratch folders go with them.
* SIGTERM (as `kill` or a scheduler sends it) in the bootstrap or in replay, or SIGINT (Ctrl-C) in replay: the CLI
  exits within 10 s, nothing of it stays alive, and the same command then resumes the run to a result
  bit-identical to an uninterrupted run.

Processes are found by session: the CLI runs in a session of its own, so every process it started carries its
session id. The signals are sent from inside the phase (stages/faults.py: LGRPO_KILL_AT), so they hit it for sure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


SETS = [a for k, v in {**SMALL, "steps.pattern": "[fresh]"}.items() for a in ("--set", f"{k}={v}")]
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux) to list a session")


def _env(d: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LGRPO_KILL"))}
    (d / "tmp").mkdir(exist_ok=True)
    env.update(PREFECT_HOME=str(d / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", TMPDIR=str(d / "tmp"), **extra)
    return env


def _as_in_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground process has it. A suite started in the
    background of a non-interactive shell (`./.ci/run &`) runs with SIGINT ignored -- POSIX shells do that to
    background jobs -- and the child would inherit it: Python then never raises KeyboardInterrupt, and the Ctrl-C case
    below saw the run finish (seen once, 2026-12-01)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train(run: Path, env: dict, log: Path, check_left: Path | None = None, extra: list[str] = ()) -> int:
    """`lgrpo train` of the small run in a session of its own; with check_left (its TMPDIR), assert that nothing
    of it is alive 10 s after it ended and that no server scratch folder is left there."""
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "lgrpo_cli", "train", "--run-dir", str(run), "--steps", "2",
                              *SETS, *extra], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_as_in_a_terminal)
    try:
        rc = p.wait(timeout=600)
        if check_left is not None:
            deadline = time.monotonic() + 10
            while _session_members(p.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = _session_members(p.pid)
            assert not left, f"processes of the run still alive 10 s after it ended: {left}"
            left = [f.name for pat in ("lgrpo-prefect-api-*", "gym-tool-server-*") for f in check_left.glob(pat)]
            assert not left, f"scratch folders of the run's servers are left: {left}"
        return rc
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # never leak into the rest of the suite
        except ProcessLookupError:
            pass


@needs_proc
@pytest.mark.parametrize("kill_at", ["bootstrap:0", "replay:1"])
def test_a_killed_run_leaves_no_process_behind(tmp_path, kill_at):
    # the research gym over gym.transport http: its tools run in the run's tool server, a second helper process
    # that must go too
    rc = _train(tmp_path / "run", _env(tmp_path, LGRPO_KILL_AT=kill_at), tmp_path / "out", check_left=tmp_path / "tmp",
                extra=["--config", "tiny-research", "--set", "gym.transport=http"])
    assert rc == -signal.SIGKILL, (tmp_path / "out").read_text()[-3000:]
    if kill_at.startswith("replay"):  # generation ran: the tool server was started (and is gone, checked above)
        assert list((tmp_path / "run" / "tool-server").iterdir()), "the run never started its tool server"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    rc = _train(d / "run", _env(d), d / "out")
    assert rc == 0, (d / "out").read_text()[-3000:]
    return d / "run"


@needs_proc
@pytest.mark.parametrize("stop_at", ["bootstrap:0:TERM", "replay:1:TERM", "replay:1:INT"])
def test_sigterm_stops_within_seconds_and_the_same_command_resumes_bit_identically(tmp_path, uninterrupted, stop_at):
    from artifacts import read_tensors

    mark = tmp_path / "signal-sent"
    rc = _train(tmp_path / "run", _env(tmp_path, LGRPO_KILL_AT=stop_at, LGRPO_KILL_MARK=str(mark)), tmp_path / "out",
                check_left=tmp_path / "tmp")
    took = time.time() - float(mark.read_text())
    assert rc != 0, "the run finished although it was stopped"
    assert took <= 10, f"{stop_at}: the CLI needed {took:.1f} s to exit"
    assert _train(tmp_path / "run", _env(tmp_path), tmp_path / "out-resumed") == 0, \
        (tmp_path / "out-resumed").read_text()[-3000:]
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors"):
        a, b = read_tensors(tmp_path / "run" / "step-0001" / name)[0], read_tensors(uninterrupted / "step-0001" / name)[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{name} differs after the resume"


@needs_proc
def test_a_dead_api_server_ends_the_run_with_one_line_and_the_same_command_resumes(tmp_path, uninterrupted):
    """The run's Prefect API server killed mid-run: Prefect could record nothing more and the run used to stall with
    an event error every 7 s. Now the CLI says so in one line, exits 75 at once, leaves nothing alive, and the same
    command completes the run to the uninterrupted result."""
    from artifacts import read_tensors

    env, run, log = _env(tmp_path), tmp_path / "run", tmp_path / "out"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "lgrpo_cli", "train", "--run-dir", str(run), "--steps", "2",
                              *SETS], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (run / "step-0000" / "adapter").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        servers = [pid for pid, cmd in _session_members(p.pid) if "flows.api_server" in cmd]
        assert servers, log.read_text()[-3000:]
        os.kill(servers[0], signal.SIGKILL)
        killed = time.monotonic()
        rc = p.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert rc == 75, text[-3000:]
    assert took <= 10, f"the CLI needed {took:.1f} s to stop after its API server died"
    lines = [x for x in text.splitlines() if x.startswith("lgrpo: the run's Prefect API server")]
    assert len(lines) == 1 and "run the same command again to resume" in lines[0], text[-3000:]
    time.sleep(1)
    assert not _session_members(p.pid), _session_members(p.pid)
    assert not list((tmp_path / "tmp").glob("lgrpo-prefect-api-*")), "the server's scratch folder is left"
    assert _train(run, _env(tmp_path), tmp_path / "out-resumed") == 0, (tmp_path / "out-resumed").read_text()[-3000:]
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors"):
        a, b = read_tensors(run / "step-0001" / name)[0], read_tensors(uninterrupted / "step-0001" / name)[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{name} differs after the resume"
