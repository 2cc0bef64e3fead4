"""evaluate: held-out episodes (one rollout per task) with a given adapter, through the same stages as training.

Reports mean reward, completion rate (episodes that end with an answer), mean tokens per episode (answers and
tool results, as counted by the token budget), the tool-error rate (per model turn), the tool-result token share
and how episodes ended. Episodes and their sealed traces live under <run>/eval-<tag>/.
"""

from __future__ import annotations

from pathlib import Path

from artifacts import read_table, write_json
from stages.context import run_config, timer
from stages.generate import generate_turn, sample_tasks
from stages.gym import episode_stats, run_gym, verify_traces


def evaluate(run_dir: str, tag: str, adapter_in: str, export_in: str, base_in: str) -> dict:
    cfg = run_config(run_dir)
    root = Path(run_dir) / f"eval-{tag}"
    out = {"stage": "evaluate", "tag": tag}
    with timer(out):
        EVAL_STEP = -1  # seeds of held-out episodes never collide with a training step's
        st = sample_tasks(run_dir, EVAL_STEP, base_in, split="eval", n_groups=cfg.gym.eval_tasks,
                          out_path=str(root / "tasks.arrow"), scope=f"eval-{tag}")
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
        report = {
            "tag": tag, "episodes": n,
            "reward_mean": sum(r["reward"] for r in final) / n,
            **episode_stats(final),
            "mean_answer_tokens": answer_tokens / n,
            "tool_error_rate": tool_errors / max(turns, 1),
            "mean_turns": turns / n,
            "traces_verified": verify_traces(final),
        }
        write_json(root / "report.json", report)
        out.update(report)
    return out
