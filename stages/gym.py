"""run-gym: the environment's side of a model turn (driver work: tools, rewards; collect-rollouts is stages/rollouts.py).

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

from artifacts import RunDir, read_table
from artifacts.tables import write_state
from engine.chat import ChatFormat
from gyms.protocol import REASON_ANSWER, REASON_BUDGET, Task
from gyms.trace import write_trace
from gyms.service import ToolTransportError
from stages.context import episode_pool, restart_dead_tool_server, reward_functions, run_config, timer
from stages import faults


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
        obs_ids = tok(ChatFormat.of(tok).observation_block(obs))["input_ids"]
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


@faults.kill_window("gym")
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
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(active) or 1))) as ex:
                advanced = {n["row"]: n for n in ex.map(work, active)}
        except ToolTransportError:
            # the stage fails (its task retries); if the run's own tool server died, the retry finds a new one
            restart_dead_tool_server(cfg, run_dir)
            raise
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
