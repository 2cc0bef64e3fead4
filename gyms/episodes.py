"""Live episodes of the driver: one environment per rollout row, kept across turns, rebuilt when needed.

run-gym is a task per turn. Within one process the environment of a row stays alive between turns (its tool
calls are not repeated). After a restart or a retried task the environment is rebuilt from the task and the
row's answer history: gyms are deterministic given the answers, and server-side tools are idempotent by
(episode id, call id), so a rebuilt episode neither re-records nor changes anything.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gyms.protocol import Env, StepResult, Task


@dataclass
class _Live:
    env: Env
    applied: int  # answers stepped since reset


def accepts_episode_id(env: Env) -> bool:
    try:
        return "episode_id" in inspect.signature(env.reset).parameters
    except (TypeError, ValueError):
        return False


class EnvPool:
    """Environments by episode id. Each episode is advanced by one thread at a time."""

    def __init__(self, make: Callable[[], Env], max_live: int = 4096) -> None:
        self.make = make
        self.max_live = max_live
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self.rebuilds = 0

    def _fresh(self, episode: str, task: Task, history: Sequence[str], ended: bool = False) -> _Live:
        env = self.make()
        if accepts_episode_id(env):
            env.reset(task, episode_id=episode)
        else:
            env.reset(task)
        for i, past in enumerate(history):
            res = env.step(past)
            if res.done and not (ended and i == len(history) - 1):
                raise RuntimeError(f"episode {episode!r}: the gym ended the episode while its history was replayed "
                                   "(the gym is not deterministic given the answers)")
        with self._lock:
            self.rebuilds += 1
        return _Live(env, len(history))

    def step(self, episode: str, task: Task, history: Sequence[str], answer: str) -> StepResult:
        """Apply ``answer`` as the turn after ``history``; reuse the live environment when it is at that point."""
        with self._lock:
            live = self._live.pop(episode, None)
        if live is None or live.applied != len(history):
            live = self._fresh(episode, task, history)
        result = live.env.step(answer)
        live.applied += 1
        with self._lock:
            if len(self._live) >= self.max_live:
                self._live.pop(next(iter(self._live)))  # oldest first; it will be rebuilt if it comes back
            self._live[episode] = live
        return result

    def close(self, episode: str, task: Task, history: Sequence[str]) -> list[dict[str, Any]] | None:
        """End the episode (for any reason): the gym's ``close()`` result (its sealed trace) or None."""
        with self._lock:
            live = self._live.pop(episode, None)
        if live is None or live.applied != len(history):
            live = self._fresh(episode, task, history, ended=True)
        close = getattr(live.env, "close", None)
        return close() if callable(close) else None
