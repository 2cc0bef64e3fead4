"""bench/failure_modes.py classifies research-gym episodes played through the real gym (oracle and broken turns)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from failure_modes import classify  # noqa: E402
from gyms.research import ResearchGym  # noqa: E402


def play(env: ResearchGym, task, answers: list[str]) -> dict:
    """A row shaped as the evaluation's gym table stores it, from the gym's own step results."""
    env.reset(task, episode_id=f"fm-{task.id}-{len(answers)}-{hash(tuple(answers)) & 0xffff}")
    obs, reward, reason = [], 0.0, ""
    for i, text in enumerate(answers):
        res = env.step(text)
        obs.append(res.observation or "")
        reward = res.reward
        if res.done:
            reason = res.info.get("reason", "") if isinstance(res.info, dict) else ""
            answers = answers[: i + 1]
            break
    return {"task": json.dumps(task.to_dict()), "history": json.dumps(answers), "observations": json.dumps(obs),
            "success": reward >= 1.0, "reason": reason}


@pytest.fixture(scope="module")
def env_task():
    env = ResearchGym(n_entities=8, ops=["plus"], progress_reward=0.25)
    task = env.sample_tasks(1, seed=3, split="eval")[0]
    return env, task


def test_oracle_is_success(env_task):
    env, task = env_task
    assert classify(play(env, task, env.oracle_answers(task))) == "success"


def wrong(answer: str, task) -> str:
    """The final answer with its number off by one, citations kept (a detour that still answers right succeeds)."""
    return f"{int(task.target) + 1} " + answer.split(" ", 1)[1]


@pytest.mark.parametrize("edit,mode", [
    (lambda o, t: o[:5] + [wrong(o[5], t)], "answer copies the calc result wrong"),
    (lambda o, t: o[:5] + [str(t.target)], "answer right, citations missing a source"),
    (lambda o, t: o[:4] + [o[4].replace("+", "+1+", 1), wrong(o[5], t)], "calc copies a read value wrong"),
    (lambda o, t: o[:3] + [wrong(o[5], t)], "answered before reading both sources"),
    (lambda o, t: o[:4] + [wrong(o[5], t)], "answered before calc"),
    (lambda o, t: ['<tool_call>{"name": "read", "arguments": {doc_id: 1}}</tool_call>'] + o[:5] + [wrong(o[5], t)],
     "malformed tool call (turn 0)"),
    (lambda o, t: o[:2] + [o[1]] + o[2:5] + [wrong(o[5], t)], "repeated read"),
])
def test_first_departure(env_task, edit, mode):
    env, task = env_task
    row = play(env, task, edit(env.oracle_answers(task), task))
    assert not row["success"]
    assert classify(row) == mode
