"""Orchestration cost against TRL's GRPOTrainer on the same tiny single-turn work (issue 15).

    python bench/trl_compare.py [--steps 2 10] [--json F]

Both arms: the embedded default's tiny hybrid (the same bootstrapped base, FP32, CPU, one thread), LoRA r16 on the
same targets, one model turn of up to 32 answer tokens and no latent thoughts, 2 groups of 4 completions per step,
the same learning rate, a reward that does not need a tool (the answer's length in characters / 100: no gym work on
either side).

- TRL: `trl.GRPOTrainer` (transformers' `generate`, its loss, AdamW) on prompts of the table gym's questions.
- This project: `grpo_step` flows through Prefect as the train flow runs them (a temporary local API server, every
  task, cache, artifact and gate), `gym.max_turns: 1`, `latent.max_latent_steps: 0`, fresh steps only.

The step time of each arm is the marginal wall time between a short and a long run of the same arm
((wall(long) - wall(short)) / (long - short)) after a discarded 1-step warm-up run: set-up, model loads and
first-call costs cancel. For this project the
stages' own seconds (measured inside them) are subtracted from its step time to give the orchestration cost.
Prints both step times, their ratio and the orchestration share; the target is this project <= 1.5x TRL.

Each run's end is rounded up to Prefect's heartbeat slices (the top flow joins its heartbeat thread, which sleeps in
1-s slices), so the marginal above carries up to 1/(long - short) s per step of noise: 2-vs-10 step values come in
steps of 0.125 s. `within_run` measures the same from the long runs' own steps instead: the mean wall between
consecutive step ends (steps 2..long; TRL's through a callback), for this project plus the time the step flows' end
took (the queued artifacts sent) spread over those steps.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("LGRPO_CACHE_DIR", "off")

LR = 2e-3
GROUPS, GEN, MAX_TOKENS = 2, 4, 32


def length_reward(completions, **kwargs) -> list[float]:
    """A user reward function (TRL's signature): the answer's length / 100."""
    return [len(c if isinstance(c, str) else str(c)) / 100.0 for c in completions]


def project_overrides(run_dir: Path) -> dict:
    return {"run_dir": str(run_dir), "threads": 1, "bootstrap.episodes": 64, "gym.max_turns": 1,
            "adapter.train_final_norm": False,  # TRL's arm trains the LoRA adapter only
            "latent.max_latent_steps": 0, "grpo.groups_per_step": GROUPS, "grpo.num_generations": GEN,
            "sampler.max_answer_tokens": MAX_TOKENS, "optimizer.lr": LR, "steps.pattern": ["fresh"],
            "gym.reward_funcs": ["bench.trl_compare:length_reward"], "gym.eval_tasks": 1,
            "gates.probe_every": 100000, "steps.total": 100000}


def prepared_run(root: Path) -> str:
    from configs.schema import load_config
    from stages.prepare import init_run_dir, prepare_run

    rd = init_run_dir(load_config("tiny", project_overrides(root / "project")))
    prepare_run(str(rd.root))
    return str(rd.root)


def project_arm(run_dir: str, steps: int, step_heartbeats: bool = False) -> dict:
    """`steps` fresh steps through Prefect, from a copy of the prepared run, as the train flow runs them (step
    subflows of one parent flow); wall time and stage seconds."""
    import shutil

    from prefect import flow

    from flows.step import grpo_step, step_flows

    copy = f"{run_dir}-{steps}{'-hb' if step_heartbeats else ''}"
    if Path(copy).exists():
        shutil.rmtree(copy)
    shutil.copytree(run_dir, copy)

    marks, stages, phases = [], [], []

    @flow(name="trl-compare-steps")
    def steps_flow() -> float:
        with (_default_settings(grpo_step) if step_heartbeats else step_flows()) as step_flow:
            marks.append(time.perf_counter())
            for s in range(steps):
                m = step_flow(copy, s)
                marks.append(time.perf_counter())
                stages.append(sum(m["phases"].values()))
                phases.append(m["phases"])
        marks.append(time.perf_counter())  # step_flows() has ended: queued artifacts were sent
        return sum(stages)

    t0 = time.perf_counter()
    stage = steps_flow()
    later = phases[1:] or phases  # the first step pays first-call costs
    mean = {k: round(sum(p.get(k, 0.0) for p in later) / len(later), 4) for k in sorted({k for p in later for k in p})}
    return {"wall_s": time.perf_counter() - t0, "stage_s": stage, "step_walls_s": _diffs(marks[:-1]),
            "step_stage_s": stages, "close_s": marks[-1] - marks[-2], "phases_mean_s": mean}


def _diffs(marks: list[float]) -> list[float]:
    return [b - a for a, b in zip(marks, marks[1:])]


def per_step(walls: list[float], stages: list[float] | None = None, close_s: float = 0.0) -> dict:
    """Step time from one run's own steps (the first, with its first-call costs, left out): the mean wall between
    consecutive step ends, plus what ending the steps cost spread over them (the project's queued artifacts)."""
    w = walls[1:]
    out = {"step_s": sum(w) / len(w) + close_s / len(w), "median_step_s": sorted(w)[len(w) // 2]}
    if stages:
        out["stage_s"] = sum(stages[1:]) / len(w)
    return out


@contextmanager
def _default_settings(step_flow):
    """The step flows with Prefect's defaults (their own heartbeat thread): the layout before step_flows()."""
    yield step_flow


def trl_arm(base_dir: str, cfg, steps: int, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine.chat import first_prompt
    from stages.context import env_factory

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = Qwen3_5ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    env = env_factory(cfg, out)()
    prompts = [first_prompt(t.question) for t in env.sample_tasks(GROUPS * steps, seed=0)]
    args = GRPOConfig(output_dir=str(out / f"trl-{steps}"), per_device_train_batch_size=GROUPS * GEN,
                      num_generations=GEN, max_completion_length=MAX_TOKENS, max_steps=steps, learning_rate=LR,
                      logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                      temperature=cfg.sampler.temperature, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=LoraConfig(r=cfg.adapter.rank, lora_alpha=cfg.adapter.alpha,
                                                 target_modules=list(cfg.adapter.targets)))
    marks = []

    class StepEnds(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(StepEnds())
    t0 = time.perf_counter()
    trainer.train()
    return {"wall_s": time.perf_counter() - t0, "step_walls_s": _diffs(marks)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs=2, default=[2, 10])
    ap.add_argument("--json", default=None)
    ap.add_argument("--project-only", action="store_true",
                    help="time this project's arm only (no TRL run): for side-by-side runs of two checkouts")
    ap.add_argument("--with-heartbeats", action="store_true",
                    help="also time the step flows with their own heartbeat threads (Prefect's default)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="lgrpo-trl-"))
    run_dir = prepared_run(root)
    from artifacts import read_json
    from stages.context import run_config

    cfg = run_config(run_dir)
    base = read_json(f"{run_dir}/prepared.json")["base"]
    short, long = a.steps
    from flows.api_server import api_server

    res = {}
    with api_server():
        project_arm(run_dir, 1)  # warm-up (imports, Prefect client, first-call costs), discarded
        p = {n: project_arm(run_dir, n) for n in (short, long)}
        hb = {n: project_arm(run_dir, n, step_heartbeats=True) for n in (short, long)} if a.with_heartbeats else None
    proj_step = (p[long]["wall_s"] - p[short]["wall_s"]) / (long - short)
    proj_stage = (p[long]["stage_s"] - p[short]["stage_s"]) / (long - short)
    # the same from the long runs' own steps: the marginal above carries each run's end rounded up to Prefect's 1-s
    # heartbeat slices (the top flow joins its heartbeat thread), up to 1/(long-short) s per step of noise
    ps = per_step(p[long]["step_walls_s"], p[long]["step_stage_s"], p[long]["close_s"])
    if a.project_only:
        res = {"steps": a.steps, "project_step_s": round(proj_step, 4), "project_stage_s": round(proj_stage, 4),
               "orchestration_s": round(proj_step - proj_stage, 4),
               "within_run": {"project_step_s": round(ps["step_s"], 4), "project_stage_s": round(ps["stage_s"], 4),
                              "orchestration_s": round(ps["step_s"] - ps["stage_s"], 4)}}
        print(json.dumps(res))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    trl_arm(base, cfg, 1, root / "warm")  # warm-up, discarded
    t = {n: trl_arm(base, cfg, n, root) for n in (short, long)}
    trl_step = (t[long]["wall_s"] - t[short]["wall_s"]) / (long - short)
    res = {"steps": a.steps, "trl_step_s": round(trl_step, 3), "project_step_s": round(proj_step, 3),
           "project_stage_s": round(proj_stage, 3), "orchestration_s": round(proj_step - proj_stage, 3),
           "orchestration_share": round((proj_step - proj_stage) / proj_step, 3),
           "ratio_project_vs_trl": round(proj_step / trl_step, 3), "target_ratio": 1.5, "raw": {"project": p, "trl": t}}
    ts = per_step(t[long]["step_walls_s"])
    res["within_run"] = {"trl_step_s": round(ts["step_s"], 3), "project_step_s": round(ps["step_s"], 3),
                         "project_stage_s": round(ps["stage_s"], 3),
                         "orchestration_s": round(ps["step_s"] - ps["stage_s"], 3),
                         "ratio_project_vs_trl": round(ps["step_s"] / ts["step_s"], 3),
                         "trl_median_step_s": round(ts["median_step_s"], 3),
                         "project_median_step_s": round(ps["median_step_s"], 3),
                         "project_close_s": round(p[long]["close_s"], 3)}
    if hb:
        hb_step = (hb[long]["wall_s"] - hb[short]["wall_s"]) / (long - short)
        res["project_step_with_step_heartbeats_s"] = round(hb_step, 3)
        res["raw"]["project_with_step_heartbeats"] = hb
        print(f"this project with each step flow's own heartbeat thread (Prefect's default): {hb_step:.3f} s/step")
    print(f"TRL GRPOTrainer: {trl_step:.3f} s/step | this project: {proj_step:.3f} s/step "
          f"(stages {proj_stage:.3f} s, orchestration {proj_step - proj_stage:.3f} s = "
          f"{100 * res['orchestration_share']:.0f}%) | ratio {res['ratio_project_vs_trl']:.2f} (target <= 1.5)")
    w = res["within_run"]
    print(f"within the {long}-step runs: TRL {w['trl_step_s']:.3f} s/step | this project {w['project_step_s']:.3f} s/step "
          f"(stages {w['project_stage_s']:.3f} s, orchestration {w['orchestration_s']:.3f} s) | ratio "
          f"{w['ratio_project_vs_trl']:.2f} (target <= 1.5)")
    res["project_phases_mean_s"] = p[long]["phases_mean_s"]  # where the stages' time goes (steps 2..long)
    print("this project's phases per step (mean of steps 2.." + str(long) + "): "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(res["project_phases_mean_s"].items(), key=lambda kv: -kv[1])))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
