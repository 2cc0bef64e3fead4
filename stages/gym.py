"""run-gym and collect-rollouts: the environment's side of a rollout round (driver work: tools, rewards).

run-gym applies this turn's answer of every active row to its episode's environment (kept alive across turns in
this process, rebuilt from the task and answer history after a restart) and writes the next row state
gym-TT.arrow: next prefix ids (c_{t+1} = c_t ⊕ answer ⊕ observation), done flags, rewards, reasons, tool errors,
token counts and ``success`` (the episode ended with a correct final answer). It enforces the episode token
budget: the model's answer tokens plus every tool-result block it is shown (the question is not counted); an
episode whose next tool result does not fit, or that has fewer than two tokens left for its next answer, ends
with reason ``budget``. When an episode ends its sealed provenance trace (gyms with server-side tools) is stored
next to the step's artifacts, and TRL-style reward functions (``gym.reward_funcs``) add to its reward.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from artifacts import RunDir, read_table, write_table
from engine.chat import observation_block
from gyms.protocol import REASON_ANSWER, REASON_BUDGET, Task
from gyms.trace import TraceError, verify_trace, write_trace
from stages.context import episode_pool, reward_functions, run_config, timer

# Columns of a row-state table (tasks.arrow, gym-TT.arrow) and their Arrow element types.
STATE_COLUMNS = ("row", "group", "episode", "task", "prefix_ids", "done", "reward", "history", "observations",
                 "turn_reward", "observation", "reason", "tool_error", "model_tokens", "tool_tokens",
                 "transport_retries", "trace", "prefix_bounds", "success")


def write_state(path: str, rows: list[dict], metadata: dict[str, str]) -> None:
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


def initial_row(row: int, group: int, episode: str, task: Task, prefix_ids) -> dict:
    return {"row": row, "group": group, "episode": episode, "task": json.dumps(task.to_dict()),
            "prefix_ids": prefix_ids, "done": False, "reward": 0.0, "history": "[]", "observations": "[]",
            "turn_reward": 0.0, "observation": "", "reason": "", "tool_error": False, "model_tokens": 0,
            "tool_tokens": 0, "transport_retries": 0, "trace": "", "prefix_bounds": [], "success": False}


def answer_correct(res) -> bool:
    """Whether a step ended the episode with a correct final answer: the gym's ``info["correct"]`` when it says so,
    otherwise a positive reward on the answer turn (the built-in gyms pay 1.0 for a correct answer, 0 otherwise)."""
    if not res.done or res.info.get("reason") != REASON_ANSWER:
        return False
    return bool(res.info.get("correct", float(res.reward) > 0))


def budget_left(cfg, row: dict) -> int:
    """Tokens the row may still spend (answers + tool results)."""
    return cfg.gym.token_budget - int(row["model_tokens"]) - int(row["tool_tokens"])


def _advance(cfg, pool, tok, eos: int, r: dict, a: dict) -> tuple[dict, bool]:
    """One active row through its environment; returns the new row state and whether the episode just ended."""
    new = dict(r, observation="", tool_error=False, turn_reward=0.0, transport_retries=0)
    task = Task.from_dict(json.loads(r["task"]))
    history, observations = json.loads(r["history"]), json.loads(r["observations"])
    res = pool.step(r["episode"], task, history, a["answer_text"])
    ans_ids = list(a["answer_ids"])
    if not ans_ids or ans_ids[-1] != eos:
        ans_ids.append(eos)  # a truncated answer is closed before the next block
    history = history + [a["answer_text"]]
    new.update(history=json.dumps(history), done=bool(res.done), turn_reward=float(res.reward),
               reward=float(r["reward"]) + float(res.reward), reason=res.info.get("reason") or "",
               tool_error=bool(res.info.get("tool_error", False)),
               transport_retries=int(res.info.get("transport_retries", 0)),
               model_tokens=int(r["model_tokens"]) + len(ans_ids))
    new["success"] = answer_correct(res)
    prefix = list(r["prefix_ids"]) + ans_ids
    if not res.done:
        obs = res.observation or ""
        obs_ids = tok(observation_block(obs))["input_ids"]
        if budget_left(cfg, new) - len(obs_ids) < 2:  # the result does not fit, or leaves no room to answer
            new.update(done=True, reason=REASON_BUDGET)
        else:
            new.update(observation=obs, tool_tokens=int(r["tool_tokens"]) + len(obs_ids),
                       observations=json.dumps(observations + [obs]))
            prefix += obs_ids
    new["prefix_ids"] = prefix
    new["prefix_bounds"] = list(r.get("prefix_bounds") or []) + [len(r["prefix_ids"])]
    return new, new["done"]


def _store_trace(pool, r: dict, trace_dir: Path) -> str:
    """Close the episode; store its sealed trace (if the gym keeps one) and return the path ("" if none)."""
    task = Task.from_dict(json.loads(r["task"]))
    entries = pool.close(r["episode"], task, json.loads(r["history"]))
    if entries is None:
        return ""
    path = trace_dir / f"row-{int(r['row']):04d}.trace.jsonl"
    write_trace(path, entries)
    return str(path)


def transcript(question: str, r: dict) -> list[dict]:
    """The episode as chat messages (TRL's conversational completion format)."""
    msgs = []
    for i, answer in enumerate(json.loads(r["history"])):
        msgs.append({"role": "assistant", "content": answer})
        observations = json.loads(r["observations"])
        if i < len(observations):
            msgs.append({"role": "tool", "content": observations[i]})
    return msgs


def apply_reward_funcs(funcs, rows: list[dict]) -> None:
    """Add TRL-style rewards (``fn(prompts, completions, **kwargs) -> list[float | None]``) to finished rows."""
    if not funcs or not rows:
        return
    tasks = [Task.from_dict(json.loads(r["task"])) for r in rows]
    prompts = [[{"role": "user", "content": t.question}] for t in tasks]
    completions = [transcript(t.question, r) for t, r in zip(tasks, rows)]
    kwargs = {"task_id": [t.id for t in tasks], "target": [t.target for t in tasks],
              "reason": [r["reason"] for r in rows], "gym_reward": [float(r["reward"]) for r in rows]}
    for name, fn in funcs:
        values = fn(prompts=prompts, completions=completions, **kwargs)
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            raise ValueError(f"reward function {name} returned {type(values).__name__} of length "
                             f"{len(values) if hasattr(values, '__len__') else '?'}; expected a list of {len(rows)} "
                             "floats (None for not applicable), one per completion")
        for r, v in zip(rows, values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                raise ValueError(f"reward function {name} returned {v!r}; rewards must be finite numbers or None")
            r["reward"] = float(r["reward"]) + float(v)
            r["turn_reward"] = float(r["turn_reward"]) + float(v)


def run_gym(run_dir: str, step: int, turn: int, state_in: str, turn_in: str, base_in: str,
            out_path: str | None = None) -> dict:
    from engine.runtime import tokenizer

    cfg = run_config(run_dir)
    out = {"stage": "run-gym", "turn": turn}
    with timer(out):
        state = read_table(state_in).to_pylist()
        answers = {r["row"]: r for r in read_table(turn_in).to_pylist()}
        tok = tokenizer(base_in)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        pool = episode_pool(cfg, run_dir)
        path = Path(out_path or RunDir(run_dir).gym_turn(step, turn))
        trace_dir = path.parent / "traces"
        active = [r for r in state if not r["done"]]
        missing = [r["row"] for r in active if r["row"] not in answers]
        if missing:
            raise ValueError(f"{turn_in} has no answer for active rows {missing[:8]}: it does not belong to {state_in}")

        def work(r: dict) -> dict:
            new, ended = _advance(cfg, pool, tok, eos, r, answers[r["row"]])
            if ended:
                new["trace"] = _store_trace(pool, new, trace_dir)
            return new

        workers = cfg.gym.tool_server.concurrency if cfg.gym.transport == "http" else 1
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(active) or 1))) as ex:
            advanced = {n["row"]: n for n in ex.map(work, active)}
        finished_now = [advanced[r["row"]] for r in active if advanced[r["row"]]["done"]]
        apply_reward_funcs(reward_functions(cfg), finished_now)
        rows = [advanced.get(r["row"], dict(r, observation="", tool_error=False, turn_reward=0.0,
                                             transport_retries=0)) for r in state]
        write_state(str(path), rows, metadata={"step": str(step), "turn": str(turn)})
        out.update(path=str(path), active=len(active), finished=len(finished_now),
                   tool_errors=sum(r["tool_error"] for r in advanced.values()),
                   transport_retries=sum(r["transport_retries"] for r in advanced.values()),
                   budget_ended=sum(r["reason"] == REASON_BUDGET for r in finished_now),
                   all_done=all(r["done"] for r in rows))
    return out


def episode_stats(final: list[dict]) -> dict:
    """Episode-level metrics of a finished row state: completion, tokens, tool-result share, end reasons."""
    n = max(len(final), 1)
    model = sum(int(r["model_tokens"]) for r in final)
    tool = sum(int(r["tool_tokens"]) for r in final)
    reasons: dict[str, int] = {}
    for r in final:
        reasons[r["reason"] or "unfinished"] = reasons.get(r["reason"] or "unfinished", 0) + 1
    return {
        "completion_rate": sum(r["reason"] == "answer" for r in final) / n,
        # share of episodes that ended with a correct final answer (tables written before the column: False)
        "success_rate": sum(bool(r.get("success", False)) for r in final) / n,
        "mean_tokens": (model + tool) / n,
        "tool_token_share": tool / max(model + tool, 1),
        "end_reasons": reasons,
        "transport_retries": sum(int(r.get("transport_retries", 0)) for r in final),
    }


def verify_traces(final: list[dict]) -> int:
    """Verify the stored sealed trace of every finished episode that has one; returns how many were checked.

    A trace that fails verification means the stored provenance was changed: the ``provenance`` gate fails."""
    from engine.gates import GateFailed

    checked = 0
    for r in final:
        if r["trace"]:
            try:
                verify_trace(r["trace"], episode=r["episode"])
            except (TraceError, OSError) as exc:
                raise GateFailed("provenance", f"row {r['row']}: {exc}", {"row": r["row"], "trace": r["trace"]}) from exc
            checked += 1
    return checked


def collect_rollouts(run_dir: str, step: int, turn_ins: list[str], gym_ins: list[str],
                     out_path: str | None = None) -> dict:
    """One record per (rollout, turn) with the rollout's reward and group-relative advantage (rollouts.arrow)."""
    import torch

    from engine.loss import group_advantages

    cfg = run_config(run_dir)
    out = {"stage": "collect-rollouts"}
    with timer(out):
        final = read_table(gym_ins[-1]).to_pylist()
        rewards = torch.tensor([r["reward"] for r in final], dtype=torch.float32)
        groups = [r["group"] for r in final]
        G = cfg.grpo.num_generations
        if any(groups[i] != groups[i - i % G] for i in range(len(groups))):
            raise ValueError(f"rows are not laid out in groups of num_generations={G}")
        adv = group_advantages(rewards, G, cfg.grpo.scale_rewards)
        recs = []
        tool_errors = 0
        for t, (tin, gin) in enumerate(zip(turn_ins, gym_ins)):
            errs = {r["row"]: r["tool_error"] for r in read_table(gin).to_pylist()}
            for r in read_table(tin).to_pylist():
                tool_errors += int(errs[r["row"]])
                recs.append((r["row"], t, r))
        recs.sort(key=lambda x: (x[0], x[1]))
        meta = read_table(turn_ins[0]).schema.metadata  # K, d and sigma are the same in every turn file
        K, d = int(meta[b"K"]), int(meta[b"d"])
        traces = verify_traces(final)
        path = out_path or str(RunDir(run_dir).rollouts(step))
        write_table(path, {
            "row": np.asarray([r for r, _, _ in recs], dtype=np.int32),
            "group": np.asarray([groups[r] for r, _, _ in recs], dtype=np.int32),
            "turn": np.asarray([t for _, t, _ in recs], dtype=np.int32),
            "prefix_ids": [np.asarray(x["prefix_ids"], dtype=np.int32) for _, _, x in recs],
            "thoughts": [np.asarray(x["thoughts"], dtype=np.float32).reshape(K, d) for _, _, x in recs],
            "thought_logq": [np.asarray(x["thought_logq"], dtype=np.float32) for _, _, x in recs],
            "answer_ids": [np.asarray(x["answer_ids"], dtype=np.int32) for _, _, x in recs],
            "sampler_logps": [np.asarray(x["sampler_logps"], dtype=np.float32) for _, _, x in recs],
            "answer_text": [x["answer_text"] for _, _, x in recs],
            "reward": np.asarray([float(rewards[r]) for r, _, _ in recs], dtype=np.float32),
            "advantage": np.asarray([float(adv[r]) for r, _, _ in recs], dtype=np.float32),
        }, metadata={"step": str(step), "K": str(K), "d": str(d), "rows": str(len(final)),
                     "num_generations": str(G), "sigma": meta[b"sigma"].decode()})
        n = len(final)
        out.update(
            path=path, rollouts=n, turns=len(recs),
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if n > 1 else 0.0,
            tool_error_rate=tool_errors / max(len(recs), 1),
            mean_turns=len(recs) / n,
            answer_tokens=sum(len(x["answer_ids"]) for _, _, x in recs),
            traces_verified=traces,
            **episode_stats(final),
        )
    return out
