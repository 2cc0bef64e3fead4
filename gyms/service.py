"""The tool service: executes tool calls for episodes, idempotently, and keeps each episode's sealed trace.

It is the server side of tool use. ``LocalToolClient`` calls it in-process; ``gyms.transport.HttpToolClient``
calls the same service behind the HTTP tool server (``gyms.server``). A gym talks only to a ``ToolClient``.

Idempotency: a call is identified by ``(episode, call_id)``. Executing it again (a client retry after a lost
response, or the driver rebuilding an episode from its history) returns the stored reply and appends nothing to
the trace, so a retried call is never recorded twice.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gyms.tools import ERROR_PREFIX, Tool, ToolError, validate_arguments
from gyms.trace import Receipt, TraceRecorder, sha256_text


@dataclass(frozen=True)
class ToolOutput:
    """What a tool's callable may return instead of a plain string: the text the model sees plus receipts
    (provenance of the records it used), which go to the trace only."""

    text: str
    receipts: tuple[Receipt, ...] = ()


@dataclass(frozen=True)
class ToolReply:
    """One call's outcome as the gym sees it. ``attempts`` lists the transport failures that preceded it
    (each a dict with ``request_id``, ``attempt``, ``kind``, ``detail``, ``elapsed_s``, ``backoff_s``); empty for
    an in-process call."""

    observation: str
    is_error: bool
    attempts: tuple[dict[str, Any], ...] = ()


class CallConflict(ValueError):
    """A call id was reused for a call with a different tool or arguments (a client bug, never retried)."""


class ToolTransportError(RuntimeError):
    """A call could not be completed within its retry budget (server down, every attempt failed).

    Transient by nature: the run-gym task fails and Prefect retries the whole turn; ``attempts`` says what
    each try hit."""

    def __init__(self, message: str, attempts: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


@runtime_checkable
class ToolClient(Protocol):
    """What a gym needs to run tools: execute a call of an episode, and seal the episode's trace."""

    def call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
             context: dict[str, Any] | None = None) -> ToolReply:
        ...

    def seal(self, episode: str) -> list[dict[str, Any]]:
        ...


@dataclass
class _Episode:
    trace: TraceRecorder
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ToolService:
    """Executes declared tools for many concurrent episodes; thread-safe."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError("ToolService: tool names must be unique")
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.to_schema() for tool in self.tools.values()]

    def _episode(self, episode: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(episode)
            if ep is None:
                ep = self._episodes[episode] = _Episode(TraceRecorder(episode))
            return ep

    def _execute(self, name: str, arguments: Any, context: dict[str, Any] | None = None
                 ) -> tuple[str, bool, tuple[Receipt, ...]]:
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return f"{ERROR_PREFIX}unknown tool {str(name)[:32]!r} (tools: {', '.join(self.tools)})", True, ()
        if not isinstance(arguments, dict):
            return f"{ERROR_PREFIX}arguments must be an object", True, ()
        problem = validate_arguments(tool, arguments)  # the server validates too: clients are not trusted
        if problem is not None:
            return ERROR_PREFIX + problem, True, ()
        try:
            result = tool.fn(**arguments, context=context or {}) if tool.takes_context else tool.fn(**arguments)
        except ToolError as exc:
            return ERROR_PREFIX + str(exc), True, ()
        if isinstance(result, ToolOutput):
            return result.text, False, tuple(result.receipts)
        if not isinstance(result, str):
            raise TypeError(f"tool {name!r} returned {type(result).__name__}; tools return str or ToolOutput")
        return result, False, ()

    def call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
             context: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run (or replay) one call; returns ``{"observation", "is_error", "replayed"}``. ``context``: the episode's
        data for tools declared with ``takes_context`` (part of the call: a replay must send the same)."""
        if not isinstance(episode, str) or not episode or not isinstance(call_id, str) or not call_id:
            raise ValueError("ToolService.call: episode and call_id must be non-empty strings")
        ep = self._episode(episode)
        request = sha256_text(json.dumps([name, arguments] if context is None else [name, arguments, context],
                                         sort_keys=True, default=str))
        with ep.lock:
            done = ep.replies.get(call_id)
            if done is not None:
                if done["request"] != request:
                    raise CallConflict(
                        f"episode {episode!r}: call_id {call_id!r} was already used for a different call; "
                        "a call id names one call (use a new id, or a new episode id for a new attempt)")
                return {"observation": done["observation"], "is_error": done["is_error"], "replayed": True}
            observation, is_error, receipts = self._execute(name, arguments, context)
            ep.trace.append(call_id=call_id, tool=str(name), arguments=arguments if isinstance(arguments, dict) else {},
                            observation=observation, is_error=is_error, receipts=receipts)
            ep.replies[call_id] = {"observation": observation, "is_error": is_error, "request": request}
            return {"observation": observation, "is_error": is_error, "replayed": False}

    def seal(self, episode: str) -> list[dict[str, Any]]:
        """Seal the episode's trace (idempotent) and return its entries."""
        return self._episode(episode).trace.seal()

    def trace(self, episode: str) -> list[dict[str, Any]]:
        """The entries recorded so far (sealed or not)."""
        return self._episode(episode).trace.entries

    def forget(self, episode: str) -> None:
        """Drop a finished episode's state once its sealed trace is stored elsewhere."""
        with self._lock:
            self._episodes.pop(episode, None)

    def episodes(self) -> list[str]:
        with self._lock:
            return list(self._episodes)


class SealedEpisodeMixin:
    """For gyms whose tools run behind a ``ToolClient`` (attributes ``client``, ``_episode_id``, ``_sealed``,
    ``trace_entries``, ``_done``): the episode's trace is sealed once, and ``close()`` returns it."""

    def close(self) -> list[dict[str, Any]] | None:
        """End the episode (if running) and return its sealed trace entries (None without a client or before the
        first reset)."""
        if self.client is None or self._episode_id is None:
            self._done = True
            return None
        entries = self._seal()
        self._done = True
        return entries

    def _seal(self) -> list[dict[str, Any]]:
        if not self._sealed:
            self.trace_entries = list(self.client.seal(self._episode_id))
            self._sealed = True
        return self.trace_entries


class LocalToolClient:
    """In-process client: calls a ``ToolService`` directly (no transport, so no faults)."""

    def __init__(self, service: ToolService) -> None:
        self.service = service

    def call(self, episode: str, call_id: str, name: str, arguments: dict[str, Any],
             context: dict[str, Any] | None = None) -> ToolReply:
        reply = self.service.call(episode, call_id, name, arguments, context)
        return ToolReply(reply["observation"], reply["is_error"])

    def seal(self, episode: str) -> list[dict[str, Any]]:
        return self.service.seal(episode)

    def forget(self, episode: str) -> None:
        self.service.forget(episode)
