"""The recipe's GRPO step at full size through the real pipeline: fresh and reuse steps, per-phase figures.

    python bench/step_27b.py --groups 1 --out bench/results/h200-step-27b-g1.json     # 4 rows (one group of 4)
    python bench/step_27b.py --groups 4 --out bench/results/h200-step-27b-g4.json     # 16 rows
    python bench/step_27b.py --groups 1 --set sampler.weights=trainer               # one 80 GB GPU (H100)
    python bench/step_27b.py --config tiny                                           # the flow on the CPU

Runs `lgrpo train --config qwen35-27b-step` (Prefect: one step flow per GRPO step, every gate, Arrow/safetensors
artifacts; configs/qwen35-27b-step.yaml: the 27B text shape at random weights, NF4 base, DoRA r16, the synthetic
gym in the recipe's shape) for two steps (fresh, reuse), then reads the run directory and prints per step: seconds
per phase (prefill = the engines' prefix-cached per-row prefill, latent = the graphed latent loop, answers = the
graphed decode, generate-other = the rest of generate-turn: the adapter push to the sampler and, at the first turn, the
sampler's in-memory BF16 export; gym, replay, optimize), peak GB per stage,
replay tokens and tokens/s (replay score + optimize backward), replay MFU, the preflight's estimated peak against
the measured replay/optimize peak, and the gates (rollout parity, probe, verified checkpoint).

MFU counts useful FLOPs 4·P·T per replayed token (forward 2·P·T plus the input-gradient backward of a frozen base,
2·P·T; P = matmul parameters of the decoder) plus causal attention, over 989 TFLOP/s (H200 dense BF16); recompute
(checkpointing, two-pass) counts as time, not as FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PEAK_FLOPS = 989e12


def matmul_params(arch: dict) -> float:
    """Matmul parameters of one forward of the Qwen3.5 decoder (per token), without the LM head."""
    h, i = arch["hidden_size"], arch["intermediate_size"]
    kinds = arch.get("layer_types") or ["linear_attention", "linear_attention", "linear_attention", "full_attention"] \
        * (arch["num_hidden_layers"] // 4)
    qd, kvd = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    kd, vd = arch["linear_num_key_heads"] * arch["linear_key_head_dim"], \
        arch["linear_num_value_heads"] * arch["linear_value_head_dim"]
    attn = h * 2 * qd + 2 * h * kvd + qd * h  # q (+ gate), k, v, o
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * arch["linear_num_value_heads"] + vd * h  # qkv, z, b, a, out
    mlp = 3 * h * i
    return float(sum((attn if k == "full_attention" else gdn) + mlp for k in kinds))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen35-27b-step")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--set", action="append", default=[], help="extra key=value overrides for lgrpo train")
    p.add_argument("--out", default=None)
    p.add_argument("--log", default=None, help="the training run's output (default: <run dir>.log)")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds; the figures "
                   "of the steps it finished are still written")
    a = p.parse_args(argv)

    from artifacts import RunDir
    from configs.schema import load_config

    run_dir = Path(a.run_dir or f"runs/step-27b-g{a.groups}-{int(time.time())}").resolve()
    sets = ["--set", f"grpo.groups_per_step={a.groups}", *sum((["--set", s] for s in a.set), [])]
    cmd = [sys.executable, "-m", "lgrpo_cli", "train", "--config", a.config, "--steps", str(a.steps),
           "--run-dir", str(run_dir), *sets]
    log = Path(a.log) if a.log else run_dir.with_name(run_dir.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:  # streamed: a run stopped by --timeout still leaves its log and metrics
        proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy(), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = f"stopped after --timeout {a.timeout} s"
    wall = time.perf_counter() - t0
    res: dict = {"command": " ".join(cmd[1:]), "returncode": rc, "wall_s": round(wall, 1), "log": str(log)}
    if rc != 0:
        tail = log.read_text()[-4000:]
        res["log_tail"] = tail
        print(tail)
    cfg = load_config(a.config, {"grpo.groups_per_step": a.groups})
    arch = dict(cfg.model.arch)
    P = matmul_params(arch) if "hidden_size" in arch and "linear_num_key_heads" in arch else None
    steps = []
    mpath = RunDir(run_dir).metrics_history()
    for line in (mpath.read_text().splitlines() if mpath.exists() else []):
        m = json.loads(line)
        ph = m.get("phases", {})
        row = {"step": m["step"], "kind": m["kind"], "phases_s": ph, "stage_seconds": m.get("stage_seconds"),
               "peak_gb": m.get("peak_gb"), "peak_reserved_gb": m.get("peak_reserved_gb"),
               "alloc_retries": m.get("alloc_retries"),  # per stage: cache flushes of the CUDA allocator
               "parity_mean": m.get("parity_mean"), "parity_max": m.get("parity_max"),
               "masked": m.get("parity_masked"), "grad_norm": m.get("grad_norm"), "reward_mean": m.get("reward_mean"),
               "replay_tokens": m.get("replay_tokens"), "replay_plan": m.get("replay_plan"),
               "generate_turns": m.get("generate_turns"),
               # optimize's own split: back-propagation (with checkpoint recompute) vs loss, optimizer and writes
               "optimize_backward_s": m.get("backward_s"), "live_graph": m.get("live_graph"),
               "one_pass": m.get("one_pass"),  # replay back-propagated each micro-batch (its weights checked)
               "optimize_laps_s": {k: m.get(k) for k in ("prepare_s", "backward_s", "update_s", "write_s")}}
        T = m.get("replay_tokens")
        rs = ph.get("replay", 0.0) + ph.get("optimize", 0.0)
        # tokens the plan forwarded: fewer than the turns' tokens with replay.share_prefix (a group's prompt and a
        # row's earlier turns once); MFU counts those, tokens/s the turns' (the work the step asks for)
        fwd = sum(((m.get("replay_plan") or {}).get("tier_tokens") or {}).values()) or T
        row["replay_forwarded_tokens"] = fwd
        if T and rs:
            row["replay_tokens_per_s"] = round(T / rs, 1)
            if P is not None:
                row["replay_mfu"] = round(4 * P * fwd / rs / PEAK_FLOPS, 4)
        est = (m.get("replay_plan") or {}).get("est_peak_gb")
        meas = max((m.get("peak_gb") or {}).get(k, 0.0) for k in ("replay", "optimize")) if m.get("peak_gb") else None
        if est and meas:
            row["preflight_est_vs_measured"] = round(est / meas, 3)
        steps.append(row)
    res["steps"] = steps
    for name in ("verified_checkpoint.json",):
        f = run_dir / name
        res[name.split(".")[0]] = json.loads(f.read_text()) if f.exists() else None
    ph_hist = run_dir / "probe_history.jsonl"
    res["probes"] = [json.loads(x) for x in ph_hist.read_text().splitlines()] if ph_hist.exists() else []
    print(f"\nstep flow of {a.config} with {a.groups} group(s), return code {rc}, {wall:.0f} s wall")
    for r in steps:
        print(f"step {r['step']} {r['kind']:<6} " + " ".join(f"{k} {v:.1f}s" for k, v in r["phases_s"].items())
              + f" | replay {r.get('replay_tokens')} tok ({r.get('replay_forwarded_tokens')} forwarded), "
              f"{r.get('replay_tokens_per_s')} tok/s, MFU {r.get('replay_mfu')}"
              + f" | optimize {r.get('optimize_laps_s')} (live graph {r.get('live_graph')}, one pass {r.get('one_pass')})"
              + f" | peak {r.get('peak_gb')} | allocator retries {r.get('alloc_retries')}"
              + f" | preflight/measured {r.get('preflight_est_vs_measured')}"
              + f" | parity {r.get('parity_mean')}/{r.get('parity_max')}")
        for t in r.get("generate_turns") or []:
            print("   turn " + " ".join(f"{k}={v}" for k, v in t.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
