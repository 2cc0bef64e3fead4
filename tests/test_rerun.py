"""Acceptance: SIGKILL a run in the middle of a step's replay, re-run the step from its artifacts, and get the same
result as an uninterrupted run with the same seed; stages finished before the kill come back Cached."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]


def _lgrpo(args: list[str], env: dict, logs: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the CLI in its own session; output goes to files. Whatever happens, the session is reaped at the end
    (the run's own servers die with it: tests/test_no_orphans.py)."""
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout", logs / "stderr"
    with out.open("w") as fo, err.open("w") as fe:
        p = subprocess.Popen([sys.executable, "-m", "lgrpo_cli", *args], cwd=ROOT, env=env, stdout=fo, stderr=fe,
                             text=True, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            try:  # reap the whole session, whatever a failure left
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())


def _tensors(path: Path):
    from artifacts import read_tensors

    return read_tensors(path)[0]


def test_sigkill_in_replay_then_rerun_matches_uninterrupted(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    sets = [a for k, v in {**SMALL, "steps.pattern": "[fresh]"}.items() for a in ("--set", f"{k}={v}")]

    ref = _lgrpo(["train", "--run-dir", str(tmp_path / "ref"), "--steps", "2", *sets], env, tmp_path / "log-ref")
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed = _lgrpo(["train", "--run-dir", str(tmp_path / "run"), "--steps", "2", *sets],
                    env | {"LGRPO_KILL_AT": "replay:1"}, tmp_path / "log-killed")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    run = tmp_path / "run"
    assert (run / "step-0001" / "rollouts.arrow").exists()
    assert not (run / "step-0001" / "replay.arrow").exists() and not (run / "step-0001" / "adapter").exists()

    again = _lgrpo(["rerun", "--run-dir", str(run), "--step", "1"], env, tmp_path / "log-rerun")
    assert again.returncode == 0, again.stderr[-3000:]
    states = json.loads(again.stdout[again.stdout.index("{"):])["task_states"]
    ran = {k: v for k, v in states.items() if v != "Cached"}
    # step 1 is the run's last step, so the teacher-forced probe runs after optimize
    assert ran == {"replay-1": "Completed", "optimize-1": "Completed", "probe-1": "Completed"}, states
    assert any(k.startswith("generate-turn-1-") for k in states) and "collect-rollouts-1" in states

    from artifacts import read_table

    for name in ("rollouts.arrow", "replay.arrow"):  # values bit for bit (metadata names run-specific paths)
        a, b = read_table(run / "step-0001" / name), read_table(tmp_path / "ref" / "step-0001" / name)
        assert a.replace_schema_metadata(None).equals(b.replace_schema_metadata(None)), name
    a = _tensors(run / "step-0001" / "adapter" / "adapter_model.safetensors")
    b = _tensors(tmp_path / "ref" / "step-0001" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "adapter after the re-run differs"
    oa, ob = _tensors(run / "step-0001" / "optimizer.safetensors"), _tensors(tmp_path / "ref" / "step-0001" / "optimizer.safetensors")
    assert all((oa[k] == ob[k]).all() for k in oa)

    # the same command again finishes the run without running the finished steps' flows again (a step flow's
    # publish rewrites its metrics.json): resuming costs nothing per finished step
    stamps = {s: (run / f"step-000{s}" / "metrics.json").stat().st_mtime_ns for s in (0, 1)}
    done = _lgrpo(["train", "--run-dir", str(run), "--steps", "2", *sets], env, tmp_path / "log-finish")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {s: (run / f"step-000{s}" / "metrics.json").stat().st_mtime_ns for s in (0, 1)} == stamps
    assert (run / "summary.json").exists()
    a2 = _tensors(run / "step-0001" / "adapter" / "adapter_model.safetensors")
    assert all((a2[k] == b[k]).all() for k in b)
