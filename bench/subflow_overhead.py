"""What one step subflow costs in Prefect API work, and the 2-s stalls of a locked SQLite database (issue 15).

    python bench/subflow_overhead.py [--subflows 30] [--rounds 4] [--json F]

Empty subflows (`@flow def sub(i): return i`) called from a top flow, as the train flow calls its step flows (no
heartbeat thread of their own), against the run's own API server (flows/api_server.py), in two layouts alternated
round by round in one process: Prefect's default (a new async client per subflow's tracking task run) and
`flows.step.shared_async_client` (one started client for all). Twice: with the server's `RetrySoonWhenLocked`
(a 503 for a locked database asks for a 0.05-s retry) and without it (`LGRPO_API_RETRY_SOON=0`: Prefect's client then
sleeps ~2 s), and once more on asyncio + h11 instead of uvloop + httptools (`LGRPO_API_LOOP=asyncio`,
flows.api_server.server_loop). The three servers take turns round by round (a new server per round), so a slow spell
of the machine hits them alike. Prints per layout the median seconds per subflow and the stalls (> 0.5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def measure(subflows: int) -> dict[str, list[float]]:
    """One server start, one round: per layout, the seconds of each subflow after the first two."""
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from flows.api_server import api_server
    from flows.step import shared_async_client

    @flow(name="lgrpo-bench-subflow")
    def sub(i: int) -> int:
        return i

    @flow(name="lgrpo-bench-subflows")
    def top(n: int, shared: bool) -> list[float]:
        marks = [time.perf_counter()]
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), \
                (shared_async_client() if shared else nullcontext()):
            for i in range(n):
                sub(i)
                marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])][2:]  # the first two: first-call costs

    with api_server():
        top(3, False), top(3, True)  # warm-up
        return {layout: top(subflows, layout == "shared") for layout in ("default", "shared")}


def summary(d: list[float]) -> dict:
    return {"median_s": round(statistics.median(d), 4), "mean_s": round(statistics.mean(d), 4), "subflows": len(d),
            "stalls_s": [round(x, 2) for x in d if x > 0.5]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subflows", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    servers = {"retry_soon": ("1", "auto"),  # the run's server as `lgrpo train` starts it
               "asyncio_loop": ("1", "asyncio"),  # the same on asyncio + h11 instead of uvloop + httptools
               "prefect_default_retry": ("0", "auto")}
    times = {key: {"default": [], "shared": []} for key in servers}
    for _ in range(a.rounds):  # servers alternate round by round: a slow spell of the machine hits them all alike
        for key, (retry_soon, loop) in servers.items():
            os.environ["LGRPO_API_RETRY_SOON"], os.environ["LGRPO_API_LOOP"] = retry_soon, loop  # read by the child
            for layout, d in measure(a.subflows).items():
                times[key][layout] += d
    res = {key: {layout: summary(d) for layout, d in per.items()} for key, per in times.items()}
    for key, per in res.items():
        for layout, r in per.items():
            print(f"{key:22s} {layout:8s} median {r['median_s']:.4f} s/subflow, mean {r['mean_s']:.4f}, "
                  f"stalls > 0.5 s: {len(r['stalls_s'])} of {r['subflows']} {r['stalls_s']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
