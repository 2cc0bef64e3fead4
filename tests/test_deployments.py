"""The deployments as users run them (issue 15): a local Prefect server on a free port, the process work pool,
`prefect deploy --all` from prefect.yaml, a worker, then `prefect deployment run` of `train` (2 small steps) and
of `rerun-stage`; both flow runs must complete, and the per-step timing artifacts must exist (read through the API)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SMALL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]

# run through the API from a separate process (this one may hold the Prefect test harness's settings)
WAIT = """
import json, sys, time
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
flow_run_id, timeout = sys.argv[1], float(sys.argv[2])
with get_client(sync_client=True) as c:
    deadline = time.monotonic() + timeout
    while True:
        fr = c.read_flow_run(flow_run_id)
        if fr.state is not None and fr.state.is_final() or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    keys = sorted({a.key for a in c.read_artifacts() if a.key})
    print(json.dumps({"state": fr.state.name if fr.state else None, "message": fr.state.message if fr.state else "",
                      "artifacts": keys}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict, timeout: float = 180) -> str:
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _flow_run_id(out: str) -> str:
    import re

    found = re.findall(r"UUID:\s*([0-9a-f-]{36})", out)
    assert found, out
    return found[0]


def _wait_ready(api: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the Prefect server did not answer within {timeout} s: {log.read_text()[-3000:]}")


def test_train_and_rerun_stage_deployments_run_through_a_worker(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_WORKER_PREFETCH_SECONDS": "1", "LGRPO_ROOT": str(ROOT), "LGRPO_CACHE_DIR": "off",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_PROFILES_PATH", None)
    procs = []
    try:
        slog, wlog = tmp_path / "server.log", tmp_path / "worker.log"
        procs.append(subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                       "--analytics-off"], cwd=ROOT, env=env, stdout=slog.open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        _wait_ready(api, procs[0], slog)
        _run([*PREFECT, "work-pool", "create", "lgrpo-process", "--type", "process"], env)
        _run([*PREFECT, "--no-prompt", "deploy", "--all"], env)
        procs.append(subprocess.Popen([*PREFECT, "worker", "start", "--pool", "lgrpo-process"], cwd=ROOT, env=env,
                                      stdout=wlog.open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        run_dir = tmp_path / "run"
        params = {"steps": 2, "run_dir": str(run_dir), "overrides": {**SMALL, "gates.probe_every": 1000}}
        out = _run([*PREFECT, "deployment", "run", "lgrpo-train/train", "--param", f"params={json.dumps(params)}"],
                   env)
        fr = _flow_run_id(out)
        res = json.loads(_run([sys.executable, "-c", WAIT, fr, "600"], env, timeout=660))
        assert res["state"] == "Completed", (res, wlog.read_text()[-4000:])
        assert {"step-0000-timings", "step-0001-timings", "run-curves"} <= set(res["artifacts"]), res["artifacts"]

        out = _run([*PREFECT, "deployment", "run", "lgrpo-rerun-stage/rerun-stage", "--param", f"run_dir={run_dir}",
                    "--param", "step=1"], env)
        fr = _flow_run_id(out)
        res = json.loads(_run([sys.executable, "-c", WAIT, fr, "300"], env, timeout=360))
        assert res["state"] == "Completed", (res, wlog.read_text()[-4000:])
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
