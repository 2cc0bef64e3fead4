"""evaluate: held-out episodes (one rollout per task) with a given adapter, through the same stages as training.

Reports mean reward, completion rate (episodes that end with an answer), mean tokens per episode and the
tool-error rate. Episodes live under <run>/eval-<tag>/.
"""

from __future__ import annotations

from pathlib import Path

from artifacts import read_table, write_json
from stages.context import run_config, timer
from stages.generate import generate_turn, sample_tasks
from stages.gym import run_gym


def evaluate(run_dir: str, tag: str, adapter_in: str, export_in: str, base_in: str) -> dict:
    cfg = run_config(run_dir)
    root = Path(run_dir) / f"eval-{tag}"
    out = {"stage": "evaluate", "tag": tag}
    with timer(out):
        EVAL_STEP = -1  # seeds of held-out episodes never collide with a training step's
        st = sample_tasks(run_dir, EVAL_STEP, base_in, split="eval", n_groups=cfg.gym.eval_tasks,
                          out_path=str(root / "tasks.arrow"))
        state = st["path"]
        tool_errors = turns = answer_tokens = 0
        for turn in range(cfg.gym.max_turns):
            tr = generate_turn(run_dir, EVAL_STEP, turn, state, adapter_in, export_in, base_in,
                               out_path=str(root / f"turn-{turn:02d}.arrow"))
            gr = run_gym(run_dir, EVAL_STEP, turn, state, tr["path"], base_in, out_path=str(root / f"gym-{turn:02d}.arrow"))
            tool_errors += gr["tool_errors"]
            turns += tr["rows"]
            answer_tokens += tr["answer_tokens"]
            state = gr["path"]
            if gr["all_done"]:
                break
        final = read_table(state).to_pylist()
        n = len(final)
        episode_tokens = sum(len(r["prefix_ids"]) for r in final)
        report = {
            "tag": tag, "episodes": n,
            "reward_mean": sum(r["reward"] for r in final) / n,
            "completion_rate": sum(r["reason"] == "answer" for r in final) / n,
            "mean_tokens": episode_tokens / n,
            "mean_answer_tokens": answer_tokens / n,
            "tool_error_rate": tool_errors / max(turns, 1),
            "mean_turns": turns / n,
        }
        write_json(root / "report.json", report)
        out.update(report)
    return out
