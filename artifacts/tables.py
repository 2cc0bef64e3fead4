"""The run's tables, declared once: columns, their Arrow element types and metadata (no torch imported here).

    row state   tasks.arrow (sample-tasks), gym-TT.arrow (run-gym): one record per rollout, the episode so far
    turn        turn-TT.arrow (generate-turn): per active row its prefix, thoughts, answer, sampler log-probs
    rollouts    rollouts.arrow (collect-rollouts): per (rollout, turn) the turn plus reward and advantage
    replay      replay.arrow (replay): per (rollout, turn) the trainer's log-probs, densities, loss mask; the plan

Every table is written atomically with its hash sidecar (artifacts.store.write_table); stages read them back with
``artifacts.read_table`` and their metadata as str with ``table_meta``.
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


# -- a model turn (turn-TT.arrow, generate-turn): one record per active row -------------------------------------------
TURN_COLUMNS = ("row", "prefix_ids", "thoughts", "thought_logq", "answer_ids", "sampler_logps", "answer_text")


def write_turn(path: str, rows, prefixes, thoughts, thought_logq, answer_ids, sampler_logps, answer_text, *,
               step: int, turn: int, K: int, d: int, sigma: float) -> None:
    """thoughts: per row (K, d) FP32; thought_logq: per row (K,); sampler_logps: per answer token. Metadata: step,
    turn, K, d and sigma (repr: read back exactly)."""
    write_table(path, {
        "row": np.asarray(rows, dtype=np.int32),
        "prefix_ids": [np.asarray(p, dtype=np.int32) for p in prefixes],
        "thoughts": [np.asarray(z, dtype=np.float32).reshape(K, d) for z in thoughts],
        "thought_logq": [np.asarray(q, dtype=np.float32) for q in thought_logq],
        "answer_ids": [np.asarray(a, dtype=np.int32) for a in answer_ids],
        "sampler_logps": [np.asarray(lp, dtype=np.float32) for lp in sampler_logps],
        "answer_text": list(answer_text),
    }, metadata={"step": str(step), "turn": str(turn), "K": str(K), "d": str(d), "sigma": repr(sigma)})


# -- the rollouts of a step (rollouts.arrow, collect-rollouts): one record per (rollout, turn) ------------------------
ROLLOUT_COLUMNS = ("row", "group", "turn", *TURN_COLUMNS[1:], "reward", "advantage")


def write_rollouts(path: str, recs: list[dict], *, step: int, K: int, d: int, rows: int, num_generations: int,
                   sigma: str) -> None:
    """recs: dicts with ROLLOUT_COLUMNS, sorted by (row, turn). sigma: the turn tables' metadata string."""
    write_table(path, {
        "row": np.asarray([r["row"] for r in recs], dtype=np.int32),
        "group": np.asarray([r["group"] for r in recs], dtype=np.int32),
        "turn": np.asarray([r["turn"] for r in recs], dtype=np.int32),
        "prefix_ids": [np.asarray(r["prefix_ids"], dtype=np.int32) for r in recs],
        "thoughts": [np.asarray(r["thoughts"], dtype=np.float32).reshape(K, d) for r in recs],
        "thought_logq": [np.asarray(r["thought_logq"], dtype=np.float32) for r in recs],
        "answer_ids": [np.asarray(r["answer_ids"], dtype=np.int32) for r in recs],
        "sampler_logps": [np.asarray(r["sampler_logps"], dtype=np.float32) for r in recs],
        "answer_text": [r["answer_text"] for r in recs],
        "reward": np.asarray([r["reward"] for r in recs], dtype=np.float32),
        "advantage": np.asarray([r["advantage"] for r in recs], dtype=np.float32),
    }, metadata={"step": str(step), "K": str(K), "d": str(d), "rows": str(rows),
                 "num_generations": str(num_generations), "sigma": sigma})


# -- the trainer's replay of a step (replay.arrow): one record per (rollout, turn), in the rollouts' order --------------
REPLAY_COLUMNS = ("row", "trainer_logps", "trainer_logq", "loss_mask")


def write_replay(path: str, rows, trainer_logps, trainer_logq, loss_mask, *, step: int, fresh: bool, adapter: str,
                 plan: dict) -> None:
    """plan: {"microbatches": [[turn indices]], "tiers": [tier per micro-batch]} -- optimize follows it exactly."""
    write_table(path, {
        "row": np.asarray(rows, dtype=np.int32),
        "trainer_logps": [np.asarray(x, dtype=np.float32) for x in trainer_logps],
        "trainer_logq": [np.asarray(x, dtype=np.float32) for x in trainer_logq],
        "loss_mask": [np.asarray(k, dtype=bool) for k in loss_mask],
    }, metadata={"step": str(step), "fresh": str(fresh), "adapter": adapter,
                 "microbatches": str(len(plan["microbatches"])), "plan": json.dumps(plan)})
