"""A user gym, written against the protocol in ``gyms.protocol``: guess a hidden number with a ``probe`` tool.

Plug it in with ``gym.name: examples.guess_gym:GuessGym`` (any importable ``module:Factory`` works; the factory
receives ``max_turns`` plus ``gym.options``). See docs/gyms.md.
"""

from __future__ import annotations

import random

from gyms.protocol import REASON_ANSWER, REASON_MAX_TURNS, EpisodeMetrics, StepResult, Task
from gyms.tools import Tool, ToolCallError, ToolError, format_tool_call, parse_tool_call, run_tool


class GuessGym:
    """The task hides a number in 1..high; ``probe(n)`` says whether the hidden number is higher, lower or equal.
    A final answer (a turn without a tool call) is correct when its last number is the hidden one (reward 1)."""

    def __init__(self, max_turns: int = 6, high: int = 16) -> None:
        if high < 2:
            raise ValueError(f"GuessGym: high must be >= 2, got {high}")
        self.max_turns, self.high = max_turns, high
        self.tools = [Tool("probe", "Compare n with the hidden number.",
                           {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                           fn=self._probe)]
        self._task: Task | None = None
        self.metrics = EpisodeMetrics()

    # -- TaskSource: how the trainer samples tasks and warm-starts on an oracle -----------------------------------
    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"GuessGym: split must be train or eval, got {split!r}")
        rng = random.Random(f"guess:{split}:{seed}")
        # odd hidden numbers are training tasks, even ones held out: the splits never share a task
        pool = [k for k in range(1, self.high + 1) if (k % 2 == 1) == (split == "train")]
        return [Task(f"guess-{split}-{seed}-{i}", f"Find the hidden number in 1..{self.high}.", t, {"hidden": t})
                for i, t in enumerate(rng.choice(pool) for _ in range(n))]

    def oracle_answers(self, task: Task) -> list[str]:
        lo, hi, answers = 1, self.high, []
        while True:  # binary search, then the number
            mid = (lo + hi) // 2
            answers.append(format_tool_call("probe", {"n": mid}))
            if mid == task.target:
                return answers + [str(mid)]
            lo, hi = (mid + 1, hi) if mid < task.target else (lo, mid - 1)

    def describe_tools(self) -> str:
        return "\n".join(f"{t.signature()}: {t.description}" for t in self.tools)

    # -- Env ---------------------------------------------------------------------------------------------------
    def _probe(self, n: int) -> str:
        if not 1 <= n <= self.high:
            raise ToolError(f"n must be in 1..{self.high}")
        hidden = self._task.data["hidden"]
        return "equal" if n == hidden else ("higher" if hidden > n else "lower")

    def reset(self, task: Task) -> str:
        self._task, self.metrics = task, EpisodeMetrics()
        return task.question

    def step(self, answer_text: str) -> StepResult:
        self.metrics.turns += 1
        call = parse_tool_call(answer_text, self.tools)  # never raises; None means a final answer
        info = {"tool_error": False, "tool_name": None, "reason": None}
        if call is None:
            numbers = [w for w in answer_text.replace(".", " ").split() if w.lstrip("-").isdigit()]
            correct = bool(numbers) and int(numbers[-1]) == self._task.target
            return StepResult(None, 1.0 if correct else 0.0, True, {**info, "reason": REASON_ANSWER,
                                                                     **self.metrics.to_dict()})
        self.metrics.tool_calls += 1
        if isinstance(call, ToolCallError):
            observation, error, name = call.observation, True, call.tool_name
        else:
            (observation, error), name = run_tool(call, self.tools), call.name
        self.metrics.tool_errors += int(error)
        info.update(tool_error=error, tool_name=name)
        done = self.metrics.turns >= self.max_turns
        info["reason"] = REASON_MAX_TURNS if done else None
        return StepResult(observation, 0.0, done, {**info, **self.metrics.to_dict()})
