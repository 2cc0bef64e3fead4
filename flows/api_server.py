"""The Prefect API server of one CLI run, as a child that dies with it.

When PREFECT_API_URL is unset, Prefect starts a temporary API server for the process (`SubprocessASGIServer`) that
outlives a SIGKILLed parent (one ~200 MB orphan per killed run). `lgrpo train` / `lgrpo rerun` instead start the
same app (Prefect's `create_app`, UI off, as the temporary server runs it; a 503 for a locked SQLite database asks
for a short retry, see RetrySoonWhenLocked) here, in a child that

* asks the kernel for a signal when its parent dies (Linux PR_SET_PDEATHSIG), and also watches its parent pid
  (any POSIX), so it stops, and removes its scratch folder, whatever kills the run;
* binds a free port itself (no collision with a leftover of an older run) and reports it through a file;

and point PREFECT_API_URL at it for the run. A user's own server (PREFECT_API_URL set) is used as it is.

If that child dies while the run goes on (killed, out of memory), Prefect can no longer record states: its client
retries, logs an event error every few seconds and the run stalls. The CLI process instead prints one line saying
so and how to resume, and exits with status 75 (EX_TEMPFAIL) at once; every finished stage is in the run directory,
so the same command resumes (bench/soak.py drills this).

    python -m flows.api_server --parent-pid PID --port-file PATH
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


def _die_with_parent(parent_pid: int, on_gone) -> None:
    """on_gone() runs once the parent is gone: at once on Linux (the kernel sends SIGUSR1 at the parent's death),
    else within 0.5 s (a watch on the parent pid); 5 s later the process exits whatever the app is doing."""
    fired = threading.Event()

    def fire(*_) -> None:
        if not fired.is_set():
            fired.set()
            on_gone()

    signal.signal(signal.SIGUSR1, fire)  # not SIGTERM: uvicorn re-raises that one after its shutdown, skipping ours
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)

    def watch() -> None:
        while os.getppid() == parent_pid and not fired.is_set():
            time.sleep(0.5)
        if not fired.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs in the main thread
        time.sleep(5)
        os._exit(0)  # the app did not stop in time

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def listening_socket():
    """The server's socket on a free local port. Accepted connections inherit TCP_NODELAY: without it each small
    response on a kept-alive connection waited ~40 ms for the client's delayed ACK (Nagle), and a step makes ~10 such
    calls in a row (bench/trl_compare.py: GET /health 44 -> 2 ms)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RetrySoonWhenLocked:
    """ASGI middleware: a 503 from Prefect's server gets a short, escalating `Retry-After`.

    Prefect's server answers 503 when SQLite reports the database locked (SQLITE_BUSY / SQLITE_BUSY_SNAPSHOT): most
    often its own event persister committed a batch of events between a request's read and its write. Prefect's
    client then waits 2**attempt seconds (about 2 s for the first retry) unless the response says `Retry-After`.
    Here that was one 2-s stall every 5-30 step flows (bench/trl_compare.py), for a conflict that clears as soon as
    the other write commits. So a 503 after a successful response asks for a retry after `first` seconds, and each
    further 503 before the next success for `factor` times longer (0.05, 0.2, 0.8, 3.2, 12.8 s: a lock that lasts
    still gets the client's retries spread over ~17 s). A 503 that already names a Retry-After is left as it is."""

    def __init__(self, app, first: float = 0.05, factor: float = 4.0, cap: float = 30.0):
        self.app, self.first, self.factor, self.cap = app, first, factor, cap
        self.streak = 0  # 503s since the last other response

    def delay(self) -> float:
        d = min(self.cap, self.first * self.factor ** self.streak)
        self.streak += 1
        return d

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start":
                if message["status"] == 503:
                    headers = list(message.get("headers", []))
                    if not any(k.lower() == b"retry-after" for k, _ in headers):
                        headers.append((b"retry-after", f"{self.delay():.3f}".encode()))
                        message = {**message, "headers": headers}
                else:
                    self.streak = 0
            await send(message)

        return await self.app(scope, receive, send_with_retry_after)


def create_app():
    """Prefect's API app (`prefect.server.api.server.create_app`, as its temporary server runs it) behind
    RetrySoonWhenLocked (`LGRPO_API_RETRY_SOON=0`: Prefect's app alone, for bench/subflow_overhead.py)."""
    from prefect.server.api.server import create_app as prefect_app

    app = prefect_app()
    return app if os.environ.get("LGRPO_API_RETRY_SOON", "1") == "0" else RetrySoonWhenLocked(app)


def server_loop() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser for the run's server: its "auto" (uvloop and httptools, project
    dependencies, where they import) unless `LGRPO_API_LOOP=asyncio` forces asyncio and h11 (bench/subflow_overhead.py).

    Every request of a step flow waits on this one loop: Prefect's handlers hop to aiosqlite's thread and back for
    each SQL statement, and the loop also runs the server's services (task-run recorder, event persister). On uvloop
    an empty step subflow took a median 0.098 s against 0.107 s on asyncio (bench/subflow_overhead.py, 2-core machine)."""
    return ("asyncio", "h11") if os.environ.get("LGRPO_API_LOOP", "auto") == "asyncio" else ("auto", "auto")


def serve(parent_pid: int, port_file: Path) -> int:
    import uvicorn
    from prefect.settings import get_current_settings

    Path(get_current_settings().home).mkdir(parents=True, exist_ok=True)  # its SQLite database lives there

    sock = listening_socket()
    port = sock.getsockname()[1]
    loop, http = server_loop()
    config = uvicorn.Config("flows.api_server:create_app", factory=True, host="127.0.0.1", port=port,
                            log_level="error", lifespan="on", loop=loop, http=http)
    server = uvicorn.Server(config)

    def gone() -> None:
        print(f"flows.api_server: parent {parent_pid} is gone; stopping", file=sys.stderr, flush=True)
        _forget(port_file)  # nobody else is left to remove the scratch folder
        server.should_exit = True

    _die_with_parent(parent_pid, gone)
    tmp = port_file.with_name(port_file.name + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)
    server.run(sockets=[sock])
    return 0


def _forget(port_file: Path) -> None:
    import shutil

    shutil.rmtree(port_file.parent, ignore_errors=True)


@contextmanager
def api_server(timeout_s: float | None = None):
    """PREFECT_API_URL for the duration of a CLI command: the user's, or a child server started here (stopped at
    the end, and dead with this process whatever ends it). Yields the URL."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    import tempfile

    timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
    work = Path(tempfile.mkdtemp(prefix="lgrpo-prefect-api-"))
    port_file, log = work / "port", work / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.api_server", "--parent-pid", str(os.getpid()),
                                 "--port-file", str(port_file)], cwd=Path(__file__).resolve().parents[1],
                                env={**os.environ, **SERVER_ENV}, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    stopping = threading.Event()
    try:
        url = _wait_ready(proc, port_file, log, timeout_s)
        threading.Thread(target=_exit_if_server_dies, args=(proc, stopping, work, log), daemon=True,
                         name="lgrpo-api-watch").start()
        os.environ["PREFECT_API_URL"] = url  # before prefect's first import in this process, and for children
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: url}):  # if prefect was imported already
            yield url
    finally:
        stopping.set()
        _drain_prefect()  # while the server still answers: else the exit waits on retries against a closed port
        os.environ.pop("PREFECT_API_URL", None)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


EXIT_SERVER_DIED = 75  # EX_TEMPFAIL: the same command resumes


def _exit_if_server_dies(proc: subprocess.Popen, stopping: threading.Event, work: Path, log: Path) -> None:
    """Wait for the API server child; if it ends before the run does, say so and end this process now."""
    code = proc.wait()
    if stopping.is_set():
        return
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    tail = log.read_bytes()[-400:].decode("utf-8", "replace").strip().splitlines()[-1:] if log.exists() else []
    print(f"lgrpo: the run's Prefect API server (pid {proc.pid}) {how}"
          f"{' (' + tail[0].strip() + ')' if tail else ''}; Prefect cannot record this run any more, so it stops "
          "here. Every finished stage is stored in the run directory: run the same command again to resume.",
          file=sys.stderr, flush=True)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    os._exit(EXIT_SERVER_DIED)  # children (tool server, workers) end with this process (their parent watch)


def _drain_prefect(timeout_s: float = 10.0) -> None:
    """Send the logs and events Prefect still holds (a stopped run's crash reports) to the server now."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def _wait_ready(proc: subprocess.Popen, port_file: Path, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if port_file.exists():
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/api"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return url
            except OSError:
                pass
        time.sleep(0.2)
    code = proc.poll()
    if code is None:
        proc.kill()
        proc.wait()
    tail = log.read_bytes()[-3000:].decode("utf-8", "replace") if log.exists() else ""
    why = f"exited with code {code}" if code is not None else f"did not answer within {timeout_s:g} s"
    raise RuntimeError(f"the run's Prefect API server {why} (log {log}):\n{tail}\nRaise "
                       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a slow machine, or point PREFECT_API_URL "
                       "at a running server (prefect server start)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.api_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--port-file", type=Path, required=True)
    a = p.parse_args(argv)
    return serve(a.parent_pid, a.port_file)


if __name__ == "__main__":
    sys.exit(main())
