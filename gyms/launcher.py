"""Launch the tool server (``python -m gyms.server``) as a subprocess and hold its handle: ``start_tool_server``.

The child runs with a clean environment from the repo root, exits with its parent, and reports its port through a
file; ``ServerProcess`` stops it (SIGTERM, then SIGKILL) and reads its health and fault log. Pure stdlib.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gyms.server import MAX_BODY_BYTES, REPO_ROOT, SCRATCH_PREFIX, FaultConfig


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"


class ServerProcess:
    """A tool server running as a subprocess (see ``start_tool_server``)."""

    def __init__(self, proc: subprocess.Popen, port: int, host: str, log_path: Path, workdir: Path,
                 fault_log: Path | None) -> None:
        self.proc = proc
        self.port = port
        self.host = host
        self.log_path = log_path
        self.fault_log = fault_log
        self._workdir = workdir

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return _tail(self.log_path, n)

    def get(self, path: str, timeout_s: float = 5.0) -> Any:
        """GET a JSON endpoint once (no retries), e.g. ``get("/v1/faults")``."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def faults(self) -> list[dict[str, Any]]:
        return self.get("/v1/faults")["faults"]

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        shutil.rmtree(self._workdir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_tool_server(tools: str, options: dict[str, Any] | None = None, *, faults: FaultConfig | None = None,
                      fault_log: str | Path | None = None, log_path: str | Path | None = None,
                      host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 30.0,
                      max_body_bytes: int = MAX_BODY_BYTES, read_timeout_s: float = 10.0) -> ServerProcess:
    """Launch ``python -m gyms.server`` as a subprocess and wait until it listens; returns its handle.

    The child gets a clean environment (PATH; PYTHONPATH = the repo root, the inherited PYTHONPATH, the caller's
    cwd; locale, TMPDIR, HOME) and runs from the repo root; its stdout/stderr go to ``log_path`` (default: a temporary file). It exits when this
    process does. A child that dies or does not listen within ``ready_timeout_s`` raises RuntimeError with the
    tail of its log.
    """
    workdir = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    port_file = workdir / "port"
    log = Path(log_path) if log_path is not None else workdir / "server.log"
    cmd = [sys.executable, "-m", "gyms.server", "--tools", tools, "--options", json.dumps(options or {}),
           "--host", host, "--port", str(port), "--port-file", str(port_file), "--parent-pid", str(os.getpid()),
           "--max-body-bytes", str(max_body_bytes), "--read-timeout-s", str(read_timeout_s)]
    if faults is not None:
        cmd += ["--fault-rate", repr(faults.rate), "--fault-kinds", ",".join(faults.kinds),
                "--fault-seed", str(faults.seed), "--fault-latency-s", repr(faults.latency_s),
                "--fault-timeout-s", repr(faults.timeout_s), "--fault-refuse-s", repr(faults.refuse_s),
                "--fault-refuse-gap-s", repr(faults.refuse_gap_s)]
    if fault_log is not None:
        cmd += ["--fault-log", str(fault_log)]
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "SYSTEMROOT") if k in os.environ}
    env["PATH"] = env.get("PATH", os.defpath)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(REPO_ROOT), *inherited, os.getcwd()]  # the caller's cwd last: a factory importable there is here too
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    bound = None
    while time.monotonic() < deadline:
        if port_file.exists():
            bound = int(port_file.read_text().strip())
            break
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    if bound is None:
        code = proc.poll()
        if code is None:
            proc.kill()
            proc.wait()
            why = f"did not listen within {ready_timeout_s:g}s"
        else:
            why = f"exited with code {code} before listening"
        tail = _tail(log)
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"tool server ({tools}) {why}; log {log}:\n{tail}")
    return ServerProcess(proc, bound, host, log, workdir, Path(fault_log) if fault_log is not None else None)
