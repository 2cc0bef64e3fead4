"""CLI commands that read a run directory: `lgrpo gates` and `lgrpo verify-trace`."""

from __future__ import annotations

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
