"""The run's own Prefect API server (flows/api_server.py): answers fast on a kept-alive connection."""

from __future__ import annotations

import statistics
import time

import pytest


@pytest.mark.slow
def test_kept_alive_requests_do_not_wait_for_delayed_acks(monkeypatch):
    """Each request on a kept-alive connection answers in a few ms. Without TCP_NODELAY on the server's socket every
    small response after the first waited ~40 ms for the client's delayed ACK (Nagle), which cost a GRPO step ~10
    such waits."""
    import httpx

    from flows.api_server import api_server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with api_server() as url, httpx.Client() as client:
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            times.append(time.perf_counter() - t0)
    assert statistics.median(times[1:]) < 0.025, [round(t * 1000, 1) for t in times]
