"""TRL-style reward functions: ``fn(prompts, completions, **kwargs) -> list[float | None]``.

``prompts[i]`` is the episode's question as chat messages, ``completions[i]`` the episode as chat messages
(assistant answers and tool results, role "tool"); kwargs carry ``task_id``, ``target``, ``reason`` (how the
episode ended) and ``gym_reward``, one entry per episode. None means "not applicable" (adds nothing).
Enable with ``gym.reward_funcs: [examples.rewards:fewer_turns]``; the values add to the gym's own reward.
"""

from __future__ import annotations


def fewer_turns(prompts, completions, **kwargs) -> list[float | None]:
    """-0.05 per model turn beyond the fourth, for episodes that ended with an answer; None otherwise."""
    out: list[float | None] = []
    for messages, reason in zip(completions, kwargs["reason"]):
        turns = sum(m["role"] == "assistant" for m in messages)
        out.append(-0.05 * max(0, turns - 4) if reason == "answer" else None)
    return out


def valid_tool_calls(prompts, completions, **kwargs) -> list[float]:
    """+0.05 per tool call the gym executed (a tool result that is not an ``error: ...`` observation): a format
    reward that gives an untrained policy a signal before it finds right answers."""
    return [0.05 * sum(m["role"] == "tool" and not str(m["content"]).startswith("error") for m in messages)
            for messages in completions]
