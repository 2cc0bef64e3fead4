"""The soak drill's 10-minute variant (bench/soak.py): the embedded default on HTTP tools with 10 % tool faults,
SIGKILLs of the training process in every phase, two tool-server kills, one Prefect API server kill and one
corrupted artifact, each time resumed with the README's command; the drill's own checks must all pass (every step
once in the histories, every artifact and trace verifies, every gate passed, the corrupted file named and rewritten
bit for bit, the adapter and optimizer state bit-identical to an uninterrupted run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the drill finds the run's helpers in /proc")
def test_soak_drill_ten_minute_variant(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LGRPO_KILL"))}
    (tmp_path / "tmp").mkdir()
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TMPDIR=str(tmp_path / "tmp"), LGRPO_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "bench/soak.py", "--minutes", "10", "--root", str(tmp_path / "soak"), "--steps", "16",
           "--ref-steps", "3", "--set", "bootstrap.episodes=64", "--set", "gym.eval_tasks=16"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    report = tmp_path / "soak" / "report.json"
    assert report.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(report.read_text())
    print(json.dumps({k: v for k, v in rep.items() if k != "events"}, indent=1))
    assert r.returncode == 0 and rep["passed"], r.stdout[-4000:]
    assert set(rep["kills_by_phase"]) == {"generate-turn", "gym", "replay", "optimize", "probe", "checkpoint"}
    assert rep["tool_faults"]["total"] > 0 and rep["corruption"]["bit_identical"]
