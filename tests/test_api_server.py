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
