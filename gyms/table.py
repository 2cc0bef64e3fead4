"""The built-in table gym: look two values up in a per-task table, combine them with ``calc``, answer.

Each task has its own small table {name: value}; the question names two entries and an operation
("What is the value of alpha plus the value of cedar?"). Tools: ``lookup(key)`` and ``calc(expression)``.
The oracle takes exactly four turns: lookup A, lookup B, calc "vA op vB", then the bare number.

Tools run in-process by default. With ``tool_client`` (``gym.transport: http``: the run's tool server, built from
``server_tools()``) every call goes to the server with the episode id, the turn as call id and the task's table as
the call's context; the server keeps the episode's sealed provenance trace, which ``close()`` returns. Observations
are the same text either way.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from gyms.service import SealedEpisodeMixin, ToolClient
from gyms.protocol import REASON_ANSWER, REASON_MAX_TURNS, EpisodeMetrics, StepResult, Task
from gyms.tools import (
    CALC_TOOL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Tool,
    ToolCall,
    ToolCallError,
    ToolError,
    format_tool_call,
    one_arg_tool,
    parse_tool_call,
    run_tool,
)

NAMES: tuple[str, ...] = (
    "alpha", "bravo", "cedar", "delta", "ember", "fox", "gamma", "hazel",
    "iris", "jade", "kilo", "lemon", "maple", "nova", "oak", "pearl",
    "quartz", "river", "sage", "tango", "umber", "vega", "willow", "zinc",
)
OPS: dict[str, str] = {"plus": "+", "minus": "-", "times": "*"}
SPLITS = ("train", "eval")
EVAL_MODULUS = 5  # a (A, B, op) triple is in the eval split when its hash % 5 == 0 (about 20 %)

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_MAX_NUMBER_CHARS = 32


def triple_split(a: str, b: str, op: str) -> str:
    """The split ("train" or "eval") that owns the question (A, B, op), by a stable hash."""
    digest = hashlib.sha256(f"{a}|{b}|{op}".encode()).digest()
    return "eval" if digest[0] % EVAL_MODULUS == 0 else "train"


def final_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (``-3``, ``19``, ``2.5``), or None if there is none."""
    matches = _NUMBER_RE.findall(text)
    if not matches or len(matches[-1]) > _MAX_NUMBER_CHARS:
        return None
    return Fraction(matches[-1])


def answer_is_correct(text: str, target: str | int) -> bool:
    """Integer targets: the last number in the answer equals it. String targets: exact match after strip."""
    if isinstance(target, int):
        number = final_number(text)
        return number is not None and number == target
    return text.strip() == target.strip()


class TableGym(SealedEpisodeMixin):
    """Multi-turn lookup-and-calculate gym. One episode at a time: ``reset(task)`` then ``step(...)``.

    Options: ``table_size`` (entries per task table, 2..24, default 6), ``max_value`` (values are drawn
    from 1..max_value, default 30), ``ops`` (subset of plus/minus/times), ``progress_reward`` (reward for the
    first successful lookup of each of the two names the question asks about, default 0: only a correct final
    answer earns 1.0). Shaping gives GRPO signal while a small model still fails the final answer.
    """

    def __init__(
        self,
        max_turns: int = 5,
        table_size: int = 6,
        max_value: int = 30,
        ops: Sequence[str] = tuple(OPS),
        progress_reward: float = 0.0,
        tool_client: ToolClient | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"TableGym: max_turns must be >= 1, got {max_turns}")
        if not 2 <= table_size <= len(NAMES):
            raise ValueError(f"TableGym: table_size must be in 2..{len(NAMES)}, got {table_size}")
        if max_value < 1:
            raise ValueError(f"TableGym: max_value must be >= 1, got {max_value}")
        unknown = [op for op in ops if op not in OPS]
        if unknown or not ops:
            raise ValueError(f"TableGym: ops must be a non-empty subset of {list(OPS)}, got {list(ops)}")
        self.max_turns = max_turns
        self.table_size = table_size
        self.max_value = max_value
        self.ops = tuple(ops)
        if not 0.0 <= progress_reward <= 1.0:
            raise ValueError(f"TableGym: progress_reward must be in [0, 1], got {progress_reward}")
        self.progress_reward = progress_reward
        if tool_client is not None and not all(callable(getattr(tool_client, m, None)) for m in ("call", "seal")):
            raise ValueError(f"TableGym: tool_client must have call(...) and seal(episode), "
                             f"got {type(tool_client).__name__}")
        self.client = tool_client
        self._episode_id: str | None = None
        self._sealed = False
        self.trace_entries: list[dict[str, Any]] | None = None
        self._found: set[str] = set()
        self.tools: list[Tool] = [self._lookup_tool(), CALC_TOOL]
        self._task: Task | None = None
        self._table: dict[str, int] = {}
        self._metrics = EpisodeMetrics()
        self._done = True

    # -- tools -------------------------------------------------------------------------------------

    def _lookup_tool(self) -> Tool:
        return one_arg_tool("lookup", "Value of a name in this task's table.", "key", "a name, e.g. alpha", self._lookup)

    def _lookup(self, key: str) -> str:
        return _lookup_in(self._table, key)

    def server_tools(self) -> list[Tool]:
        """The tools the tool server serves: ``lookup`` reads the table the gym sends as the call's context."""
        lookup = one_arg_tool("lookup", "Value of a name in this task's table.", "key", "a name, e.g. alpha",
                              lambda key, context: _lookup_in(context.get("table", {}), key))
        return [Tool(lookup.name, lookup.description, lookup.parameters, lookup.fn, takes_context=True), CALC_TOOL]

    def describe_tools(self) -> str:
        """A compact text description of the tools and the call format (for the system prompt)."""
        lines = [f"{tool.signature()}: {tool.description}" for tool in self.tools]
        lines.append(f'Call: {TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
        lines.append("Answer with the number only.")
        return "\n".join(lines)

    # -- tasks ---------------------------------------------------------------------------------------

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        """``n`` tasks, deterministic in (seed, split, options); train and eval never share an (A, B, op)."""
        if split not in SPLITS:
            raise ValueError(f"TableGym.sample_tasks: split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"TableGym.sample_tasks: n must be >= 0, got {n}")
        rng = random.Random(f"table:{split}:{seed}")
        return [self._sample_task(rng, split, f"table-{split}-{seed}-{i:05d}") for i in range(n)]

    def _sample_task(self, rng: random.Random, split: str, task_id: str) -> Task:
        while True:
            names = rng.sample(NAMES, self.table_size)
            a, b = names[0], names[1]
            op = rng.choice(self.ops)
            if triple_split(a, b, op) == split:
                break
        rng.shuffle(names)
        table = {name: rng.randint(1, self.max_value) for name in names}
        target = _apply(op, table[a], table[b])
        question = f'What is "{a}" {op} "{b}"?'  # quoted: the name tokenizes as in the JSON call
        return Task(id=task_id, question=question, target=target, data={"table": table, "a": a, "b": b, "op": op})

    def oracle_answers(self, task: Task) -> list[str]:
        """The expert's turn texts: lookup A, lookup B, calc "vA op vB", the bare number."""
        table, a, b, op = _unpack(task)
        expression = f"{table[a]}{OPS[op]}{table[b]}"  # no spaces: numbers tokenize as in observations
        return [
            format_tool_call("lookup", {"key": a}),
            format_tool_call("lookup", {"key": b}),
            format_tool_call("calc", {"expression": expression}),
            str(task.target),
        ]

    # -- episode -------------------------------------------------------------------------------------

    @property
    def metrics(self) -> EpisodeMetrics:
        """Counters of the current (or last) episode."""
        return self._metrics

    @property
    def done(self) -> bool:
        """True before the first ``reset`` and after an episode ended."""
        return self._done

    def reset(self, task: Task, episode_id: str | None = None) -> str:
        """Start an episode on ``task``; the first observation is the question. ``episode_id`` keys the tool
        server's calls and trace (with a ``tool_client``; a fresh uuid when not given)."""
        table, _, _, _ = _unpack(task)
        if self.client is not None:
            if episode_id is None:
                import uuid

                episode_id = f"table-{uuid.uuid4().hex}"
            elif not isinstance(episode_id, str) or not episode_id:
                raise ValueError(f"TableGym.reset: episode_id must be a non-empty string, got {episode_id!r}")
        self._episode_id, self._sealed, self.trace_entries = episode_id, False, None
        self._task = task
        self._table = dict(table)
        self._metrics = EpisodeMetrics()
        self._found = set()
        self._done = False
        return task.question

    def step(self, answer_text: str) -> StepResult:
        """One model turn: a final answer (no ``<tool_call>``) ends the episode; a tool call is executed.

        With a ``tool_client``, a ``ToolTransportError`` propagates and leaves the episode as it was, so the same
        turn can be retried (its call id is the turn index: the server replays it)."""
        if self._task is None or self._done:
            raise RuntimeError("TableGym.step: no episode running; call reset(task) first")
        parsed = parse_tool_call(answer_text, self.tools)
        if parsed is None:
            if self.client is not None:
                self._seal()  # may raise ToolTransportError: nothing has changed yet
            self._metrics.turns += 1
            correct = answer_is_correct(answer_text, self._task.target)
            return self._finish(None, 1.0 if correct else 0.0, REASON_ANSWER, tool_error=False, tool_name=None)
        retries = None
        if isinstance(parsed, ToolCallError):
            observation, tool_error, tool_name = parsed.observation, True, parsed.tool_name
        elif self.client is not None:
            reply = self.client.call(self._episode_id, str(self._metrics.turns), parsed.name, parsed.arguments,
                                     {"table": self._table})
            observation, tool_error, tool_name = reply.observation, bool(reply.is_error), parsed.name
            retries = len(reply.attempts)
        else:
            observation, tool_error = run_tool(parsed, self.tools)
            tool_name = parsed.name
        last = self._metrics.turns + 1 >= self.max_turns
        if last and self.client is not None:
            self._seal()
        self._metrics.turns += 1
        self._metrics.tool_calls += 1
        if tool_error:
            self._metrics.tool_errors += 1
        reward = self._progress(parsed) if not tool_error else 0.0
        if last:
            return self._finish(observation, reward, REASON_MAX_TURNS, tool_error=tool_error, tool_name=tool_name,
                                retries=retries)
        return StepResult(observation, reward, False, self._info(tool_error, tool_name, None, retries))

    def _progress(self, call: ToolCall) -> float:
        """`progress_reward` for the first lookup of each name the question asks about."""
        if call.name != "lookup" or not self.progress_reward:
            return 0.0
        _, a, b, _ = _unpack(self._task)
        key = str(call.arguments.get("key", "")).strip()
        if key in (a, b) and key not in self._found:
            self._found.add(key)
            return self.progress_reward
        return 0.0

    def _finish(
        self, observation: str | None, reward: float, reason: str, *, tool_error: bool, tool_name: str | None,
        retries: int | None = None,
    ) -> StepResult:
        self._done = True
        return StepResult(observation, reward, True, self._info(tool_error, tool_name, reason, retries))

    def _info(self, tool_error: bool, tool_name: str | None, reason: str | None,
              retries: int | None = None) -> dict[str, Any]:
        info = {"tool_error": tool_error, "tool_name": tool_name, "reason": reason, **self._metrics.to_dict()}
        if self.client is not None:
            info["transport_retries"] = retries or 0
        return info


def _lookup_in(table: dict[str, int], key: str) -> str:
    value = table.get(key.strip())
    if value is None:
        shown = key if len(key) <= 32 else key[:32] + "..."
        raise ToolError(f"unknown key {shown!r}")
    return str(value)


def _apply(op: str, x: int, y: int) -> int:
    if op == "plus":
        return x + y
    if op == "minus":
        return x - y
    return x * y


def _unpack(task: Task) -> tuple[dict[str, int], str, str, str]:
    """(table, a, b, op) from a table task, with a clear error for a task of another gym."""
    data = task.data
    missing = [key for key in ("table", "a", "b", "op") if key not in data]
    if missing:
        raise ValueError(f"task {task.id!r} is not a table task: data lacks {missing}")
    table, a, b, op = data["table"], data["a"], data["b"], data["op"]
    if a not in table or b not in table or op not in OPS:
        raise ValueError(f"task {task.id!r}: a/b must be table keys and op one of {list(OPS)}")
    return table, a, b, op
