"""Sealed provenance traces and the tool service: hash chain, tamper detection, idempotent calls."""

from __future__ import annotations

import json
import re
import threading

import pytest

from gyms.service import CallConflict, LocalToolClient, ToolOutput, ToolService
from gyms.tools import CALC_TOOL, Tool, ToolError
from gyms.trace import GENESIS, Receipt, TraceError, TraceRecorder, sha256_text, verify_entries, verify_trace, write_trace


def _receipt(doc: str) -> Receipt:
    return Receipt(record_hash=sha256_text("rec:" + doc), payload_digest=sha256_text("body:" + doc), revision=3)


def _read(doc_id: str) -> ToolOutput:
    if not doc_id.startswith("d"):
        raise ToolError(f"unknown doc_id {doc_id!r}")
    return ToolOutput(f"{doc_id} says 7.", receipts=(_receipt(doc_id),))


READ = Tool("read", "Read a document.", {"type": "object", "properties": {"doc_id": {"type": "string"}},
                                          "required": ["doc_id"]}, fn=_read)


def _sealed(n_calls: int = 4) -> list[dict]:
    rec = TraceRecorder("run:s0:3")
    for i in range(n_calls):
        rec.append(call_id=str(i), tool="read", arguments={"doc_id": f"d{i:03d}"}, observation=f"text {i}",
                   is_error=False, receipts=[_receipt(f"d{i:03d}")])
    return rec.seal()


def test_chain_links_and_seal() -> None:
    entries = _sealed(3)
    assert [e["seq"] for e in entries] == [0, 1, 2, 3]
    assert entries[0]["prev"] == GENESIS
    assert all(entries[i]["prev"] == entries[i - 1]["hash"] for i in range(1, 4))
    assert entries[-1]["kind"] == "seal" and entries[-1]["count"] == 3 and entries[-1]["head"] == entries[2]["hash"]
    summary = verify_entries(entries, "run:s0:3")
    assert summary.calls == 3 and summary.head == entries[-1]["hash"]
    assert summary.read_records == tuple(_receipt(f"d{i:03d}").record_hash for i in range(3))


def test_sealed_trace_refuses_appends_and_seal_is_idempotent() -> None:
    rec = TraceRecorder("e")
    rec.append(call_id="0", tool="calc", arguments={}, observation="1", is_error=False)
    first = rec.seal()
    assert rec.seal() == first
    with pytest.raises(TraceError, match="sealed"):
        rec.append(call_id="1", tool="calc", arguments={}, observation="2", is_error=False)


def test_stored_trace_verifies(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, _sealed())
    assert verify_trace(path, episode="run:s0:3").calls == 4
    with pytest.raises(TraceError, match="expected 'other'"):
        verify_trace(path, episode="other")


def test_every_single_byte_flip_is_detected_and_names_the_entry(tmp_path) -> None:
    """Acceptance: flipping one byte of a stored trace makes verify_trace fail with a message naming the entry."""
    path = tmp_path / "t.jsonl"
    write_trace(path, _sealed(2))
    good = path.read_bytes()
    line_of = [good[:i].count(b"\n") for i in range(len(good))]
    for pos in range(len(good)):
        for mask in (0x01, 0x20, 0x80):
            bad = bytearray(good)
            bad[pos] ^= mask
            path.write_bytes(bytes(bad))
            with pytest.raises(TraceError) as err:
                verify_trace(path)
            msg = str(err.value)
            m = re.search(r"entry (\d+) \(line (\d+)", msg)
            assert m, f"flip at byte {pos} ^ {mask:#x}: message names no entry: {msg}"
            # the named entry is the flipped line, or (a flipped newline joins two lines) the one before it
            assert int(m.group(1)) in (line_of[pos], line_of[pos] - 1, line_of[pos] + 1), (pos, mask, msg)


def test_tampering_cases_name_the_problem() -> None:
    entries = _sealed(3)
    edited = [dict(e) for e in entries]
    edited[1]["arguments"] = {"doc_id": "d999"}
    with pytest.raises(TraceError, match=r"entry 1 .*hash mismatch"):
        verify_entries(edited)
    dropped = entries[:1] + entries[2:]
    with pytest.raises(TraceError, match=r"entry 1 .*seq"):
        verify_entries(dropped)
    with pytest.raises(TraceError, match="not sealed"):
        verify_entries(entries[:-1])
    rehashed = [dict(e) for e in entries]  # a forger who recomputes one hash still breaks the next link
    rehashed[0]["observation_sha256"] = sha256_text("forged")
    from gyms.trace import entry_hash
    rehashed[0]["hash"] = entry_hash(rehashed[0])
    with pytest.raises(TraceError, match=r"entry 1 .*chain is broken"):
        verify_entries(rehashed)
    with pytest.raises(TraceError, match="empty"):
        verify_entries([])


def test_write_trace_refuses_a_broken_trace(tmp_path) -> None:
    entries = _sealed(1)
    entries[0] = dict(entries[0], tool="other")
    with pytest.raises(TraceError):
        write_trace(tmp_path / "t.jsonl", entries)
    assert not (tmp_path / "t.jsonl").exists()


# -- the tool service ------------------------------------------------------------------------------------------


def test_service_records_receipts_that_the_model_never_sees() -> None:
    client = LocalToolClient(ToolService([READ, CALC_TOOL]))
    reply = client.call("ep", "0", "read", {"doc_id": "d001"})
    assert reply.observation == "d001 says 7." and not reply.is_error
    assert not re.search(r"[0-9a-f]{64}", reply.observation)
    entries = client.seal("ep")
    assert entries[0]["receipts"] == [_receipt("d001").to_dict()]
    assert entries[0]["observation_sha256"] == sha256_text("d001 says 7.")


def test_service_is_idempotent_per_call_id() -> None:
    service = ToolService([READ, CALC_TOOL])
    first = service.call("ep", "0", "calc", {"expression": "2+3"})
    again = service.call("ep", "0", "calc", {"expression": "2+3"})
    assert first["observation"] == again["observation"] == "5"
    assert (first["replayed"], again["replayed"]) == (False, True)
    assert len(service.trace("ep")) == 1
    with pytest.raises(CallConflict, match="different call"):
        service.call("ep", "0", "calc", {"expression": "2+4"})


def test_service_validates_and_records_errors() -> None:
    service = ToolService([READ, CALC_TOOL])
    assert service.call("ep", "0", "nope", {})["observation"].startswith("error: unknown tool")
    assert service.call("ep", "1", "read", {"doc_id": 5})["observation"] == "error: arguments.doc_id must be a string"
    assert service.call("ep", "2", "read", {"doc_id": "x"})["is_error"]
    statuses = [e["status"] for e in service.seal("ep")[:-1]]
    assert statuses == ["error", "error", "error"]


def test_service_threads_one_trace_per_episode() -> None:
    service = ToolService([CALC_TOOL])

    def run(ep: int) -> None:
        for i in range(20):
            service.call(f"ep{ep}", str(i), "calc", {"expression": f"{ep}+{i}"})
            service.call(f"ep{ep}", str(i), "calc", {"expression": f"{ep}+{i}"})  # a retry

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(8):
        summary = verify_entries(service.seal(f"ep{k}"), f"ep{k}")
        assert summary.calls == 20 and summary.call_ids == tuple(str(i) for i in range(20))


def test_trace_lines_are_canonical_json(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, _sealed(1))
    for line in path.read_text().splitlines():
        assert json.dumps(json.loads(line), sort_keys=True, separators=(",", ":")) == line
