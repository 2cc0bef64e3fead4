"""Kill windows (stages/faults.py), the soak drill's way to kill a run inside a phase at a random moment: the signal
comes after the delay while the stage runs, or as the stage ends when it ends sooner; another step or stage is
left alone; without `@` nothing changes for a stage function."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CODE = textwrap.dedent('''
    import sys, time
    from stages import faults

    @faults.kill_window("optimize")
    def optimize(run_dir, step, x=1):
        time.sleep(float(sys.argv[1]))

    @faults.kill_window("checkpoint")
    def verify_checkpoint(run_dir, adapter):
        pass

    optimize("run", 3)
    verify_checkpoint("run", "a")
    print("survived", flush=True)
''')


@pytest.mark.parametrize("spec, sleep, rc", [
    ("optimize:3@0.2", 3.0, -signal.SIGKILL),   # during the stage
    ("optimize:3@30", 0.1, -signal.SIGKILL),    # the stage ended first: at its end
    ("optimize:3:TERM@0.1", 3.0, -signal.SIGTERM),
    ("checkpoint:final@0", 0.0, -signal.SIGKILL),
    ("optimize:2@0", 0.0, 0),                   # another step
    ("optimize:31@0", 0.0, 0),                  # a step number that only starts with 3
    ("optimize:3", 0.0, 0),                     # no window: maybe_kill's points only
])
def test_kill_window(spec, sleep, rc):
    env = {**os.environ, "LGRPO_KILL_AT": spec, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CODE, str(sleep)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == rc, (spec, out.returncode, out.stderr[-2000:])
    assert ("survived" in out.stdout) == (rc == 0)
