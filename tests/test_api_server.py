"""The run's own Prefect API server (flows/api_server.py): its connections do not wait for delayed ACKs.

The latency itself (GET /health 44 -> 2 ms on a kept-alive connection) is a benchmark figure
(bench/trl_compare.py, bench/results/cpu-trl-compare-2026-12-02.json); here: the option that causes it, on the
connections the server accepts, and a server that answers on a kept-alive connection."""

from __future__ import annotations

import socket

import pytest


def test_connections_the_server_accepts_have_tcp_nodelay():
    """Without TCP_NODELAY every small response after the first on a kept-alive connection waited ~40 ms for the
    client's delayed ACK (Nagle); a GRPO step makes ~10 such calls in a row."""
    from flows.api_server import listening_socket

    srv = listening_socket()
    try:
        srv.listen(1)
        assert srv.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        try:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            conn.close()
            cli.close()
    finally:
        srv.close()


@pytest.mark.slow
def test_the_server_answers_repeated_requests_on_one_kept_alive_connection(monkeypatch):
    import httpx

    from flows.api_server import api_server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with api_server() as url, httpx.Client() as client:
        codes = [client.get(url + "/health").status_code for _ in range(5)]
    assert codes == [200] * 5


def _statuses_app(statuses: list[int], retry_after: dict[int, bytes] | None = None):
    """A minimal ASGI app answering the given statuses in turn (a 503 the way Prefect's server sends one for a locked
    SQLite database), optionally with its own Retry-After on some of them."""
    calls = iter(range(len(statuses)))

    async def app(scope, receive, send):
        i = next(calls)
        headers = [(b"content-type", b"application/json")]
        if retry_after and i in retry_after:
            headers.append((b"retry-after", retry_after[i]))
        await send({"type": "http.response.start", "status": statuses[i], "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def _retry_afters(app, n: int) -> list[str | None]:
    import asyncio

    out = []

    async def one():
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await app({"type": "http", "method": "POST", "path": "/api/task_runs/", "headers": []}, receive, send)
        start = sent[0]
        values = [v.decode() for k, v in start["headers"] if k.lower() == b"retry-after"]
        assert len(values) <= 1
        out.append(values[0] if values else None)

    for _ in range(n):
        asyncio.run(one())
    return out


def test_a_503_asks_for_a_short_retry_that_grows_until_a_request_succeeds():
    """Prefect's client waits 2**attempt s after a 503 unless told otherwise; a locked SQLite database (the server's
    event persister committing between a request's read and write) clears within milliseconds."""
    from flows.api_server import RetrySoonWhenLocked

    app = RetrySoonWhenLocked(_statuses_app([503, 503, 503, 200, 503, 201, 200]))
    assert _retry_afters(app, 7) == ["0.050", "0.200", "0.800", None, "0.050", None, None]


def test_a_503_that_names_its_own_retry_after_is_left_alone():
    from flows.api_server import RetrySoonWhenLocked

    app = RetrySoonWhenLocked(_statuses_app([503, 503], retry_after={0: b"7"}))
    assert _retry_afters(app, 2) == ["7", "0.050"]


def test_prefects_client_retries_after_the_short_delay(monkeypatch):
    """End to end with Prefect's own HTTP client (its retry loop, jitter included): the retry after a 503 from the
    run's server sleeps ~0.05 s, not Prefect's default 2 s; without the middleware it sleeps >= 1 s."""
    import asyncio

    import anyio
    import httpx
    from prefect.client.base import PrefectHttpxAsyncClient

    from flows.api_server import RetrySoonWhenLocked

    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(anyio, "sleep", fake_sleep)

    async def get(app) -> int:
        async with PrefectHttpxAsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                           enable_csrf_support=False) as client:
            return (await client.get("/api/health")).status_code

    assert asyncio.run(get(RetrySoonWhenLocked(_statuses_app([503, 200])))) == 200
    assert len(slept) == 1 and 0.05 <= slept[0] <= 0.05 * 1.5
    slept.clear()
    assert asyncio.run(get(_statuses_app([503, 200]))) == 200
    assert len(slept) == 1 and slept[0] >= 1.0


def test_the_server_runs_on_uvloop_and_httptools_and_asyncio_can_be_forced(monkeypatch):
    from uvicorn.loops.auto import auto_loop_factory
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from flows.api_server import server_loop

    monkeypatch.delenv("LGRPO_API_LOOP", raising=False)
    assert server_loop() == ("auto", "auto")
    # uvicorn's "auto" resolves to uvloop and httptools: both are project dependencies (pyproject.toml)
    loop = auto_loop_factory()()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
    assert AutoHTTPProtocol is HttpToolsProtocol
    monkeypatch.setenv("LGRPO_API_LOOP", "asyncio")
    assert server_loop() == ("asyncio", "h11")
