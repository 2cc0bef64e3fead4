"""The run's tables, declared once: columns, their Arrow element types and metadata (no torch imported here).

Row state (tasks.arrow from sample-tasks, gym-TT.arrow from run-gym): one record per rollout, what the episode is
and where it stands; the stages read it back with ``artifacts.read_table``.
"""

from __future__ import annotations

import json

import numpy as np

from artifacts.store import read_table, write_table


def table_meta(path_or_table) -> dict[str, str]:
    """A table's metadata as str -> str (Arrow keeps bytes)."""
    t = read_table(path_or_table) if isinstance(path_or_table, str) else path_or_table
    return {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items()}


# Columns of a row-state table (tasks.arrow, gym-TT.arrow) and their Arrow element types.
STATE_COLUMNS = ("row", "group", "episode", "task", "prefix_ids", "done", "reward", "history", "observations",
                 "turn_reward", "observation", "reason", "tool_error", "model_tokens", "tool_tokens",
                 "transport_retries", "trace", "prefix_bounds", "success")


def write_state(path: str, rows: list[dict], metadata: dict[str, str]) -> None:
    """The row-state table (tasks.arrow, gym-TT.arrow): one row per rollout, columns STATE_COLUMNS."""
    write_table(path, {
        "row": np.asarray([r["row"] for r in rows], dtype=np.int32),
        "group": np.asarray([r["group"] for r in rows], dtype=np.int32),
        "episode": [r["episode"] for r in rows],
        "task": [r["task"] for r in rows],
        "prefix_ids": [np.asarray(r["prefix_ids"], dtype=np.int32) for r in rows],
        "done": np.asarray([r["done"] for r in rows], dtype=bool),
        "reward": np.asarray([r["reward"] for r in rows], dtype=np.float32),
        "history": [r["history"] for r in rows],
        "observations": [r["observations"] for r in rows],
        "turn_reward": np.asarray([r["turn_reward"] for r in rows], dtype=np.float32),
        "observation": [r["observation"] for r in rows],
        "reason": [r["reason"] for r in rows],
        "tool_error": np.asarray([r["tool_error"] for r in rows], dtype=bool),
        "model_tokens": np.asarray([r["model_tokens"] for r in rows], dtype=np.int32),
        "tool_tokens": np.asarray([r["tool_tokens"] for r in rows], dtype=np.int32),
        "transport_retries": np.asarray([r["transport_retries"] for r in rows], dtype=np.int32),
        "trace": [r["trace"] for r in rows],
        # lengths of the row's earlier turn prefixes c_0..c_{t-1}: the prefix cache's chunk boundaries, which make
        # the generation states (and thoughts) bitwise independent of what the cache holds
        "prefix_bounds": [np.asarray(r.get("prefix_bounds") or [], dtype=np.int32) for r in rows],
        "success": np.asarray([bool(r.get("success", False)) for r in rows], dtype=bool),
    }, metadata=metadata)


def initial_row(row: int, group: int, episode: str, task: dict, prefix_ids) -> dict:
    """A row's state before its first turn. task: the gym task as a dict (Task.to_dict())."""
    return {"row": row, "group": group, "episode": episode, "task": json.dumps(task),
            "prefix_ids": prefix_ids, "done": False, "reward": 0.0, "history": "[]", "observations": "[]",
            "turn_reward": 0.0, "observation": "", "reason": "", "tool_error": False, "model_tokens": 0,
            "tool_tokens": 0, "transport_retries": 0, "trace": "", "prefix_bounds": [], "success": False}
