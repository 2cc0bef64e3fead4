"""Progress lines of long work (issue 15: a run whose output goes to a file must not go quiet for minutes)."""

from __future__ import annotations

from artifacts.progress import Progress


def test_progress_lines_are_throttled_and_say_eta(capsys, monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 25.0, 60.0])
    p = Progress("bootstrap-base", 4, "updates", every_s=20, clock=lambda: next(clock))  # t0 = 0
    for _ in range(4):  # updates at 1 s and 5 s (throttled), 25 s (a line), the last at 60 s (always a line)
        p.update()
    assert p.lines == ["bootstrap-base: 3/4 updates (75%), 25s elapsed, ETA 8s",
                       "bootstrap-base: 4/4 updates (100%), 1m00s elapsed"]
    assert capsys.readouterr().err.splitlines() == p.lines


def test_bootstrap_prints_progress_when_its_output_is_a_file(tmp_path, monkeypatch, capfd):
    from tests.conftest import make_run

    monkeypatch.setenv("LGRPO_PROGRESS_EVERY_S", "0")
    make_run(tmp_path / "run")
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("bootstrap-base: ")]
    assert lines and "(100%)" in lines[-1], err[-2000:]
    n = int(lines[-1].split(": ")[1].split("/")[0])
    assert len(lines) == n and lines[0].startswith(f"bootstrap-base: 1/{n} updates")  # every update at 0 s


FLOW = """
from prefect import flow, task
from artifacts.progress import Progress

@task
def work():
    p = Progress("bootstrap-base", 2, "updates", every_s=0)
    p.update()
    p.update()

@flow(log_prints=True)
def run():
    work()

run()
"""


def test_progress_lines_reach_stderr_inside_a_flow_with_log_prints(tmp_path):
    """The train flow has log_prints=True, which turns print() into INFO log records the CLI hides without -v: the
    bootstrap ran four minutes without a line in README command 1's output until progress wrote to stderr itself.
    (A subprocess: Prefect binds its console handler to the stderr of the first flow run in a process.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    res = subprocess.run([sys.executable, "-c", FLOW], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.splitlines()  # as plain lines, not log records
    assert any(x.startswith("bootstrap-base: 1/2 updates (50%), ") for x in lines), res.stderr[-3000:]
    assert any(x.startswith("bootstrap-base: 2/2 updates (100%), ") for x in lines), res.stderr[-3000:]
