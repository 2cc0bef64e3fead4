"""Soak drill: the embedded default on HTTP tools for a set wall time, while faults, kills and corruption hit it.

    python bench/soak.py --minutes 120 --root runs/soak --set threads=1   # the 2-hour drill (2-core CPU)
    python bench/soak.py --minutes 10 --root /tmp/soak --set bootstrap.episodes=96    # the CI variant's size

What it does, in order:
1. A reference run, uninterrupted, of the same settings for `--ref-steps` steps (`<root>/reference`); its seconds
   per step size the soak run (`--steps` overrides).
2. The soak run (`<root>/soak`) with the README's command (`--command`, default ./scripts/train.sh) and
   `--run-dir`, `--steps`, the tool server's faults at `--fault-rate` (every kind the server supports), over
   `gym.transport: http`. While it runs, the drill
   - SIGKILLs the training process inside planned phases (generate-turn, gym, replay, optimize, probe and the
     end-of-run checkpoint; `--kills`, at least one per phase) at a random moment of the phase
     (`LGRPO_KILL_AT=<phase>:<step>@<seconds>`, stages/faults.py), and starts the same command again;
   - SIGKILLs the run's tool server `--tool-restarts` times (the run restarts its own server);
   - stops the run's Prefect API server once (the run must continue, or end with a clear message and resume);
   - once, while the run is down after a kill: flips one byte in a stored artifact of a finished step and runs
     `lgrpo rerun` of that step, which must name the file and write it again bit for bit.
3. Checks, printed and written to `<root>/report.json`: every step exactly once in metrics.jsonl and
   parity_history.jsonl; every artifact (checksum sidecars) and every sealed trace verifies; every gate passed;
   the corrupted artifact was named and regenerated; the adapter and optimizer state at the reference's last step
   are bit-identical to the reference run's.

Anything the drill finds is to be fixed in the product, not here. Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.api_server import EXIT_SERVER_DIED  # noqa: E402  (torch-free)

PHASES = ["generate-turn", "gym", "replay", "optimize", "probe", "checkpoint"]


def children_of(pid: int, needle: str) -> list[int]:
    """Processes started by `pid` (their command line names it as --parent-pid) whose command line has `needle`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd]
        if needle in " ".join(args) and "--parent-pid" in args:
            i = args.index("--parent-pid")
            if i + 1 < len(args) and args[i + 1] == str(pid):
                out.append(int(d.name))
    return out


def steps_done(run_dir: Path) -> int:
    """Steps whose adapter is stored (the step flow's last artifact)."""
    return len(list(run_dir.glob("step-*/adapter/adapter_model.safetensors")))


class Segment:
    """One launch of the training command, watched."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = log
        self.out = open(log, "ab")
        self.out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(cmd)} LGRPO_KILL_AT={env.get('LGRPO_KILL_AT', '')}\n"
                       .encode())
        self.out.flush()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.start = time.time()

    def poll(self):
        return self.proc.poll()

    def tail(self, n: int = 6) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()


def plan_queue(n_kills: int, tool_restarts: int, rng: random.Random) -> list[dict]:
    """The drill's disruptions in order: kills in every phase (the end-of-run checkpoint last), tool-server kills and
    the API-server stop between them. Kill steps are chosen when each segment starts (see kill_step)."""
    phases = [ph for ph in PHASES[:-1] if ph != "probe"]
    phases += [rng.choice(PHASES[:-1]) for _ in range(max(0, n_kills - len(PHASES)))]
    rng.shuffle(phases)
    phases.append("probe")  # probes run every gates.probe_every steps and at the last step: there is one left
    queue = [{"kind": "kill", "phase": ph, "delay_s": round(rng.uniform(0.0, 1.5), 2)} for ph in phases]
    others = [{"kind": "tool-server"} for _ in range(tool_restarts)] + [{"kind": "api-server"}]
    rng.shuffle(others)
    for n, item in enumerate(others):  # spread between the kills
        queue.insert(1 + (n * len(queue)) // (len(others) + 1) + n, item)
    queue.append({"kind": "kill", "phase": "checkpoint", "delay_s": round(rng.uniform(0.0, 1.0), 2)})
    return queue


def kill_step(phase: str, lowest: int, steps: int, later: list[dict], pattern: list[str], probe_every: int,
              rng: random.Random) -> int | str:
    """A step at or after `lowest` where `phase` runs, leaving room for the `later` items of the queue (a step
    for each kill, two for each other disruption)."""
    if phase == "checkpoint":
        return "final"
    need = sum(1 if q["kind"] == "kill" and q["phase"] != "checkpoint" else 2 if q["kind"] != "kill" else 0
               for q in later)
    room = max(0, steps - 1 - lowest - need) // max(1, 1 + sum(1 for q in later if q["kind"] == "kill"))
    want = lowest + rng.randint(0, room)
    ok = [s for s in range(want, steps)
          if (phase not in ("generate-turn", "gym") or pattern[s % len(pattern)] == "fresh")
          and (phase != "probe" or (s + 1) % probe_every == 0 or s == steps - 1)]
    return ok[0] if ok else steps - 1


def train_cmd(a, run_dir: Path, steps: int) -> list[str]:
    cmd = [*a.command.split(), "--run-dir", str(run_dir), "--steps", str(steps), "--set", "gym.transport=http",
           "--set", f"gym.tool_server.faults.rate={a.fault_rate}", "--set", f"seed={a.seed}"]
    for s in a.set:
        cmd += ["--set", s]
    return cmd


def lgrpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "lgrpo_cli", *args]


def reference(a, root: Path, env: dict) -> dict:
    run_dir = root / "reference"
    t0 = time.time()
    log = root / "reference.log"
    seg = Segment(train_cmd(a, run_dir, a.ref_steps), env, log)
    rc = seg.proc.wait()
    seg.close()
    if rc != 0:
        raise SystemExit(f"the reference run failed (rc {rc}); see {log}:\n{seg.tail()}")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the stages' seconds plus orchestration (~1.5 s per step on 2 cores: bench/trl_compare.py)
    step_s = sum(m.get("stage_seconds") or 0.0 for m in metrics) / max(1, len(metrics)) + 1.5
    return {"run_dir": str(run_dir), "steps": a.ref_steps, "wall_s": round(time.time() - t0, 1),
            "step_s": round(step_s, 2)}


def flip_and_rerun(run_dir: Path, step: int, root: Path, env: dict, rng: random.Random) -> dict:
    """Flip one byte of a stored artifact of a finished step, ask for a rerun of that step, check what came back."""
    from artifacts import ArtifactError, RunDir, verify

    rd = RunDir(run_dir)
    target = rd.replay(step) if rd.replay(step).exists() else rd.rollouts(step)
    digest = verify(target)
    data = bytearray(target.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    target.write_bytes(bytes(data))
    log = root / "rerun.log"
    r = subprocess.run(lgrpo("rerun", "--run-dir", str(run_dir), "--step", str(step)), cwd=ROOT, env=env,
                       capture_output=True, text=True)
    log.write_text(r.stdout + r.stderr)
    prefect_log = r.stdout + r.stderr
    try:
        after = verify(target)
    except ArtifactError as exc:  # reported: the drill's check says what went wrong
        after = f"does not verify: {exc}"
    return {"step": step, "file": str(target), "byte": at, "rerun_rc": r.returncode,
            "named": str(target) in prefect_log or target.name in prefect_log,
            "bit_identical": after == digest, "log": str(log)}


def final_checks(a, run_dir: Path, ref: dict, steps: int) -> dict:
    from artifacts import ArtifactError, RunDir, read_json, sha256_file, verify
    from gyms.trace import TraceError, verify_trace

    rd = RunDir(run_dir)
    out: dict = {}
    for name, path in (("metrics", rd.metrics_history()), ("parity_history", rd.parity_history())):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        count = Counter(r["step"] for r in rows)
        out[f"{name}_each_step_once"] = sorted(count) == list(range(steps)) and set(count.values()) == {1}
        out[f"{name}_counts"] = {str(k): v for k, v in sorted(count.items()) if v != 1} or "all 1"
    n_art, bad = 0, []
    for side in sorted(run_dir.rglob("*.sha256")):
        art = side.with_name(side.name[: -len(".sha256")])
        n_art += 1
        try:
            verify(art)
        except ArtifactError as exc:
            bad.append(str(exc))
    out["artifacts_verified"], out["artifacts_bad"] = n_art, bad
    n_tr, bad_tr = 0, []
    for tr in sorted(run_dir.rglob("*.trace.jsonl")):
        n_tr += 1
        try:
            verify_trace(tr)
        except (TraceError, OSError) as exc:
            bad_tr.append(f"{tr}: {exc}")
    out["traces_verified"], out["traces_bad"] = n_tr, bad_tr
    parity = [json.loads(x) for x in rd.parity_history().read_text().splitlines() if x.strip()]
    probes = [json.loads(x) for x in rd.probe_history().read_text().splitlines()] if rd.probe_history().exists() else []
    vc = read_json(rd.verified_checkpoint()) if rd.verified_checkpoint().exists() else None
    out["gates"] = {"parity_passed": all(p["passed"] for p in parity if p.get("gated", True)),
                    "probes": len(probes), "probes_passed": all(p["passed"] for p in probes),
                    "verified_checkpoint": vc, "summary_written": rd.summary().exists()}
    out["gates_all_passed"] = (out["gates"]["parity_passed"] and out["gates"]["probes_passed"] and bool(probes)
                               and vc is not None and bool(vc.get("identical", vc.get("passed")))
                               and out["gates"]["summary_written"])
    last = ref["steps"] - 1
    ref_rd = RunDir(Path(ref["run_dir"]))
    pairs = {"adapter": (rd.adapter(last) / "adapter_model.safetensors", ref_rd.adapter(last) / "adapter_model.safetensors"),
             "optimizer": (rd.optimizer(last), ref_rd.optimizer(last))}
    out["bitwise_vs_reference"] = {"step": last, **{k: {"soak": sha256_file(p)[:16], "reference": sha256_file(q)[:16],
                                                        "equal": sha256_file(p) == sha256_file(q)} for k, (p, q) in pairs.items()}}
    out["bitwise_equal"] = all(v["equal"] for k, v in out["bitwise_vs_reference"].items() if k != "step")
    return out


def restarts(log: Path) -> int:
    """How often the run started its own tool server again (its warning, once per restart, in the CLI's output):
    a server that died while serving, or one that died while starting (a kill can land in its first second)."""
    return sum(1 for x in log.read_text(errors="replace").splitlines()
               if "lgrpo.gym" in x and ("had died; restarted it" in x or "did not start (" in x))


def tool_faults(run_dir: Path) -> dict:
    log = run_dir / "tool-server" / "faults.jsonl"
    kinds = Counter(json.loads(x)["kind"] for x in log.read_text().splitlines() if x.strip()) if log.exists() else {}
    client = run_dir / "tool-server" / "client-faults.jsonl"
    failed = sum(1 for x in client.read_text().splitlines() if x.strip()) if client.exists() else 0
    return {"by_kind": dict(sorted(kinds.items())), "total": sum(kinds.values()),
            "client_failed_attempts_retried": failed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=120.0, help="wall time of the whole drill")
    p.add_argument("--root", default="runs/soak", help="the drill's folder (reference and soak run, logs, report)")
    p.add_argument("--command", default="./scripts/train.sh", help="the README's training command")
    p.add_argument("--steps", type=int, default=None, help="soak steps (default: sized from the reference run)")
    p.add_argument("--ref-steps", type=int, default=20, help="steps of the uninterrupted reference run (the bitwise check is at its last)")
    p.add_argument("--kills", type=int, default=6, help="training-process kills in all, one per phase at least (>= 6)")
    p.add_argument("--tool-restarts", type=int, default=2)
    p.add_argument("--fault-rate", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="the run's seed; the drill's own choices use it too")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for both runs")
    p.add_argument("--max-failures", type=int, default=4, help="unplanned failures in a row before the drill gives up")
    a = p.parse_args(argv)
    if a.kills < len(PHASES):
        p.error(f"--kills must be at least {len(PHASES)}: one in each phase ({', '.join(PHASES)})")
    t_start = time.time()
    deadline = t_start + a.minutes * 60
    root = Path(a.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"soak-{a.seed}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LGRPO_KILL", "PREFECT_API_URL"))}
    env["PYTHONUNBUFFERED"] = "1"

    ref = reference(a, root, env)
    print(f"reference: {ref['steps']} steps in {ref['wall_s']} s ({ref['step_s']} s per step)", flush=True)
    left = deadline - time.time()
    # per step, plus each resume's set-up and start (~40 s on 2 cores) and the end-of-run evaluation
    steps = a.steps or max(ref["steps"] + 8, int((left - 40 * (a.kills + 4) - 120) / max(ref["step_s"], 1.0)))
    from configs.schema import load_config
    from lgrpo_cli import _parse_set

    cfg = load_config("tiny", _parse_set(a.set))
    pattern, probe_every = list(cfg.steps.pattern), cfg.gates.probe_every
    queue = plan_queue(a.kills, a.tool_restarts, rng)
    print(f"plan: {steps} steps; " + ", ".join(q.get("phase", q["kind"]) for q in queue), flush=True)
    run_dir = root / "soak"
    events: list[dict] = []
    kills_done: Counter = Counter()
    resumes, failures_in_row, flip, api_outcome = 0, 0, None, None
    log = root / "soak.log"
    cmd = train_cmd(a, run_dir, steps)
    n_kills = sum(1 for q in queue if q["kind"] == "kill")

    def event(what: str, **kw) -> None:
        events.append({"t": round(time.time() - t_start), "event": what, "steps_done": steps_done(run_dir), **kw})

    while True:
        done0 = steps_done(run_dir)
        # this segment: the disruptions before the next kill (each once a step more is done), then that kill
        todo = []
        while queue and queue[0]["kind"] != "kill":
            todo.append(queue.pop(0))
        kill = dict(queue[0]) if queue else None
        seg_env = dict(env)
        if kill is not None:
            lowest = min(steps - 1, done0 + 1 + 2 * len(todo))  # a step this segment has not begun
            kill["step"] = kill_step(kill["phase"], lowest, steps, queue[1:], pattern, probe_every, rng)
            seg_env["LGRPO_KILL_AT"] = f"{kill['phase']}:{kill['step']}@{kill['delay_s']}"
        seg = Segment(cmd, seg_env, log)
        marks = [done0 + 1 + 2 * n for n in range(len(todo))]  # a disruption every other step
        api_killed = False
        while seg.poll() is None:
            time.sleep(0.5)
            done = steps_done(run_dir)
            if todo and done >= marks[0]:
                what = todo[0]["kind"]
                pids = children_of(seg.proc.pid, "gyms.server" if what == "tool-server" else "flows.api_server")
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    event(f"{what} killed", pid=pids[0])
                    api_killed = api_killed or what == "api-server"
                    todo.pop(0)
                    marks.pop(0)
            if time.time() > deadline + 1800:
                seg.close()
                raise SystemExit("the drill ran 30 min past its wall time; see " + str(log))
        rc = seg.poll()
        tail = seg.tail()
        seg.close()
        queue[:0] = todo  # disruptions this segment did not reach: the next one
        planned = kill is not None and rc == -signal.SIGKILL
        after_api = api_killed
        event("exit", rc=rc, planned_kill=kill if planned else None,
              tail=None if planned or rc == 0 else tail)
        if after_api:  # the run's answer to its API server's death: went on, or stopped with a clear message
            api_outcome = {"rc": rc, "continued": rc == 0 or planned,
                           "message": next((x for x in tail.splitlines() if x.startswith("lgrpo:")), None)}
        if rc == 0:
            break
        resumes += 1
        if planned:
            kills_done[kill["phase"]] += 1
            queue.pop(0)
            failures_in_row = 0
            if flip is None and sum(kills_done.values()) >= n_kills // 2 and steps_done(run_dir) > 0:
                flip = flip_and_rerun(run_dir, steps_done(run_dir) - 1, root, env, rng)
                event("byte flipped, rerun", **flip)
        elif after_api and rc == EXIT_SERVER_DIED:
            failures_in_row = 0
        else:
            failures_in_row += 1
            print(f"unplanned exit rc {rc}:\n{tail}", flush=True)
            if failures_in_row > a.max_failures:
                raise SystemExit(f"{failures_in_row} unplanned failures in a row; see {log}")
        print(f"[{round(time.time() - t_start)} s] resume #{resumes} after rc {rc} "
              f"({'planned kill in ' + kill['phase'] + ' at step ' + str(kill['step']) if planned else 'not a planned kill'}), "
              f"{steps_done(run_dir)}/{steps} steps", flush=True)
    checks = final_checks(a, run_dir, ref, steps)
    faults = tool_faults(run_dir)
    report = {
        "how": "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_s": round(time.time() - t_start, 1), "minutes_asked": a.minutes, "reference": ref, "steps": steps,
        "steps_completed": steps_done(run_dir), "kills_by_phase": dict(kills_done), "resumes": resumes,
        "unplanned_exits": [e for e in events if e["event"] == "exit" and e["rc"] not in (0, EXIT_SERVER_DIED)
                            and not e["planned_kill"]],
        "api_server_stop_outcome": api_outcome,
        "tool_faults": faults,
        "tool_server_kills": sum(1 for e in events if e["event"] == "tool-server killed"),
        "tool_server_restarts": restarts(log),
        "api_server_stops": sum(1 for e in events if e["event"] == "api-server killed"),
        "corruption": flip, "checks": checks, "events": events,
    }
    report["passed"] = bool(
        checks["metrics_each_step_once"] and checks["parity_history_each_step_once"] and not checks["artifacts_bad"]
        and not checks["traces_bad"] and checks["gates_all_passed"] and checks["bitwise_equal"]
        and flip and flip["named"] and flip["bit_identical"] and flip["rerun_rc"] == 0
        and all(kills_done[ph] >= 1 for ph in PHASES) and sum(kills_done.values()) >= 5
        and report["tool_server_kills"] >= a.tool_restarts and report["tool_server_restarts"] >= a.tool_restarts
        and report["api_server_stops"] == 1 and api_outcome is not None
        and (api_outcome["continued"] or bool(api_outcome["message"])) and not report["unplanned_exits"])
    (root / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "events"}, indent=1))
    print(f"soak drill {'PASSED' if report['passed'] else 'FAILED'}; report: {root / 'report.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
