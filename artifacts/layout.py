"""Run-directory layout: where every artifact of a run lives. Paths only; no I/O except ``ensure``.

```
<root>/config.yaml                   <root>/run.json (run id)       <root>/prepared.json   <root>/adapter-init/
<root>/parity_history.jsonl          <root>/metrics.jsonl           <root>/probe_history.jsonl
<root>/tensorboard/ (event files)    <root>/curves.png    <root>/summary.json    <root>/verified_checkpoint.json
<root>/step-0001/tasks.arrow         turn-01.arrow  gym-01.arrow   rollouts.arrow   replay.arrow   parity.json
                 optimize.json       adapter/       optimizer.safetensors
                 timings.json        metrics.json   probe.json     diagnostic-<gate>.json
<root>/eval-<tag>/tasks.arrow        turn-01.arrow  gym-01.arrow   report.json
<root>/export/<base_hash>/           <root>/bootstrap/<key>/          <root>/tokenizer/<key>/
<root>/tool-server/ (tool server logs)                                <root>/cache/vllm/
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP_DIR = re.compile(r"step-(\d{4,})")


def _index(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _key(name: str, value: str) -> str:
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(f"{name} must be a single non-empty path component, got {value!r}")
    return value


@dataclass(frozen=True)
class RunDir:
    """The directory of one training run."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # run-level files
    def config(self) -> Path:
        return self.root / "config.yaml"

    def parity_history(self) -> Path:
        return self.root / "parity_history.jsonl"

    def metrics_history(self) -> Path:
        return self.root / "metrics.jsonl"

    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    def curves_png(self) -> Path:
        return self.root / "curves.png"

    def run_info(self) -> Path:
        return self.root / "run.json"

    def prepared(self) -> Path:
        return self.root / "prepared.json"

    def adapter_init(self) -> Path:
        return self.root / "adapter-init"

    def summary(self) -> Path:
        return self.root / "summary.json"

    def probe_history(self) -> Path:
        return self.root / "probe_history.jsonl"

    def verified_checkpoint(self) -> Path:
        return self.root / "verified_checkpoint.json"

    def tool_server_logs(self) -> Path:
        return self.root / "tool-server"

    def vllm_cache(self) -> Path:
        return self.root / "cache" / "vllm"

    def error_log(self, stamp: str) -> Path:
        """Full traceback of a failed run or rerun (the CLI prints one line and this path)."""
        return self.root / "errors" / f"{stamp}.txt"

    def export_dir(self, base_hash: str) -> Path:
        return self.root / "export" / _key("base_hash", base_hash)

    def bootstrap_dir(self, key: str) -> Path:
        return self.root / "bootstrap" / _key("key", key)

    def tokenizer_dir(self, key: str) -> Path:
        return self.root / "tokenizer" / _key("key", key)

    # per-step files
    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{_index('step', step):04d}"

    def tasks(self, step: int) -> Path:
        return self.step_dir(step) / "tasks.arrow"

    def turn(self, step: int, t: int) -> Path:
        return self.step_dir(step) / f"turn-{_index('turn', t):02d}.arrow"

    def gym_turn(self, step: int, t: int) -> Path:
        return self.step_dir(step) / f"gym-{_index('turn', t):02d}.arrow"

    def rollouts(self, step: int) -> Path:
        return self.step_dir(step) / "rollouts.arrow"

    def replay(self, step: int) -> Path:
        return self.step_dir(step) / "replay.arrow"

    def parity(self, step: int) -> Path:
        return self.step_dir(step) / "parity.json"

    def loss(self, step: int) -> Path:
        return self.step_dir(step) / "optimize.json"

    def adapter(self, step: int) -> Path:
        return self.step_dir(step) / "adapter"

    def optimizer(self, step: int) -> Path:
        return self.step_dir(step) / "optimizer.safetensors"

    def timings(self, step: int) -> Path:
        return self.step_dir(step) / "timings.json"

    def metrics(self, step: int) -> Path:
        return self.step_dir(step) / "metrics.json"

    def probe(self, step: int) -> Path:
        return self.step_dir(step) / "probe.json"

    def diagnostic(self, step: int, gate: str) -> Path:
        return self.step_dir(step) / f"diagnostic-{_key('gate', gate)}.json"

    # held-out evaluation of one adapter (tag: e.g. "before", "step-0019")
    def eval_dir(self, tag: str) -> Path:
        return self.root / f"eval-{_key('tag', tag)}"

    def eval_tasks(self, tag: str) -> Path:
        return self.eval_dir(tag) / "tasks.arrow"

    def eval_turn(self, tag: str, t: int) -> Path:
        return self.eval_dir(tag) / f"turn-{_index('turn', t):02d}.arrow"

    def eval_gym_turn(self, tag: str, t: int) -> Path:
        return self.eval_dir(tag) / f"gym-{_index('turn', t):02d}.arrow"

    def eval_report(self, tag: str) -> Path:
        return self.eval_dir(tag) / "report.json"

    # directories
    def ensure(self, step: int | None = None) -> RunDir:
        """Create the root (and ``step_dir(step)`` when given); returns self."""
        self.root.mkdir(parents=True, exist_ok=True)
        if step is not None:
            self.step_dir(step).mkdir(exist_ok=True)
        return self

    def steps(self) -> list[int]:
        """Step numbers that have a step directory, ascending."""
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.fullmatch(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)
