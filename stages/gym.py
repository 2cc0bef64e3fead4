"""run-gym and collect-rollouts: the environment's side of a rollout round (driver work: tools, rewards).

run-gym rebuilds each active row's episode from its task and answer history (gyms are deterministic given the
answers), applies this turn's answer, and writes the next row state gym-TT.arrow: next prefix ids
(c_{t+1} = c_t ⊕ answer ⊕ observation), done flags, rewards, reasons, tool errors.
"""

from __future__ import annotations

import json

import numpy as np

from artifacts import RunDir, read_table, write_table
from engine.chat import observation_block
from gym.protocol import Task
from stages.context import env_factory, run_config, timer


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
        make = env_factory(cfg)
        rows, tool_errors, finished = [], 0, 0
        for r in state:
            new = dict(r)
            new["observation"], new["tool_error"], new["turn_reward"] = "", False, 0.0
            new.setdefault("reason", "")  # a finished row keeps the reason it ended with
            if not r["done"]:
                a = answers[r["row"]]
                env = make()
                env.reset(Task.from_dict(json.loads(r["task"])))
                history = json.loads(r["history"])
                for past in history:
                    env.step(past)
                res = env.step(a["answer_text"])
                tool_errors += int(res.info["tool_error"])
                ans_ids = list(a["answer_ids"])
                if not ans_ids or ans_ids[-1] != eos:
                    ans_ids.append(eos)  # a truncated answer is closed before the next block
                new["history"] = json.dumps(history + [a["answer_text"]])
                new["done"] = bool(res.done)
                new["reward"] = float(r["reward"]) + float(res.reward)
                new["turn_reward"] = float(res.reward)
                new["reason"] = res.info.get("reason") or ""
                new["tool_error"] = bool(res.info["tool_error"])
                if res.done:
                    finished += 1
                    new["prefix_ids"] = list(r["prefix_ids"]) + ans_ids
                else:
                    new["observation"] = res.observation or ""
                    obs_ids = tok(observation_block(new["observation"]))["input_ids"]
                    new["prefix_ids"] = list(r["prefix_ids"]) + ans_ids + obs_ids
            rows.append(new)
        path = out_path or str(RunDir(run_dir).gym_turn(step, turn))
        write_table(path, {
            "row": np.asarray([r["row"] for r in rows], dtype=np.int32),
            "group": np.asarray([r["group"] for r in rows], dtype=np.int32),
            "task": [r["task"] for r in rows],
            "prefix_ids": [np.asarray(r["prefix_ids"], dtype=np.int32) for r in rows],
            "done": np.asarray([r["done"] for r in rows], dtype=bool),
            "reward": np.asarray([r["reward"] for r in rows], dtype=np.float32),
            "history": [r["history"] for r in rows],
            "turn_reward": np.asarray([r["turn_reward"] for r in rows], dtype=np.float32),
            "observation": [r["observation"] for r in rows],
            "reason": [r["reason"] for r in rows],
            "tool_error": np.asarray([r["tool_error"] for r in rows], dtype=bool),
        }, metadata={"step": str(step), "turn": str(turn)})
        out.update(path=path, active=len(answers), finished=finished, tool_errors=tool_errors,
                   all_done=all(r["done"] for r in rows))
    return out


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
            completion_rate=sum(r["reason"] == "answer" for r in final) / n,
            tool_error_rate=tool_errors / max(len(recs), 1),
            mean_turns=len(recs) / n,
            answer_tokens=sum(len(x["answer_ids"]) for _, _, x in recs),
        )
    return out
