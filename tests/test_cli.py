"""CLI commands that read a run directory (`lgrpo gates`, `lgrpo verify-trace`) and how `lgrpo train` ends on a failure."""

from __future__ import annotations

import pytest

from lgrpo_cli import main


def _parity(step: int, kind: str, mean: float, passed) -> dict:
    return {"step": step, "kind": kind, "gated": kind == "fresh", "passed": passed, "tokens_considered": 100,
            "mean_gap": mean, "max_gap": 10 * mean, "masked": 0, "k3_kl": 1e-9, "is_ratio_min": 0.9,
            "is_ratio_max": 1.1, "limits": {"mean_max": 0.1, "token_max": 1.0, "min_prob": 0.01}}


def test_gates_summarizes_the_history(tmp_path, capsys):
    from artifacts import append_jsonl, write_json

    append_jsonl(tmp_path / "parity_history.jsonl", _parity(0, "fresh", 3e-8, True))
    append_jsonl(tmp_path / "parity_history.jsonl", _parity(1, "reuse", 2e-2, None))
    append_jsonl(tmp_path / "probe_history.jsonl", {"step": 1, "max_gap": 0.0, "argmax_agreement": 1.0, "passed": True})
    write_json(tmp_path / "verified_checkpoint.json", {"identical": True, "max_abs_diff": 0.0})
    assert main(["gates", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rollout parity over 1 fresh steps: all passed = True" in out
    assert "3.00e-08" in out and "2.00e-02" in out and "probes: 1, all passed = True" in out
    assert "'identical': True" in out


def test_verify_trace_exit_codes(tmp_path, capsys):
    from gyms.trace import TraceRecorder, write_trace

    rec = TraceRecorder("ep")
    rec.append(call_id="0", tool="calc", arguments={"expression": "1+1"}, observation="2", is_error=False)
    path = tmp_path / "t.jsonl"
    write_trace(path, rec.seal())
    assert main(["verify-trace", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    data = bytearray(path.read_bytes())
    data[30] ^= 1
    path.write_bytes(bytes(data))
    assert main(["verify-trace", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "entry 0 (line 1" in out


@pytest.mark.slow
def test_a_failed_task_ends_the_cli_with_one_line_naming_it_and_the_traceback_file(tmp_path):
    """Issue 15: a failing task used to end `lgrpo train` with ~145 lines of two tracebacks. Now the console keeps
    Prefect's one-line error records, the CLI's last line names the task run and the cause, and the full traceback
    is in <run>/errors/ (and in the run's Prefect log)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    res = subprocess.run(
        [sys.executable, "-m", "lgrpo_cli", "train", "--config", "tiny-research", "--steps", "1", "--run-dir", str(run),
         "--set", "bootstrap.enabled=false", "--set", "gym.transport=http", "--set", "threads=1",
         "--set", "gym.tool_server.url=http://127.0.0.1:9", "--set", "gym.tool_server.max_attempts=1",
         "--set", "gym.eval_tasks=1"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("lgrpo: task evaluate-before failed: ToolTransportError: "), last
    assert "is the tool server running?" in last
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 6, res.stderr
    logged = sorted((run / "errors").glob("*.txt"))
    assert len(logged) == 1 and f"full traceback: {logged[0]}" in last
    text = logged[0].read_text()
    assert text.startswith("Traceback") and "gyms/transport.py" in text and "ToolTransportError" in text
