"""The environment protocol shared by every gym (built-in or imported).

An environment runs one episode at a time:

* ``reset(task) -> str`` starts an episode and returns the first observation (the user prompt text);
* ``step(answer_text) -> StepResult`` consumes one model turn (the sampler's answer text) and returns
  what the model sees next, the reward and whether the episode is over.

Pure Python, no torch: the driver (rank 0) runs gyms next to the loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

# Why an episode ended: the model gave a final answer, it ran out of turns, or out of its token budget
# (the driver ends an episode with "budget"; gyms themselves end with "answer" or "max_turns").
DoneReason = Literal["answer", "max_turns", "budget"]
REASON_ANSWER: DoneReason = "answer"
REASON_MAX_TURNS: DoneReason = "max_turns"
REASON_BUDGET: DoneReason = "budget"


@dataclass(frozen=True)
class Task:
    """One episode's task: the question shown to the model, the target answer and gym-private data."""

    id: str
    question: str
    target: str | int
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (``data`` must itself hold only JSON values)."""
        return {"id": self.id, "question": self.question, "target": self.target, "data": dict(self.data)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Task":
        """Inverse of ``to_dict``; says which field is missing or has the wrong type."""
        if not isinstance(raw, dict):
            raise TypeError(f"Task.from_dict: expected a dict, got {type(raw).__name__}")
        for key in ("id", "question", "target"):
            if key not in raw:
                raise ValueError(f"Task.from_dict: missing field {key!r}")
        if not isinstance(raw["id"], str):
            raise TypeError(f"Task.from_dict: 'id' must be a string, got {type(raw['id']).__name__}")
        if not isinstance(raw["question"], str):
            raise TypeError(f"Task.from_dict: 'question' must be a string, got {type(raw['question']).__name__}")
        target = raw["target"]
        if isinstance(target, bool) or not isinstance(target, (str, int)):
            raise TypeError(f"Task.from_dict: 'target' must be a string or an integer, got {type(target).__name__}")
        data = raw.get("data", {})
        if not isinstance(data, dict):
            raise TypeError(f"Task.from_dict: 'data' must be a dict, got {type(data).__name__}")
        return cls(id=raw["id"], question=raw["question"], target=target, data=dict(data))


@dataclass
class EpisodeMetrics:
    """Per-episode counters.

    ``turns`` counts model turns (``step`` calls); ``tool_calls`` counts turns that contained a
    ``<tool_call>`` tag, valid or not; ``tool_errors`` counts those that produced an ``error: ...``
    observation (malformed call, or the tool refused its arguments).
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class StepResult:
    """The outcome of one model turn.

    ``observation`` is the text the model sees next (the tool result or ``error: ...``); it is None
    after a final answer. When ``done`` is True no further turn is taken, whatever ``observation`` holds.
    ``info`` always has ``tool_error`` (bool), ``tool_name`` (str | None) and ``reason``
    ("answer", "max_turns" or None while the episode goes on), plus the episode counters
    ``turns``, ``tool_calls`` and ``tool_errors``.
    """

    observation: str | None
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    """What the trainer needs from an environment.

    Optional extras the driver uses when present:

    * ``reset(task, episode_id=...)``: the driver passes a run-unique episode id (``run:step:row``) when
      ``reset`` accepts the keyword; gyms with server-side tools key their calls and trace by it;
    * ``close() -> list[dict] | None``: called once when the episode ends for any reason (answer, max_turns,
      budget); returns the episode's sealed provenance trace (``gyms.trace``) or None.
    """

    def reset(self, task: Task) -> str:
        """Start an episode on ``task``; return the first observation (the user prompt)."""
        ...

    def step(self, answer_text: str) -> StepResult:
        """Consume one model turn's answer text."""
        ...


@runtime_checkable
class TaskSource(Protocol):
    """What a gym offers beyond ``Env`` so the trainer can sample tasks and warm-start on an oracle."""

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        ...

    def oracle_answers(self, task: Task) -> list[str]:
        ...

    def describe_tools(self) -> str:
        ...
