"""The HTTP tool server: a ``ToolService`` behind a small JSON API on 127.0.0.1, with optional fault injection.

Endpoints (JSON bodies; every error is a JSON object ``{"error": "..."}``)::

    POST /v1/call   {"episode", "call_id", "name", "arguments"[, "context"]} -> {"observation", "is_error", "replayed"}
    POST /v1/seal   {"episode"}                                  -> {"entries": [...]}
    POST /v1/forget {"episode"}                                  -> {"ok": true}
    GET  /v1/tools                                               -> {"tools": [schema, ...]}
    GET  /v1/health                                              -> {"ok": true, "tools": [...], "requests": n, ...}
    GET  /v1/faults                                              -> {"faults": [{"request_id", "kind", ...}, ...]}

``context`` (optional, an object) is the episode's data that a tool declared with ``takes_context`` reads, sent by
the gym with every call so the server keeps no per-episode state beyond its idempotency store (the table gym sends
its task's table). A bad request (not JSON, a missing or mistyped field, a body over ``max_body_bytes``) is answered 400 saying what
was wrong; an unknown path 404; a call on a sealed episode 409. Calls are idempotent by ``(episode, call_id)``
(see ``gyms.service``), so a client may retry any call whose reply it did not get.

Fault injection (tests, drills): ``FaultConfig`` decides per request, deterministically from ``(seed, request id)``
(the client's ``X-Request-Id: {episode}/{call_id}/{attempt}`` header), whether to inject one of

* ``latency``   sleep ``latency_s`` (below the client's timeout), then answer normally;
* ``http_5xx``  answer 503 or 500 without executing;
* ``timeout``   execute, then sleep ``timeout_s`` (past the client's timeout) before answering: the retry must be
                served from the idempotency store;
* ``reset``     close the connection abruptly (SO_LINGER 0: an RST), no response, nothing executed;
* ``refused``   close the listening socket for ``refuse_s`` (connections then get a real ECONNREFUSED), re-bind the
                same port; the current connection is reset too. The port is shared by every client, so windows are
                at least ``refuse_gap_s`` apart (a refused draw in the gap only resets its connection; the fault log
                says which);
* ``malformed`` execute, then answer 200 with a truncated / garbage / incomplete JSON body.

Faults apply to ``/v1/call`` and ``/v1/seal`` only, after the request was validated. Every injected fault is
appended to the fault log (memory, and a JSONL file when given).

Run it as a process: ``python -m gyms.server --tools MODULE:FACTORY [--options JSON] [--port-file PATH] ...``
(``FACTORY(**options).server_tools()`` gives the tools), or from Python with ``gyms.launcher.start_tool_server``.
A demo tool set for tests and drills: ``gyms.demo_tools:DemoTools``. Pure stdlib.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gyms.service import CallConflict, ToolService
from gyms.tools import Tool
from gyms.trace import TraceError

FAULT_KINDS = ("latency", "http_5xx", "timeout", "reset", "refused", "malformed")
FAULTABLE_PATHS = ("/v1/call", "/v1/seal")
MAX_BODY_BYTES = 1 << 20
_DRAIN_LIMIT = 16 << 20  # an oversized body is read and dropped up to this size so the 400 reaches the client
REPO_ROOT = Path(__file__).resolve().parents[1]
SCRATCH_PREFIX = "gym-tool-server-"  # the launcher's scratch folder of one server (gyms/launcher.py)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# --------------------------------------------------------------------------------------------------------------
# Fault injection
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultConfig:
    """Which faults to inject, how often, and how long the timing faults last (see the module docstring)."""

    rate: float = 0.2
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    latency_s: float = 0.2  # below the client's timeout
    timeout_s: float = 6.0  # past the client's timeout (HttpToolClient's default is 5 s)
    refuse_s: float = 0.2  # how long the port refuses connections
    refuse_gap_s: float = 1.0  # at least this long between two refusal windows

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"FaultConfig.rate must be in [0, 1], got {self.rate!r}")
        if not self.kinds:
            raise ValueError("FaultConfig.kinds must name at least one fault kind")
        unknown = [k for k in self.kinds if k not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"FaultConfig.kinds: unknown {unknown} (known: {', '.join(FAULT_KINDS)})")
        for name in ("latency_s", "timeout_s", "refuse_s", "refuse_gap_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"FaultConfig.{name} must be >= 0")

    def draw(self, request_id: str) -> tuple[str | None, int]:
        """The fault (or None) for a request, and a variant number; a pure function of (seed, request id)."""
        digest = hashlib.sha256(f"{self.seed}\0{request_id}".encode("utf-8", "surrogatepass")).digest()
        u = int.from_bytes(digest[:8], "big") / 2.0**64
        if u >= self.rate:
            return None, 0
        kind = self.kinds[int.from_bytes(digest[8:16], "big") % len(self.kinds)]
        return kind, digest[16]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kinds": list(self.kinds)}


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128
    tool_server: "ToolServer"

    def handle_error(self, request: Any, client_address: Any) -> None:  # a handler bug: log, keep serving
        sys.stderr.write(f"tool server: error serving {client_address}:\n{traceback.format_exc()}")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "gym-tool-server/1"
    protocol_version = "HTTP/1.0"  # one request per connection

    def setup(self) -> None:
        self.timeout = self.server.tool_server.read_timeout_s
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # no per-request log lines; errors go to stderr through handle_error / _reply

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's errors (unparsable request line, unsupported method, header too long) as JSON too."""
        if self.request_version == "HTTP/0.9":  # not supported: answer with a status line anyway
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        self._error(code, f"{text}: {explain}" if explain else text)

    # -- plumbing -------------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:  # the client went away (it timed out): nothing to answer
            self.close_connection = True

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode("ascii"))

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _abort_connection(self) -> None:
        """Tear the connection down with an RST (SO_LINGER 0), sending nothing."""
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        for f in (self.rfile, self.wfile):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.connection.close()  # the last reference: the kernel sends RST now
        except OSError:
            pass
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # what the stdlib still flushes and closes after us
        self.close_connection = True

    def _read_body(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            raise _BadRequest(411, "chunked bodies are not supported: send Content-Length")
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            raise _BadRequest(411, "Content-Length is required")
        try:
            length = int(raw_length)
            if length < 0:
                raise ValueError
        except ValueError:
            raise _BadRequest(400, f"Content-Length must be a non-negative integer, got {raw_length[:32]!r}") from None
        limit = self.server.tool_server.max_body_bytes
        if length > limit:
            remaining = min(length, _DRAIN_LIMIT)
            try:
                while remaining > 0:  # drain so the client, still sending, reads our answer instead of an RST
                    chunk = self.rfile.read(min(remaining, 1 << 16))
                    if not chunk:
                        break
                    remaining -= len(chunk)
            except OSError:
                pass
            raise _BadRequest(400, f"request body too large ({length} bytes, max {limit})")
        try:
            body = self.rfile.read(length) if length else b""
        except TimeoutError:
            raise _BadRequest(408, f"timed out reading the request body ({length} bytes announced)") from None
        if len(body) < length:
            raise _BadRequest(400, f"request body truncated ({len(body)} of {length} bytes)")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadRequest(400, f"request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not text.strip():
            raise _BadRequest(400, "request body is empty: expected a JSON object")
        try:
            payload = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise _BadRequest(400, f"request body is not valid JSON ({exc.msg} at char {exc.pos})") from None
        except ValueError as exc:  # NaN / Infinity, an integer with too many digits
            raise _BadRequest(400, f"request body is not valid JSON ({str(exc)[:80]})") from None
        except RecursionError:
            raise _BadRequest(400, "request body JSON is nested too deeply") from None
        if not isinstance(payload, dict):
            raise _BadRequest(400, f"request body must be a JSON object, got {type(payload).__name__}")
        return payload

    # -- routing --------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        ts = self.server.tool_server
        path = self.path.split("?", 1)[0]
        if path == "/v1/health":
            self._json(200, ts.health())
        elif path == "/v1/tools":
            self._json(200, {"tools": ts.service.schemas()})
        elif path == "/v1/faults":
            self._json(200, {"faults": ts.faults_log()})
        elif path in ("/v1/call", "/v1/seal", "/v1/forget"):
            self._error(405, f"{path} takes POST")
        else:
            self._error(404, f"no such endpoint: GET {path[:100]}")

    def do_POST(self) -> None:  # noqa: N802
        ts = self.server.tool_server
        path = self.path.split("?", 1)[0]
        request_id = self.headers.get("X-Request-Id") or ts.anonymous_request_id()
        route = _ROUTES.get(path)
        try:
            if route is None:
                try:
                    self._read_body()  # consume it: an unread body would turn our answer into an RST
                except _BadRequest:
                    pass
                if path in ("/v1/health", "/v1/tools", "/v1/faults"):
                    raise _BadRequest(405, f"{path} takes GET")
                raise _BadRequest(404, f"no such endpoint: POST {path[:100]}")
            validate, method = route
            args = validate(self._read_body())
        except _BadRequest as exc:
            ts.count_request("rejected")
            self._error(exc.status, exc.message)
            return
        ts.count_request(path)
        kind, variant = (None, 0)
        if ts.faults is not None and path in FAULTABLE_PATHS:
            kind, variant = ts.faults.draw(request_id)
        self._serve(getattr(self, method), args, path, request_id, kind, variant)

    def _serve(self, route: Any, args: dict[str, Any], path: str, request_id: str, kind: str | None,
               variant: int) -> None:
        ts = self.server.tool_server
        faults = ts.faults
        if kind is not None:
            detail = {"http_5xx": f"status {503 if variant % 2 else 500}", "malformed": f"variant {variant % 3}"}
            if kind == "refused":  # close the port first, so the client's retry can meet it closed
                opened = ts.refuse_connections(faults.refuse_s, faults.refuse_gap_s)
                detail[kind] = f"port closed for {faults.refuse_s:g}s" if opened else \
                    "connection reset only (within refuse_gap_s of the last window)"
            ts.record_fault(request_id, kind, path, detail.get(kind, ""))
        if kind == "latency":
            time.sleep(faults.latency_s)
        elif kind == "http_5xx":
            status = 503 if variant % 2 else 500
            self._error(status, f"injected fault: http {status} for request {request_id}")
            return
        elif kind in ("reset", "refused"):
            self._abort_connection()
            return
        try:
            status, reply = route(**args)
        except _BadRequest as exc:
            self._error(exc.status, exc.message)
            return
        except Exception as exc:  # a tool bug: 500 (retryable), with the reason
            sys.stderr.write(f"tool server: {path} {request_id} failed:\n{traceback.format_exc()}")
            self._error(500, f"internal error in {path}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        body = json.dumps(reply).encode("ascii")  # ASCII: any text, lone surrogates included, survives
        if kind == "timeout":
            time.sleep(faults.timeout_s)
        elif kind == "malformed":
            v = variant % 3
            if v == 0:
                body = body[: max(1, len(body) // 2)]  # truncated JSON
            elif v == 1:
                body = b"<html><body>502 Bad Gateway</body></html>"
            else:
                body = b'{"ok": true}'  # valid JSON without the fields the client needs
        self._send(status, body)

    # -- endpoints (each with a validator run before faults are drawn) ----------------------------------------

    def _call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
              context: dict[str, Any] | None = None) -> tuple[int, Any]:
        try:
            return 200, self.server.tool_server.service.call(episode, call_id, name, arguments, context)
        except (TraceError, CallConflict) as exc:  # a sealed episode, or a call id reused for another call
            raise _BadRequest(409, str(exc)) from None

    def _seal(self, episode: str) -> tuple[int, Any]:
        return 200, {"entries": self.server.tool_server.service.seal(episode)}

    def _forget(self, episode: str) -> tuple[int, Any]:
        self.server.tool_server.service.forget(episode)
        return 200, {"ok": True}


def _validator(fields: dict[str, type], optional: dict[str, type] | None = None) -> Any:
    optional = optional or {}

    def validate(payload: dict[str, Any]) -> dict[str, Any]:
        for key, typ in optional.items():
            if key in payload and not isinstance(payload[key], typ):
                want = {str: "a string", dict: "an object"}[typ]
                raise _BadRequest(400, f"field {key!r} must be {want}, got {type(payload[key]).__name__}")
        for key, typ in fields.items():
            if key not in payload:
                raise _BadRequest(400, f"missing field {key!r} (required: {', '.join(fields)})")
            value = payload[key]
            if not isinstance(value, typ):
                want = {str: "a string", dict: "an object"}[typ]
                raise _BadRequest(400, f"field {key!r} must be {want}, got {type(value).__name__}")
            if typ is str and not value:
                raise _BadRequest(400, f"field {key!r} must be a non-empty string")
        extra = sorted(set(payload) - set(fields) - set(optional))
        if extra:
            raise _BadRequest(400, f"unexpected field(s) {[e[:32] for e in extra][:5]} "
                                   f"(allowed: {', '.join([*fields, *optional])})")
        return dict(payload)

    return validate


_ROUTES = {  # path -> (body validator, handler method)
    "/v1/call": (_validator({"episode": str, "call_id": str, "name": str, "arguments": dict}, {"context": dict}),
                 "_call"),
    "/v1/seal": (_validator({"episode": str}), "_seal"),
    "/v1/forget": (_validator({"episode": str}), "_forget"),
}


class ToolServer:
    """Serves a ``ToolService`` over HTTP from a background thread (``start``/``stop`` or a ``with`` block)."""

    def __init__(self, service: ToolService, host: str = "127.0.0.1", port: int = 0,
                 faults: FaultConfig | None = None, fault_log: str | Path | None = None, *,
                 max_body_bytes: int = MAX_BODY_BYTES, read_timeout_s: float = 10.0) -> None:
        self.service = service
        self.faults = faults if faults is not None and faults.rate > 0 else None
        self.fault_log_path = Path(fault_log) if fault_log is not None else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self._httpd = _HTTPServer((host, port), _Handler)  # binds now: the port is known before start()
        self._httpd.tool_server = self
        self.host, self.port = self._httpd.server_address[:2]
        self._faults: list[dict[str, Any]] = []
        self._stats = {"requests": 0, "by_path": {}}
        self._lock = threading.Lock()
        self._anon = 0
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._refuse_for: float | None = None
        self._refuse_closed = threading.Event()
        self._refuse_lock = threading.Lock()
        self._next_refusal_at = 0.0
        self._refuse_gap = 0.0
        self.refused_s = 0.0
        self._thread: threading.Thread | None = None
        self.refusals = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> "ToolServer":
        if self._thread is not None:
            raise RuntimeError("ToolServer.start: already started")
        self._thread = threading.Thread(target=self._serve_loop, name=f"tool-server:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._httpd.server_close()
        except OSError:
            pass
        for s in (self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> "ToolServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _serve_loop(self) -> None:
        """Accept connections (each served in its own thread); close and re-bind the port for a refusal window."""
        while not self._stopping.is_set():
            if self._refuse_for is not None:
                self._refusal_window(self._refuse_for)
                continue
            try:
                ready, _, _ = select.select([self._httpd.socket, self._wake_r], [], [], 0.5)
            except (OSError, ValueError):
                continue
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
            if self._httpd.socket in ready and self._refuse_for is None and not self._stopping.is_set():
                try:
                    conn, addr = self._httpd.socket.accept()
                except OSError:
                    continue
                try:
                    self._httpd.process_request(conn, addr)  # ThreadingMixIn: a thread per connection
                except (OSError, RuntimeError):  # no thread could be started for it
                    self._httpd.handle_error(conn, addr)
                    self._httpd.shutdown_request(conn)

    def _refusal_window(self, seconds: float) -> None:
        self._httpd.socket.close()  # connections now get ECONNREFUSED (and those still in the backlog an RST)
        closed_at = time.monotonic()
        self._refuse_closed.set()
        self._stopping.wait(seconds)
        delay = 0.01
        while not self._stopping.is_set():
            try:
                sock = socket.socket(self._httpd.address_family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
                sock.listen(self._httpd.request_queue_size)
            except OSError as exc:
                sock.close()
                sys.stderr.write(f"tool server: re-binding port {self.port} failed ({exc}); retrying\n")
                self._stopping.wait(delay)
                delay = min(1.0, delay * 2)
                continue
            self._httpd.socket = sock
            break
        with self._refuse_lock:
            self.refused_s += time.monotonic() - closed_at
            self._next_refusal_at = time.monotonic() + self._refuse_gap
            self._refuse_for = None
            self._refuse_closed = threading.Event()  # the next window's; waiters of this one see theirs set

    def refuse_connections(self, seconds: float, gap_s: float = 0.0) -> bool:
        """Close the listening socket for ``seconds`` (from a handler thread) and return once it is closed; or,
        within ``gap_s`` after the last window, do nothing and return False."""
        with self._refuse_lock:
            if self._refuse_for is None:
                if time.monotonic() < self._next_refusal_at:
                    return False
                self._refuse_for = seconds
                self._refuse_gap = gap_s
                self.refusals += 1
            closed = self._refuse_closed
        self._wake()
        closed.wait(timeout=2.0)
        return True

    # -- bookkeeping ----------------------------------------------------------------------------------------

    def anonymous_request_id(self) -> str:
        with self._lock:
            self._anon += 1
            return f"anonymous/{self._anon}"

    def count_request(self, path: str) -> None:
        """Count a POST by endpoint (``rejected``: answered 4xx before reaching one); ``requests`` counts the
        accepted /v1/call and /v1/seal requests (the ones faults are drawn for)."""
        with self._lock:
            if path in FAULTABLE_PATHS:
                self._stats["requests"] += 1
            self._stats["by_path"][path] = self._stats["by_path"].get(path, 0) + 1

    def record_fault(self, request_id: str, kind: str, path: str, detail: str = "") -> None:
        entry = {"request_id": request_id, "kind": kind, "path": path, "detail": detail, "time": time.time()}
        with self._lock:
            self._faults.append(entry)
            if self.fault_log_path is not None:
                with open(self.fault_log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry) + "\n")

    def faults_log(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(f) for f in self._faults]

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"ok": True, "tools": list(self.service.tools), "episodes": len(self.service.episodes()),
                    "requests": self._stats["requests"], "requests_by_path": dict(self._stats["by_path"]),
                    "faults": len(self._faults), "refusals": self.refusals,
                    "refused_s": round(self.refused_s, 3),
                    "fault_config": self.faults.to_dict() if self.faults is not None else None}


# --------------------------------------------------------------------------------------------------------------
# The process: CLI (the launcher is gyms/launcher.py)
# --------------------------------------------------------------------------------------------------------------


def load_tools(spec: str, options: dict[str, Any] | None = None) -> list[Tool]:
    """``MODULE:FACTORY`` -> ``FACTORY(**options).server_tools()``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--tools {spec!r}: expected MODULE:FACTORY, e.g. gyms.demo_tools:DemoTools")
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    provider = factory(**(options or {}))
    if not hasattr(provider, "server_tools"):
        raise TypeError(f"--tools {spec!r}: {type(provider).__name__} has no server_tools() method")
    tools = list(provider.server_tools())
    if not all(isinstance(t, Tool) for t in tools):
        raise TypeError(f"--tools {spec!r}: server_tools() must return Tool objects")
    return tools


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyms.server", description="Serve gym tools over HTTP.")
    p.add_argument("--tools", required=True, help="MODULE:FACTORY; FACTORY(**options).server_tools() -> tools")
    p.add_argument("--options", default="{}", help="JSON object of keyword arguments for FACTORY")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    p.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument("--fault-kinds", default=",".join(FAULT_KINDS), help="comma-separated subset of " +
                   ",".join(FAULT_KINDS))
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--fault-latency-s", type=float, default=FaultConfig.latency_s)
    p.add_argument("--fault-timeout-s", type=float, default=FaultConfig.timeout_s)
    p.add_argument("--fault-refuse-s", type=float, default=FaultConfig.refuse_s)
    p.add_argument("--fault-refuse-gap-s", type=float, default=FaultConfig.refuse_gap_s)
    p.add_argument("--fault-log", help="append injected faults here (JSONL)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--read-timeout-s", type=float, default=10.0)
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone (no orphaned servers)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError("must be a JSON object")
    except ValueError as exc:
        print(f"gyms.server: --options {args.options[:80]!r}: {exc}", file=sys.stderr)
        return 2
    faults = None
    if args.fault_rate > 0:
        kinds = tuple(k.strip() for k in args.fault_kinds.split(",") if k.strip())
        faults = FaultConfig(rate=args.fault_rate, kinds=kinds,
                             seed=args.fault_seed, latency_s=args.fault_latency_s, timeout_s=args.fault_timeout_s,
                             refuse_s=args.fault_refuse_s, refuse_gap_s=args.fault_refuse_gap_s)
    service = ToolService(load_tools(args.tools, options))
    server = ToolServer(service, args.host, args.port, faults, args.fault_log, max_body_bytes=args.max_body_bytes,
                        read_timeout_s=args.read_timeout_s)
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    if args.port_file:
        _atomic_write_text(Path(args.port_file), f"{server.port}\n")
    print(f"gyms.server: serving {', '.join(service.tools)} on {server.url} (pid {os.getpid()}, faults "
          f"{faults.to_dict() if faults else 'off'})", file=sys.stderr, flush=True)
    orphaned = False
    while not done.wait(0.5):
        if args.parent_pid is not None and os.getppid() != args.parent_pid:
            print(f"gyms.server: parent {args.parent_pid} is gone; stopping", file=sys.stderr, flush=True)
            orphaned = True
            break
    server.stop()
    print("gyms.server: stopped", file=sys.stderr, flush=True)
    if orphaned and args.port_file and Path(args.port_file).parent.name.startswith(SCRATCH_PREFIX):
        import shutil  # the launcher's scratch folder (port file, default log): nobody else is left to remove it

        shutil.rmtree(Path(args.port_file).parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
