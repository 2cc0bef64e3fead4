"""What one step subflow costs in Prefect API work, and the 2-s stalls of a locked SQLite database (issue 15).

    python bench/subflow_overhead.py [--subflows 30] [--rounds 3] [--json F]

Empty subflows (`@flow def sub(i): return i`) called from a top flow, as the train flow calls its step flows (no
heartbeat thread of their own), against the run's own API server (flows/api_server.py), in two layouts alternated
round by round in one process: Prefect's default (a new async client per subflow's tracking task run) and
`flows.step.shared_async_client` (one started client for all). Twice: with the server's `RetrySoonWhenLocked`
(a 503 for a locked database asks for a 0.05-s retry) and without it (`LGRPO_API_RETRY_SOON=0`: Prefect's client then
sleeps ~2 s). Prints per layout the median seconds per subflow and the stalls (> 0.5 s).
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


def measure(subflows: int, rounds: int) -> dict:
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

    out = {"default": [], "shared": []}
    with api_server():
        top(3, False), top(3, True)  # warm-up
        for _ in range(rounds):
            for layout in out:
                out[layout] += top(subflows, layout == "shared")
    return {layout: {"median_s": round(statistics.median(d), 4), "mean_s": round(statistics.mean(d), 4),
                     "subflows": len(d), "stalls_s": [round(x, 2) for x in d if x > 0.5]} for layout, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subflows", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = {}
    for retry_soon in ("1", "0"):
        os.environ["LGRPO_API_RETRY_SOON"] = retry_soon  # read by the server child
        key = "retry_soon" if retry_soon == "1" else "prefect_default_retry"
        res[key] = measure(a.subflows, a.rounds)
        for layout, r in res[key].items():
            print(f"{key:22s} {layout:8s} median {r['median_s']:.4f} s/subflow, mean {r['mean_s']:.4f}, "
                  f"stalls > 0.5 s: {len(r['stalls_s'])} of {r['subflows']} {r['stalls_s']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
