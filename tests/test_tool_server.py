"""The HTTP tool server (gyms.server, launched by gyms.launcher) and its retrying client (gyms.transport), against the real server subprocess.

Fault injection: each kind alone, refused connections, a dead server (terminal error), 4xx without retry, bad
request bodies, and the acceptance run (>= 200 concurrent episodes, 20 % of calls faulted over all six kinds:
no episode lost, every fault recorded).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from gyms.demo_tools import DemoTools
from gyms.launcher import start_tool_server
from gyms.server import FAULT_KINDS, FaultConfig, ToolServer
from gyms.service import ToolClient, ToolService, ToolTransportError
from gyms.tools import calc
from gyms.trace import verify_entries
from gyms.transport import HttpToolClient

DEMO = "gyms.demo_tools:DemoTools"
N_DOCS = 50
DOCS = DemoTools(n_docs=N_DOCS)


@pytest.fixture(scope="module")
def server():
    with start_tool_server(DEMO, {"n_docs": N_DOCS}, read_timeout_s=1.0) as proc:
        yield proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(port: int, data: bytes, *, shut_write: bool = False, timeout: float = 5.0) -> tuple[int, dict | str]:
    """Send raw bytes, return (status, parsed JSON body or text)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    response = b"".join(chunks)
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("latin-1")


def _post(port: int, path: str, body: bytes, extra_headers: str = "") -> tuple[int, dict | str]:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra_headers}\r\n").encode()
    return _raw(port, head + body)


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _expected(name: str, arguments: dict) -> tuple[str, bool]:
    if name == "calc":
        out = calc(arguments["expression"])
        return out, out.startswith("error: ")
    doc = arguments["doc_id"]
    return (DOCS.docs[doc], False) if doc in DOCS.docs else (f"error: no document {doc!r}", True)


# ---------------------------------------------------------------------------------------------------------------
# Happy path
# ---------------------------------------------------------------------------------------------------------------


def test_call_replay_seal_tools_health(server):
    client = HttpToolClient(server.url, timeout_s=2.0, seed=0)
    assert isinstance(client, ToolClient)
    health = client.health()
    assert health["ok"] is True and health["tools"] == ["calc", "read"]
    assert [t["function"]["name"] for t in client.tools()] == ["calc", "read"]

    reply, replayed = client.call_with_info("happy", "c1", "calc", {"expression": "7 + 12"})
    assert (reply.observation, reply.is_error, reply.attempts, replayed) == ("19", False, (), False)
    again, replayed = client.call_with_info("happy", "c1", "calc", {"expression": "7 + 12"})
    assert (again.observation, replayed) == ("19", True)

    read = client.call("happy", "c2", "read", {"doc_id": "doc-3"})
    assert read.observation == DOCS.docs["doc-3"] and not read.is_error
    assert client.call("happy", "c3", "read", {"doc_id": "nope"}).is_error
    unknown = client.call("happy", "c4", "search", {"q": "x"})
    assert unknown.is_error and "unknown tool" in unknown.observation

    entries = client.seal("happy")
    summary = verify_entries(entries, "happy")
    assert summary.call_ids == ("c1", "c2", "c3", "c4")  # the replayed c1 is recorded once
    assert summary.read_records == (DOCS.receipt("doc-3").record_hash,)
    assert client.seal("happy") == entries  # sealing is idempotent
    with pytest.raises(ValueError, match="HTTP 409.*sealed"):
        client.call("happy", "c5", "calc", {"expression": "1"})

    episodes = client.health()["episodes"]
    client.forget("happy")
    assert client.health()["episodes"] == episodes - 1
    assert client.journal == []


def test_in_process_server_serves_the_same_api():
    with ToolServer(ToolService(DOCS.server_tools())) as srv:
        client = HttpToolClient(srv.url, timeout_s=2.0)
        assert client.call("e", "c", "calc", {"expression": "2*3"}).observation == "6"
        assert verify_entries(client.seal("e")).calls == 1
        assert srv.health()["requests"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Faults, one kind at a time
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_kind_alone_is_recovered_and_recorded(kind, tmp_path):
    faults = FaultConfig(rate=0.3, kinds=(kind,), seed=1, latency_s=0.1, timeout_s=0.6, refuse_s=0.05)
    with start_tool_server(DEMO, {"n_docs": N_DOCS}, faults=faults, fault_log=tmp_path / "faults.jsonl") as proc:
        client = HttpToolClient(proc.url, timeout_s=0.4, max_attempts=10, backoff_base_s=0.02, backoff_max_s=0.5,
                                seed=1, journal_path=tmp_path / "journal.jsonl")
        calls = [("calc", {"expression": f"{i} * 3"}) if i % 2 else ("read", {"doc_id": f"doc-{i}"})
                 for i in range(8)]
        for i, (name, args) in enumerate(calls):
            reply = client.call("ep", f"c{i}", name, args)
            assert (reply.observation, reply.is_error) == _expected(name, args)
        summary = verify_entries(client.seal("ep"), "ep")
        assert summary.call_ids == tuple(f"c{i}" for i in range(8))  # no duplicate despite replies lost after execution
        injected = proc.faults()
    assert injected and {f["kind"] for f in injected} == {kind}
    assert _jsonl(tmp_path / "faults.jsonl") == injected
    journal = _jsonl(tmp_path / "journal.jsonl")
    assert journal == client.journal
    seen = {a["request_id"] for a in journal}
    if kind == "latency":  # slow but successful: nothing for the client to record
        assert journal == []
    else:
        assert {f["request_id"] for f in injected} <= seen
        expected_kind = {"http_5xx": "http_5xx", "timeout": "timeout", "reset": "reset", "refused": "reset",
                         "malformed": "malformed"}[kind]
        by_id = {a["request_id"]: a["kind"] for a in journal}
        assert {by_id[f["request_id"]] for f in injected} == {expected_kind}
    if kind == "refused":  # the retries after the reset met the closed port: a real ECONNREFUSED
        refused = [a for a in journal if a["kind"] == "refused"]
        assert refused and all("Errno 111" in a["detail"] or "refused" in a["detail"].lower() for a in refused)


# ---------------------------------------------------------------------------------------------------------------
# Terminal errors, 4xx
# ---------------------------------------------------------------------------------------------------------------


def test_nothing_listening_is_a_clear_terminal_error(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    client = HttpToolClient(url, timeout_s=0.5, max_attempts=4, backoff_base_s=0.05, seed=3,
                            journal_path=tmp_path / "j.jsonl")
    start = time.monotonic()
    with pytest.raises(ToolTransportError) as info:
        client.call("ep", "c7", "calc", {"expression": "1+1"})
    elapsed = time.monotonic() - start
    message = str(info.value)
    for part in (url, "'calc'", "'ep'", "'c7'", "4 attempts", "refused", "is the tool server running"):
        assert part in message
    attempts = info.value.attempts
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4] and {a["kind"] for a in attempts} == {"refused"}
    assert [a["request_id"] for a in attempts] == [f"ep/c7/{i}" for i in range(1, 5)]
    slept = sum(a["backoff_s"] for a in attempts)
    assert attempts[-1]["backoff_s"] == 0 and slept > 0
    assert elapsed >= slept and attempts[-1]["elapsed_s"] >= slept * 0.99
    assert len((tmp_path / "j.jsonl").read_text().splitlines()) == 4 and client.journal == list(attempts)


def test_a_stopped_server_is_a_terminal_error(tmp_path):
    proc = start_tool_server(DEMO, {}, log_path=tmp_path / "server.log")
    client = HttpToolClient(proc.url, timeout_s=0.5, max_attempts=3, backoff_base_s=0.01, seed=0)
    assert client.call("ep", "c1", "calc", {"expression": "2+2"}).observation == "4"
    assert proc.stop() == 0
    assert "gyms.server: stopped" in (tmp_path / "server.log").read_text()  # SIGTERM: a clean exit
    with pytest.raises(ToolTransportError, match="failed after 3 attempts") as info:
        client.seal("ep")
    assert "seal of episode 'ep'" in str(info.value) and len(info.value.attempts) == 3


def test_server_that_cannot_start_raises_with_its_log():
    with pytest.raises(RuntimeError, match="exited with code") as info:
        start_tool_server("gyms.server:NoSuchFactory", {})
    assert "NoSuchFactory" in str(info.value)  # the tail of the child's traceback


def test_4xx_is_not_retried(server):
    client = HttpToolClient(server.url, timeout_s=2.0, seed=0)
    before = client.health()["requests_by_path"].get("rejected", 0)
    with pytest.raises(ValueError, match="HTTP 400.*'episode' must be a non-empty string"):
        client.call("", "c1", "calc", {"expression": "1"})
    with pytest.raises(ValueError, match="HTTP 400.*'arguments' must be an object"):
        client.call("ep4", "c1", "calc", ["1"])  # type: ignore[arg-type]
    assert client.health()["requests_by_path"]["rejected"] == before + 2  # one request each: no retries
    assert client.journal == []


# ---------------------------------------------------------------------------------------------------------------
# Robustness against bad requests
# ---------------------------------------------------------------------------------------------------------------


def test_bad_bodies_get_400_and_the_server_keeps_serving(server):
    port = server.port
    good = {"episode": "rb", "call_id": "c", "name": "calc", "arguments": {"expression": "1"}}
    cases = [
        (b"not json", 400, "not valid JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"\xff\xfe{}", 400, "not UTF-8"),
        (b'{"episode": NaN}', 400, "NaN"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        (b"1" * 5000, 400, "not valid JSON"),  # an integer over the digit limit
        (json.dumps({k: v for k, v in good.items() if k != "call_id"}).encode(), 400, "missing field 'call_id'"),
        (json.dumps({**good, "call_id": 5}).encode(), 400, "'call_id' must be a string"),
        (json.dumps({**good, "arguments": "x"}).encode(), 400, "'arguments' must be an object"),
        (json.dumps({**good, "extra": 1}).encode(), 400, "unexpected field"),
        (b"x" * (2 << 20), 400, "too large"),
    ]
    for body, status, words in cases:
        got, reply = _post(port, "/v1/call", body)
        assert got == status and words in reply["error"], (body[:40], got, reply)
    got, reply = _post(port, "/v1/seal", b'{"episode": ""}')
    assert got == 400 and "non-empty" in reply["error"]
    got, reply = _raw(port, b"POST /v1/call HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == 411 and "Content-Length" in reply["error"]
    got, reply = _raw(port, b"POST /v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n")
    assert got == 400 and "Content-Length" in reply["error"]
    got, reply = _raw(port, b"POST /v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"ep", shut_write=True)
    assert got == 400 and "truncated" in reply["error"]
    got, reply = _raw(port, b"POST /v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"ep")  # then silence
    assert got == 408 and "timed out" in reply["error"]
    for garbage in (b"HELLO\r\n\r\n", b"\x00\x01garbage and more\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"):
        got, reply = _raw(port, garbage)
        assert got in (400, 505) and reply["error"], (garbage, got, reply)
    got, reply = _raw(port, b"DELETE /v1/call HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == 501
    got, reply = _raw(port, b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == 404 and "no such endpoint" in reply["error"]
    got, reply = _post(port, "/v1/nothing", b"{}")
    assert got == 404
    got, reply = _raw(port, b"GET /v1/call HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == 405
    got, reply = _post(port, "/v1/call", json.dumps(good).encode())
    assert got == 200 and reply == {"observation": "1", "is_error": False, "replayed": False}
    assert HttpToolClient(server.url).health()["ok"]


# ---------------------------------------------------------------------------------------------------------------
# Acceptance: >= 200 concurrent episodes, 20 % of requests faulted over all six kinds
# ---------------------------------------------------------------------------------------------------------------


def _episode_calls(e: int) -> list[tuple[str, dict]]:
    return [
        ("calc", {"expression": f"{e} * 7 + {e % 13}"}),
        ("read", {"doc_id": f"doc-{e % N_DOCS}"}),
        ("calc", {"expression": f"({e} + 1) / 4"}),
        ("read", {"doc_id": f"doc-{(e * 7) % N_DOCS}"}),
        ("calc", {"expression": f"{e} / 0"}),  # a tool error is an answer too, recorded once
        ("read", {"doc_id": f"doc-{e % N_DOCS}"}),
    ]


@pytest.mark.slow
def test_acceptance_200_episodes_with_20_percent_faults(tmp_path):
    n_episodes, threads = 240, 16
    faults = FaultConfig(rate=0.2, kinds=FAULT_KINDS, seed=7, latency_s=0.1, timeout_s=0.7, refuse_s=0.05,
                         refuse_gap_s=0.5)
    fault_log = tmp_path / "faults.jsonl"
    start = time.monotonic()
    with start_tool_server(DEMO, {"n_docs": N_DOCS}, faults=faults, fault_log=fault_log) as proc:
        client = HttpToolClient(proc.url, timeout_s=0.5, max_attempts=12, backoff_base_s=0.05, backoff_max_s=1.0,
                                seed=7, journal_path=tmp_path / "journal.jsonl")
        lock = threading.Lock()
        retried_calls = Counter()

        def run_episode(e: int) -> dict:
            episode = f"acc-{e:03d}"
            calls = _episode_calls(e)
            for i, (name, args) in enumerate(calls):
                reply = client.call(episode, f"t{i}", name, args)
                assert (reply.observation, reply.is_error) == _expected(name, args), (episode, i, reply)
                if reply.attempts:
                    with lock:
                        retried_calls[len(reply.attempts)] += 1
            summary = verify_entries(client.seal(episode), episode)
            assert summary.call_ids == tuple(f"t{i}" for i in range(len(calls))), (episode, summary.call_ids)
            assert summary.read_records == tuple(DOCS.receipt(a["doc_id"]).record_hash
                                                 for n, a in calls if n == "read")
            return {"episode": episode, "calls": summary.calls}

        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(run_episode, range(n_episodes)))
        health = proc.get("/v1/health")
        injected = proc.faults()
    wall = time.monotonic() - start

    # zero episodes lost: every episode ran all its calls and sealed a verified trace, one entry per call
    assert len(results) == n_episodes and len({r["episode"] for r in results}) == n_episodes
    n_calls = sum(r["calls"] for r in results)
    assert n_calls == n_episodes * 6

    # ~20 % of the requests the server received were faulted, over all six kinds
    assert _jsonl(fault_log) == injected
    by_kind = Counter(f["kind"] for f in injected)
    requests = health["requests"]
    assert requests >= n_episodes * 7
    assert 0.15 <= len(injected) / requests <= 0.25, (len(injected), requests)
    assert set(by_kind) == set(FAULT_KINDS)

    # every fault recorded: each one but latency (a slow success) has the client's journal entry for that request
    journal = _jsonl(tmp_path / "journal.jsonl")
    assert journal == client.journal
    seen = {a["request_id"] for a in journal}
    missing = [f for f in injected if f["kind"] != "latency" and f["request_id"] not in seen]
    assert missing == []
    client_kinds = Counter(a["kind"] for a in journal)
    assert client_kinds["refused"] > 0 and client_kinds["timeout"] >= by_kind["timeout"]
    print(f"\nacceptance: {n_episodes} episodes, {n_calls} calls (+{n_episodes} seals), {requests} requests served, "
          f"0 lost; faults {len(injected)} ({len(injected) / requests:.1%}) by kind "
          f"{dict(sorted(by_kind.items()))}; client retries {len(journal)} by kind {dict(sorted(client_kinds.items()))}"
          f", {sum(retried_calls.values())} calls retried (failed attempts per call: "
          f"{dict(sorted(retried_calls.items()))}); "
          f"{threads} threads, {wall:.1f}s wall")


def test_table_gym_over_the_server_answers_as_in_process_and_seals_a_trace(tmp_path):
    """The embedded default's gym on HTTP tools (`gym.transport: http`): the server keeps no table, the gym sends
    its task's table as each call's context; with faults on, every episode's observations, rewards and end equal
    the in-process gym's, and each episode's sealed trace verifies."""
    from gyms.table import TableGym

    opts = {"max_turns": 5, "table_size": 4, "max_value": 20, "ops": ["plus"], "progress_reward": 0.25}
    local = TableGym(**opts)
    tasks = local.sample_tasks(12, 3)
    wrong = '<tool_call>{"name": "lookup", "arguments": {"key": "nobody"}}</tool_call>'
    faults = FaultConfig(rate=0.3, kinds=FAULT_KINDS, seed=3, latency_s=0.05, timeout_s=0.7, refuse_s=0.05,
                         refuse_gap_s=0.3)
    with start_tool_server("gyms.table:TableGym", opts, faults=faults, fault_log=tmp_path / "f.jsonl") as proc:
        client = HttpToolClient(proc.url, timeout_s=0.5, max_attempts=12, backoff_base_s=0.02, backoff_max_s=0.3,
                                seed=3)
        served = TableGym(**opts, tool_client=client)
        for n, task in enumerate(tasks):
            answers = local.oracle_answers(task)
            answers = answers[:1] + [wrong] + answers[1:] if n % 2 else answers
            seen = []
            for gym in (local, served):
                gym.reset(task, episode_id=f"ep-{n}") if gym is served else gym.reset(task)
                out = []
                for text in answers:
                    r = gym.step(text)
                    out.append((r.observation, r.reward, r.done, r.info["reason"], r.info["tool_error"]))
                    if r.done:
                        break
                seen.append(out)
            assert seen[0] == seen[1], (n, seen)
            assert seen[1][-1][1] == 1.0 and seen[1][-1][2]  # the oracle's final answer is right
            summary = verify_entries(served.close(), f"ep-{n}")
            assert summary.calls == len(answers) - 1  # every tool call is in the trace, the answer is not
        assert proc.faults(), "faults were injected"
