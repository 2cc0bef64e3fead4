"""evaluate: held-out episodes (one rollout per task) with a given adapter, through the same stages as training.

Reports mean reward, success rate (episodes that end with a correct final answer), completion rate (episodes that end with an answer), mean tokens per episode (answers and
tool results, as counted by the token budget), the tool-error rate (per model turn), the tool-result token share
and how episodes ended. Episodes and their sealed traces live under <run>/eval-<tag>/.
"""

from __future__ import annotations

from artifacts import RunDir, read_table, write_json
from artifacts.progress import Progress
from stages.context import run_config, timer
from stages.generate import generate_turn, sample_tasks
from stages.gym import run_gym
from stages.rollouts import episode_stats, verify_traces


def evaluate(run_dir: str, tag: str, adapter_in: str, export_in: str, base_in: str) -> dict:
    cfg = run_config(run_dir)
    rd = RunDir(run_dir)
    out = {"stage": "evaluate", "tag": tag}
    with timer(out):
        EVAL_STEP = -1  # seeds of held-out episodes never collide with a training step's
        st = sample_tasks(run_dir, EVAL_STEP, base_in, split="eval", n_groups=cfg.gym.eval_tasks,
                          out_path=str(rd.eval_tasks(tag)), scope=f"eval-{tag}")
        state = st["path"]
        tool_errors = turns = answer_tokens = 0
        progress = Progress(f"evaluate-{tag}", cfg.gym.max_turns, "turns")
        for turn in range(cfg.gym.max_turns):
            tr = generate_turn(run_dir, EVAL_STEP, turn, state, adapter_in, export_in, base_in,
                               out_path=str(rd.eval_turn(tag, turn)))
            gr = run_gym(run_dir, EVAL_STEP, turn, state, tr["path"], base_in, out_path=str(rd.eval_gym_turn(tag, turn)))
            tool_errors += gr["tool_errors"]
            turns += tr["rows"]
            answer_tokens += tr["answer_tokens"]
            state = gr["path"]
            progress.update()
            if gr["all_done"]:
                progress.finish()
                break
        final = read_table(state).to_pylist()
        n = len(final)
        report = {
            "tag": tag, "episodes": n,
            "reward_mean": sum(r["reward"] for r in final) / n,
            **episode_stats(final),
            "mean_answer_tokens": answer_tokens / n,
            "tool_error_rate": tool_errors / max(turns, 1),
            "mean_turns": turns / n,
            "traces_verified": verify_traces(final),
        }
        write_json(rd.eval_report(tag), report)
        out.update(report)
    return out


def batch_reward_gain(rollouts_in: str, old_replay_in: str, new_replay_in: str) -> dict:
    """What one update did to reward on the rollouts it learned from, free of sampling noise.

    The updated policy's expected reward on a fresh step's own rollouts, estimated with self-normalized importance
    weights w_r = exp(sum over the episode's answer tokens of new - old trainer log-prob) within each GRPO group
    (thoughts are inputs to both scorings), minus the sampled mean: the gain, averaged over groups. `old_replay_in`
    is the fresh step's replay, `new_replay_in` the replay of the same rollouts by the next (reuse) step. A
    correct update raises it; a zero learning rate leaves it at 0; a flipped loss sign makes it negative.
    """
    import numpy as np

    roll = read_table(rollouts_in)
    old, new = read_table(old_replay_in), read_table(new_replay_in)
    rows = roll.column("row").to_pylist()
    if old.column("row").to_pylist() != rows or new.column("row").to_pylist() != rows:
        raise ValueError(f"{old_replay_in} / {new_replay_in} do not replay the turns of {rollouts_in} in order")
    delta: dict[int, float] = {}
    for r, a, b in zip(rows, old.column("trainer_logps").to_pylist(), new.column("trainer_logps").to_pylist()):
        delta[r] = delta.get(r, 0.0) + float(np.sum(np.asarray(b, np.float64) - np.asarray(a, np.float64)))
    reward = dict(zip(rows, roll.column("reward").to_pylist()))
    group = dict(zip(rows, roll.column("group").to_pylist()))
    gains, moved = [], 0
    for g in sorted(set(group.values())):
        rs = [r for r in reward if group[r] == g]
        d = np.asarray([delta[r] for r in rs])
        w = np.exp(d - d.max())
        R = np.asarray([reward[r] for r in rs], dtype=np.float64)
        gains.append(float((w * R).sum() / w.sum() - R.mean()))
        moved += int(np.ptp(R) > 0)
    return {"reward_gain": float(np.mean(gains)), "groups": len(gains), "groups_with_signal": moved,
            "mean_abs_logp_change": float(np.mean(np.abs(list(delta.values()))))}
