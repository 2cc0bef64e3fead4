"""The built-in synthetic gym: the recipe's load shape, for benchmarks and full-size smoke runs.

A task is a long question (``prompt_words`` words of a fixed word list; with the project's BPE tokenizer a word is
about one to two tokens, the run reports the real token counts). Every model turn is answered with a tool result of
``tool_words`` words, whatever the answer says, so each turn costs what the recipe's turns cost (3,072-token prompt,
128-token tool results, ``max_turns`` turns). A real tool still runs: the answer text goes through the project's
tool-call parser; a well-formed ``fetch`` call is executed and counted, anything else is an ``error: ...``
observation padded to the same length. The reward, paid at the end, is a stable hash of the episode's answers mapped to
[0, 1] (16 bits): rows of one group differ, so GRPO has advantages to work with even on random weights (a {0, 1} hash
gave a group of 4 the same reward one time in 8 -- the first 27B step on the H200 had no advantage at all).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from gyms.protocol import REASON_MAX_TURNS, EpisodeMetrics, StepResult, Task
from gyms.tools import ToolCallError, format_tool_call, one_arg_tool, parse_tool_call, run_tool

WORDS: tuple[str, ...] = (
    "alpha", "bravo", "cedar", "delta", "ember", "fox", "gamma", "hazel", "iris", "jade", "kilo", "lemon",
    "maple", "nova", "oak", "pearl", "quartz", "river", "sage", "tango", "umber", "vega", "willow", "zinc",
)
SPLITS = ("train", "eval")


class SyntheticGym:
    """Fixed-shape episodes: a ``prompt_words`` question, ``max_turns`` turns, ``tool_words`` per tool result."""

    def __init__(self, max_turns: int = 4, prompt_words: int = 2048, tool_words: int = 96, seed: int = 0) -> None:
        if max_turns < 1 or prompt_words < 1 or tool_words < 1:
            raise ValueError(f"SyntheticGym: max_turns, prompt_words and tool_words must be >= 1, got "
                             f"{max_turns}, {prompt_words}, {tool_words}")
        self.max_turns, self.prompt_words, self.tool_words, self.seed = max_turns, prompt_words, tool_words, seed
        self.tools = [one_arg_tool("fetch", "Page of the document.", "page", "a page number, e.g. 1", self._fetch)]
        self._task: Task | None = None
        self._answers: list[str] = []
        self._metrics = EpisodeMetrics()
        self._done = True

    def _words(self, key: str, n: int) -> str:
        rng = random.Random(f"synthetic:{self.seed}:{key}")
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def _fetch(self, page: str) -> str:
        return self._words(f"{self._task.id}:{page}", self.tool_words)

    def describe_tools(self) -> str:
        return "fetch(page): Page of the document."

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"SyntheticGym.sample_tasks: split must be one of {SPLITS}, got {split!r}")
        tasks = []
        for i in range(n):
            tid = f"synthetic-{split}-{seed}-{i:05d}"
            tasks.append(Task(id=tid, question=self._words(tid, self.prompt_words), target=0, data={}))
        return tasks

    def oracle_answers(self, task: Task) -> list[str]:
        return [format_tool_call("fetch", {"page": str(t + 1)}) for t in range(self.max_turns)]

    @property
    def metrics(self) -> EpisodeMetrics:
        return self._metrics

    def reset(self, task: Task) -> str:
        self._task, self._answers, self._metrics, self._done = task, [], EpisodeMetrics(), False
        return task.question

    def step(self, answer_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("SyntheticGym.step: no episode running; call reset(task) first")
        self._metrics.turns += 1
        self._answers.append(answer_text)
        parsed = parse_tool_call(answer_text, self.tools)
        tool_error, tool_name = True, None
        if parsed is None:
            observation = "error: no tool call"
        elif isinstance(parsed, ToolCallError):
            observation, tool_name = parsed.observation, parsed.tool_name
            self._metrics.tool_calls += 1
        else:
            observation, tool_error = run_tool(parsed, self.tools)
            tool_name = parsed.name
            self._metrics.tool_calls += 1
        if tool_error:
            self._metrics.tool_errors += 1
            # the recipe's shape whatever the model wrote: pad the error to a tool result's length
            observation = observation + " " + self._words(f"{self._task.id}:pad:{self._metrics.turns}",
                                                          self.tool_words)
        info: dict[str, Any] = {"tool_error": tool_error, "tool_name": tool_name, "reason": None,
                                **self._metrics.to_dict()}
        if self._metrics.turns >= self.max_turns:
            self._done = True
            digest = hashlib.sha256("\x00".join(self._answers).encode()).digest()
            info["reason"] = REASON_MAX_TURNS
            return StepResult(observation, int.from_bytes(digest[:2], "big") / 65535, True, info)
        return StepResult(observation, 0.0, False, info)
