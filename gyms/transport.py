"""The retrying HTTP client of the tool server (``gyms.server``): a ``ToolClient`` whose every call has a timeout,
retries with exponential backoff and full jitter, and ends in a clear ``ToolTransportError`` once its budget is
spent (the run-gym task's Prefect retries then cover the whole turn).

Retried (the server's calls are idempotent by ``(episode, call_id)``, so a retry after a lost reply is replayed,
never recorded twice): connection refused / reset / closed, timeouts, HTTP 5xx and 429, a 200 whose body is not
JSON or lacks the required fields. Not retried: any other 4xx, raised as ``ValueError`` with the server's message.

Every failed attempt is recorded as ``{"request_id", "attempt", "kind", "detail", "elapsed_s", "backoff_s"}``
(``kind`` among refused, reset, closed, timeout, http_5xx, http_429, malformed, protocol, network; ``elapsed_s``
since the call started; ``backoff_s`` the sleep that followed it): in the returned ``ToolReply.attempts``, in the
client's in-memory ``journal`` and, when given, appended to ``journal_path`` (JSON Lines).

Pure stdlib; one short-lived ``http.client`` connection per attempt; thread-safe. ``timeout_s`` bounds the connect
and every read of an attempt (socket timeouts), not an attempt's total time: a server that trickles bytes can
stretch one attempt, which the tool server never does.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from gyms.service import ToolReply, ToolTransportError

_ID_SAFE = "-._~:@+=,!*()"  # characters kept as-is in request ids; anything else is %-escaped
_DETAIL_CHARS = 200


def request_id(*parts: Any) -> str:
    """``X-Request-Id`` of one attempt: the parts, each %-escaped (so ``/`` separates them unambiguously)."""
    return "/".join(quote(str(p), safe=_ID_SAFE) for p in parts)


class _Malformed(Exception):
    """A 200 response that is not usable (not JSON, wrong shape)."""


def _short(text: str) -> str:
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."


def _server_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("error"), str):
            return obj["error"]
    except (ValueError, RecursionError):
        pass
    return body[:_DETAIL_CHARS].decode("utf-8", "replace")


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _Malformed(f"HTTP 200 body is not valid JSON ({str(exc)[:80]}): {body[:60]!r}") from None


def _call_reply(body: bytes) -> dict[str, Any]:
    obj = _parse_json(body)
    if not isinstance(obj, dict):
        raise _Malformed(f"HTTP 200 body is {type(obj).__name__}, expected an object")
    for key, typ in (("observation", str), ("is_error", bool)):
        if not isinstance(obj.get(key), typ):
            raise _Malformed(f"HTTP 200 body lacks {key!r} ({typ.__name__}): {body[:80]!r}")
    if not isinstance(obj.get("replayed", False), bool):
        raise _Malformed("HTTP 200 body: 'replayed' is not a boolean")
    return obj


def _seal_reply(body: bytes) -> list[dict[str, Any]]:
    obj = _parse_json(body)
    entries = obj.get("entries") if isinstance(obj, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise _Malformed(f"HTTP 200 body lacks 'entries' (a non-empty list of objects): {body[:80]!r}")
    return entries


def _object_reply(body: bytes) -> dict[str, Any]:
    obj = _parse_json(body)
    if not isinstance(obj, dict):
        raise _Malformed(f"HTTP 200 body is {type(obj).__name__}, expected an object")
    return obj


def _parse_url(url: str) -> tuple[str, str, int, str]:
    """url, host, port, path prefix of a tool server's ``http://HOST:PORT[/prefix]``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"HttpToolClient: url must look like http://HOST:PORT, got {url!r}")
    return url.rstrip("/"), parts.hostname, parts.port or 80, parts.path.rstrip("/")


class HttpToolClient:
    """A ``ToolClient`` for the HTTP tool server at ``url`` (e.g. ``http://127.0.0.1:8731``)."""

    def __init__(self, url: str, timeout_s: float = 5.0, max_attempts: int = 6, backoff_base_s: float = 0.1,
                 backoff_max_s: float = 5.0, seed: int | None = None, journal_path: str | Path | None = None) -> None:
        self.url, self.host, self.port, self.prefix = _parse_url(url)
        if timeout_s <= 0 or max_attempts < 1 or backoff_base_s < 0 or backoff_max_s < 0:
            raise ValueError("HttpToolClient: timeout_s > 0, max_attempts >= 1 and backoffs >= 0 are required")
        self.timeout_s = float(timeout_s)
        self.max_attempts = int(max_attempts)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.journal_path = Path(journal_path) if journal_path is not None else None
        self.journal: list[dict[str, Any]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._serial = 0

    def retarget(self, url: str) -> None:
        """Point the client at another server (the run's restarted tool server); calls in flight keep the old one."""
        parsed = _parse_url(url)
        with self._lock:
            self.url, self.host, self.port, self.prefix = parsed

    # -- the ToolClient protocol ------------------------------------------------------------------------------

    def call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
             context: dict[str, Any] | None = None) -> ToolReply:
        return self.call_with_info(episode, call_id, name, arguments, context)[0]

    def call_with_info(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
                       context: dict[str, Any] | None = None) -> tuple[ToolReply, bool]:
        """``call``, plus whether the server replayed a stored reply (the call had been executed before)."""
        what = f"tool call {name!r} (episode {episode!r}, call_id {call_id!r})"
        payload = {"episode": episode, "call_id": call_id, "name": name, "arguments": arguments}
        if context is not None:
            payload["context"] = context
        reply, attempts = self._request("POST", "/v1/call", payload, (episode, call_id), what, _call_reply)
        return ToolReply(reply["observation"], reply["is_error"], tuple(attempts)), bool(reply.get("replayed"))

    def seal(self, episode: str) -> list[dict[str, Any]]:
        entries, _ = self._request("POST", "/v1/seal", {"episode": episode}, (episode, "@seal"),
                                   f"seal of episode {episode!r}", _seal_reply)
        return entries

    # -- the rest of the API ----------------------------------------------------------------------------------

    def forget(self, episode: str) -> None:
        self._request("POST", "/v1/forget", {"episode": episode}, (episode, "@forget"),
                      f"forget of episode {episode!r}", _object_reply)

    def health(self, max_attempts: int | None = None) -> dict[str, Any]:
        return self._request("GET", "/v1/health", None, ("@health", self._next_serial()), "health check",
                             _object_reply, max_attempts)[0]

    def tools(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/tools", None, ("@tools", self._next_serial()), "tool listing",
                             _object_reply)[0]["tools"]

    # -- machinery ----------------------------------------------------------------------------------------------

    def _next_serial(self) -> int:
        with self._lock:
            self._serial += 1
            return self._serial

    def backoff(self, attempt: int) -> float:
        """Full jitter: ``uniform(0, min(backoff_max, base * 2 ** (attempt - 1)))`` after failed attempt ``attempt``."""
        cap = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** (attempt - 1))
        with self._lock:
            return self._rng.uniform(0.0, cap)

    def _record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.journal.append(entry)
            if self.journal_path is not None:
                with open(self.journal_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry) + "\n")

    def _once(self, method: str, path: str, body: bytes | None, rid: str) -> tuple[int, bytes, str | None]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            headers = {"X-Request-Id": rid, "Connection": "close", "Accept": "application/json"}
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, self.prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, data, resp.getheader("Retry-After")
        finally:
            conn.close()

    def _request(self, method: str, path: str, payload: Any, key: tuple[Any, ...], what: str,
                 parse: Callable[[bytes], Any], max_attempts: int | None = None) -> tuple[Any, list[dict[str, Any]]]:
        body = None if payload is None else json.dumps(payload).encode("ascii")
        budget = max_attempts or self.max_attempts
        attempts: list[dict[str, Any]] = []
        start = time.monotonic()
        for attempt in range(1, budget + 1):
            rid = request_id(*key, attempt)
            retry_after = None
            try:
                status, data, retry_after_header = self._once(method, path, body, rid)
            except ConnectionRefusedError as exc:
                kind, detail = "refused", f"{type(exc).__name__}: {exc}"
            except http.client.RemoteDisconnected as exc:  # before ConnectionResetError: it subclasses it
                kind, detail = "closed", f"{type(exc).__name__}: {exc}"
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
                kind, detail = "reset", f"{type(exc).__name__}: {exc}"
            except http.client.IncompleteRead as exc:
                kind, detail = "closed", f"IncompleteRead: {exc!r}"
            except TimeoutError as exc:
                kind, detail = "timeout", f"no reply within {self.timeout_s:g}s ({exc or 'timed out'})"
            except http.client.HTTPException as exc:
                kind, detail = "protocol", f"{type(exc).__name__}: {exc!r}"
            except OSError as exc:
                kind, detail = "network", f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    try:
                        return parse(data), attempts
                    except _Malformed as exc:
                        kind, detail = "malformed", str(exc)
                elif status == 429 or status >= 500:
                    kind = "http_429" if status == 429 else "http_5xx"
                    detail = f"HTTP {status}: {_server_message(data)}"
                    if retry_after_header is not None:
                        try:
                            retry_after = max(0.0, float(retry_after_header))
                        except ValueError:
                            pass
                elif 400 <= status < 500:
                    raise ValueError(f"{what} rejected by {self.url}: HTTP {status}: {_server_message(data)}")
                else:
                    kind, detail = "protocol", f"unexpected HTTP {status}: {_server_message(data)}"
            elapsed = time.monotonic() - start
            delay = 0.0
            if attempt < budget:
                delay = self.backoff(attempt)
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.backoff_max_s))
            entry = {"request_id": rid, "attempt": attempt, "kind": kind, "detail": _short(detail),
                     "elapsed_s": round(elapsed, 4), "backoff_s": round(delay, 4)}
            attempts.append(entry)
            self._record(entry)
            if delay > 0:
                time.sleep(delay)
        elapsed = time.monotonic() - start
        hits = "; ".join(f"#{a['attempt']} {a['kind']} ({a['detail']})" for a in attempts)
        hint = " - is the tool server running?" if all(a["kind"] == "refused" for a in attempts) else ""
        raise ToolTransportError(
            f"{what} via {self.url} failed after {len(attempts)} attempts in {elapsed:.2f}s "
            f"(timeout {self.timeout_s:g}s each, backoff base {self.backoff_base_s:g}s){hint}: {hits}",
            attempts,
        )
