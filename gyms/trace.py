"""Sealed, append-only, hash-chained provenance trace of one episode (kept server-side, never shown to the model).

Every tool call of an episode appends one entry::

    {"seq": i, "kind": "call", "episode": E, "call_id": C, "tool": name, "arguments": {...},
     "status": "ok" | "error", "observation_sha256": sha256(observation text),
     "receipts": [{"record_hash": .., "payload_digest": .., "revision": ..}, ...],
     "prev": hash of entry i-1 (64 zeros for the first), "hash": sha256(canonical JSON of the entry without "hash")}

Sealing appends a last entry ``{"seq": n, "kind": "seal", "episode": E, "count": n, "head": hash of entry n-1,
"prev": .., "hash": ..}``; nothing may follow it. Receipts (record hashes, payload digests, revisions) are what the
27B agent that saw them wasted 31 % of its context on: here they live only in this trace, where every read stays verifiable.

A stored trace is JSON Lines, one entry per line. ``verify_trace`` re-derives every hash and link and raises
``TraceError`` naming the first entry (line and seq) that does not check out.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
_CALL_FIELDS = ("seq", "kind", "episode", "call_id", "tool", "arguments", "status", "observation_sha256",
                "receipts", "prev", "hash")
_SEAL_FIELDS = ("seq", "kind", "episode", "count", "head", "prev", "hash")
_RECEIPT_FIELDS = ("record_hash", "payload_digest", "revision")


class TraceError(ValueError):
    """A trace is malformed, was changed after sealing, or an append broke the chain; the message names the entry."""


@dataclass(frozen=True)
class Receipt:
    """Provenance of one record a tool returned: which record, a digest of its payload, its revision."""

    record_hash: str
    payload_digest: str
    revision: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def canonical(entry: dict[str, Any]) -> bytes:
    """The bytes an entry's hash covers: sorted keys, no whitespace, without the ``hash`` field."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def entry_hash(entry: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(entry)).hexdigest()


class TraceRecorder:
    """The server's append-only trace of one episode. Thread-safe; ``seal`` is idempotent and final."""

    def __init__(self, episode: str) -> None:
        if not isinstance(episode, str) or not episode:
            raise ValueError(f"TraceRecorder: episode id must be a non-empty string, got {episode!r}")
        self.episode = episode
        self._entries: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._sealed = False

    @property
    def sealed(self) -> bool:
        return self._sealed

    @property
    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._entries]

    def _head(self) -> str:
        return self._entries[-1]["hash"] if self._entries else GENESIS

    def append(self, *, call_id: str, tool: str, arguments: dict[str, Any], observation: str, is_error: bool,
               receipts: Sequence[Receipt] = ()) -> dict[str, Any]:
        """Record one executed call; returns the new entry. Raises ``TraceError`` once the trace is sealed."""
        with self._lock:
            if self._sealed:
                raise TraceError(f"episode {self.episode!r}: trace is sealed; call {call_id!r} cannot be appended")
            entry = {
                "seq": len(self._entries), "kind": "call", "episode": self.episode, "call_id": call_id,
                "tool": tool, "arguments": arguments, "status": "error" if is_error else "ok",
                "observation_sha256": sha256_text(observation),
                "receipts": [r.to_dict() for r in receipts], "prev": self._head(),
            }
            entry["hash"] = entry_hash(entry)
            self._entries.append(entry)
            return dict(entry)

    def seal(self) -> list[dict[str, Any]]:
        """Close the trace (a seal entry commits to the count and the head hash); returns all entries."""
        with self._lock:
            if not self._sealed:
                n = len(self._entries)
                seal = {"seq": n, "kind": "seal", "episode": self.episode, "count": n, "head": self._head(),
                        "prev": self._head()}
                seal["hash"] = entry_hash(seal)
                self._entries.append(seal)
                self._sealed = True
            return [dict(e) for e in self._entries]


@dataclass(frozen=True)
class TraceSummary:
    """What a verified trace says: its episode, number of calls, head hash and the records it read."""

    episode: str
    calls: int
    head: str
    read_records: tuple[str, ...]  # record hashes of every receipt, in order
    call_ids: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "read_records": list(self.read_records), "call_ids": list(self.call_ids)}


def _where(line: int, seq: Any) -> str:
    return f"entry {line} (line {line + 1}, seq {seq!r})"


def _check_fields(entry: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    if set(entry) != set(fields):
        missing = sorted(set(fields) - set(entry))
        extra = sorted(set(entry) - set(fields))
        raise TraceError(f"{where}: fields do not match a {entry.get('kind')!r} entry (missing {missing}, extra {extra})")


def _check_receipts(receipts: Any, where: str) -> None:
    if not isinstance(receipts, list):
        raise TraceError(f"{where}: receipts must be a list")
    for r in receipts:
        if not isinstance(r, dict) or set(r) != set(_RECEIPT_FIELDS):
            raise TraceError(f"{where}: a receipt must have exactly {list(_RECEIPT_FIELDS)}, got {r!r:.80}")


def verify_entries(entries: Sequence[Any], episode: str | None = None) -> TraceSummary:
    """Check a trace given as parsed entries (see ``verify_trace``)."""
    if not entries:
        raise TraceError("trace is empty: a sealed trace has at least its seal entry")
    prev, reads, call_ids = GENESIS, [], []
    first_episode = None
    for i, entry in enumerate(entries):
        where = _where(i, entry.get("seq") if isinstance(entry, dict) else None)
        if not isinstance(entry, dict):
            raise TraceError(f"{where}: not a JSON object")
        kind = entry.get("kind")
        if kind not in ("call", "seal"):
            raise TraceError(f"{where}: unknown kind {kind!r}")
        _check_fields(entry, _CALL_FIELDS if kind == "call" else _SEAL_FIELDS, where)
        if entry["seq"] != i:
            raise TraceError(f"{where}: seq is {entry['seq']!r}, expected {i} (an entry was removed or reordered)")
        if entry["prev"] != prev:
            raise TraceError(f"{where}: prev does not match the hash of entry {i - 1} (the chain is broken)")
        if entry_hash(entry) != entry["hash"]:
            raise TraceError(f"{where}: hash mismatch (its content was changed after it was recorded)")
        first_episode = entry["episode"] if first_episode is None else first_episode
        if entry["episode"] != first_episode:
            raise TraceError(f"{where}: episode {entry['episode']!r} differs from {first_episode!r}")
        if kind == "seal":
            if i != len(entries) - 1:
                raise TraceError(f"{where}: seal is not the last entry ({len(entries) - 1 - i} entries follow it)")
            if entry["count"] != i or entry["head"] != prev:
                raise TraceError(f"{where}: seal commits to count {entry['count']!r}, but {i} calls precede it")
        else:
            _check_receipts(entry["receipts"], where)
            reads.extend(r["record_hash"] for r in entry["receipts"])
            call_ids.append(entry["call_id"])
        prev = entry["hash"]
    if entries[-1]["kind"] != "seal":
        raise TraceError(f"{_where(len(entries) - 1, entries[-1].get('seq'))}: trace is not sealed (no seal entry)")
    if episode is not None and first_episode != episode:
        raise TraceError(f"trace belongs to episode {first_episode!r}, expected {episode!r}")
    return TraceSummary(episode=first_episode, calls=len(entries) - 1, head=prev, read_records=tuple(reads),
                        call_ids=tuple(call_ids))


def trace_lines(entries: Iterable[dict[str, Any]]) -> str:
    """JSON Lines text of a trace (one canonical-order entry per line)."""
    return "".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in entries)


def write_trace(path: str | Path, entries: Sequence[dict[str, Any]]) -> str:
    """Write a sealed trace atomically (verified first, so a broken trace is never stored); returns its file hash."""
    from artifacts.store import atomic_write

    verify_entries(entries)
    text = trace_lines(entries)
    return atomic_write(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_trace(path: str | Path) -> list[Any]:
    """Parse a stored trace without verifying it; a line that is not JSON raises ``TraceError`` naming its entry."""
    lines = Path(path).read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline
    entries = []
    for i, line in enumerate(lines):
        try:
            entries.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TraceError(f"{_where(i, '?')}: not valid JSON ({exc})") from None
    return entries


def verify_trace(trace: str | Path | Sequence[dict[str, Any]], episode: str | None = None) -> TraceSummary:
    """Verify a stored trace (path) or its entries: every hash, link, seq, the seal; name the first bad entry.

    The check is self-contained (no sidecar needed): flipping any byte changes a line's JSON or its hash.
    """
    if isinstance(trace, (str, Path)):
        try:
            entries = read_trace(trace)
            lines = Path(trace).read_bytes().split(b"\n")
            summary = verify_entries(entries, episode)
            for i, entry in enumerate(entries):  # any byte-level change that still parses to the same values
                if trace_lines([entry]).encode("utf-8") != lines[i] + b"\n":
                    raise TraceError(f"{_where(i, entry.get('seq'))}: line is not in canonical form (edited by hand?)")
            if lines[len(entries):] != [b""]:
                raise TraceError(f"{_where(len(entries), None)}: bytes after the seal entry")
            return summary
        except TraceError as exc:
            raise TraceError(f"{trace}: {exc}") from None
    return verify_entries(list(trace), episode)
