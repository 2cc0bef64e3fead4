"""How many times one step hashes the adapter and the optimizer state (the reads' sha256 verification).

Why: at the 27B shape the DoRA r16 adapter is ~450 MB and the AdamW state ~900 MB (FP32, estimated from the
shapes), and sha256 runs at ~1.6 GB/s on one core: every hash of them costs 0.3-0.6 s of the step. This runs the
tiny random-base step of tests/test_random_base.py (4 turns: the generate stage asks for the adapter on every turn)
and counts, during step 1 (a fresh step after step 0), the verifications of adapter_model.safetensors and
optimizer.safetensors (the writes' own hash is not counted: it happens once per write either way).

    python bench/hash_census.py --out bench/results/cpu-hash-census-DATE.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from artifacts import store
    from tests.conftest import fresh_step, make_run
    from tests.test_random_base import RANDOM

    run_dir = make_run(Path(tempfile.mkdtemp(prefix="hash-census-")), **(RANDOM | {"gym.max_turns": a.turns}))
    fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    time.sleep(0.3)  # past artifacts.store's settle time, as between two steps of a real run
    counts: collections.Counter = collections.Counter()
    real = store.verify

    def counting(p):
        if Path(p).name in ("adapter_model.safetensors", "optimizer.safetensors"):
            counts[Path(p).name] += 1
        return real(p)

    store.verify = counting
    fresh_step(run_dir, 1, f"{run_dir}/step-0000/adapter")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"commit": commit, "turns": a.turns, "verifications_in_step_1": dict(counts)}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
