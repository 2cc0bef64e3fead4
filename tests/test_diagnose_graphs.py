"""The failure diagnostic's graph-vs-eager pair: the hf sampler's static-cache decoder (engine.cuda_graphs), teacher-
forced on the worst tokens, captured into a CUDA graph and replayed vs the same steps run eagerly.

CPU (CI): the diagnostic names the pair as skipped because there is no CUDA; the eager static teacher-forced path
agrees with a full forward; the verdict names graph replay when only the graphed path disagrees.
GPU (`gpu` marker): on a `device: cuda` run the pair runs (graph replays counted) and agrees bit for bit; a graph
replay that returns altered log-probs is named by the verdict.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import fresh_step, make_run


def _worst_report(run_dir: str, step: int, rollouts: str, min_token: int = 0) -> dict:
    """A rollout-parity report naming up to 4 answer tokens at index >= min_token (decode steps after the graph's
    warm-up and capture when min_token >= 2), with the recorded trainer and sampler values."""
    from artifacts import read_json, read_table

    report = read_json(f"{run_dir}/step-{step:04d}/parity.json")
    if min_token == 0 and report.get("worst_tokens"):
        return report  # (a report can name none: tokens under gates.parity_min_prob in both engines are left out)
    trainer = read_table(f"{run_dir}/step-{step:04d}/replay.arrow").column("trainer_logps").to_pylist()
    sampler = read_table(rollouts).column("sampler_logps").to_pylist()
    worst = [{"turn": i, "token": j, "trainer": t[j], "sampler": s[j], "gap": abs(t[j] - s[j])}
             for i, (t, s) in enumerate(zip(trainer, sampler)) for j in range(min_token, len(t))][:4]
    assert worst, f"no answer of more than {min_token} tokens in {rollouts}"
    return report | {"worst_tokens": worst}


@pytest.mark.slow
def test_diagnostic_names_graph_vs_eager_as_skipped_without_cuda(tmp_path):
    from artifacts import read_json
    from engine import runtime
    from stages.diagnose import diagnose

    runtime.clear()
    run_dir = make_run(tmp_path / "run")
    s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    report = _worst_report(run_dir, 0, s0["rollouts"])
    d = diagnose(run_dir, 0, "rollout-parity", report, f"{run_dir}/adapter-init", s0["base"], s0["rollouts"])
    assert d["graph_vs_eager"] == "skipped"
    saved = read_json(d["path"])
    g = saved["graph_vs_eager"]
    assert g["status"] == "skipped" and g["reason"].startswith("no CUDA"), g
    assert "cpu" in g["reason"]
    for tk in saved["tokens"]:
        assert not any(p.startswith("sampler/static-") for p in tk["paths"]), "a skipped path has no value"
        assert "sampler/live-cached" in tk["paths"]  # the other isolated paths still ran
    assert saved["verdict"] == "no isolated path disagrees beyond tolerance", saved["verdict"]


def test_eager_static_teacher_forcing_matches_a_full_forward():
    """D.static_decode(graphed=False) -- the path the GPU pair compares against -- scores what a full forward scores
    (fp32: summation order only); graphed=True refuses to run without CUDA and says so."""
    from engine import diagnose as D
    from tests.test_cuda_graphs import TOKS, _model

    model = _model(adapter="dora")
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, 64, (17,), generator=g).tolist()
    thoughts = torch.randn(3, 128, generator=g) * 0.5
    answer = torch.randint(4, 64, (6,), generator=g).tolist()
    static, counts = D.static_decode(model, prefix, thoughts, answer, 1.3, TOKS, graphed=False)
    full = D.teacher_forced(model, [prefix], [thoughts], [answer], 1.3, TOKS)[0]
    assert static.shape == full.shape == (len(answer), 64)
    assert counts == {"eager": len(answer) - 1}  # one decode step per answer token after the first
    assert torch.allclose(static, full, atol=1e-4), float((static - full).abs().max())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            D.static_decode(model, prefix, thoughts, answer, 1.3, TOKS, graphed=True)


def test_verdict_names_graph_replay_when_only_the_graphed_path_disagrees():
    from stages.diagnose import TOL, _verdict

    same = {"trainer/fresh": -1.0, "trainer/gate": -1.0, "trainer/live-alone": -1.0, "sampler/rollout": -1.0,
            "sampler/live-alone": -1.0, "sampler/live-cached": -1.0, "sampler/static-eager": -1.0}
    healthy = {"differing": 0, "tensors": 4}
    bad, verdict = _verdict(same | {"sampler/static-graphed": -1.0 - 10 * TOL}, healthy, {})
    assert bad == ["sampler/static-graphed"] and verdict.startswith("sampler CUDA graph replay"), verdict
    bad, verdict = _verdict(same | {"sampler/static-graphed": -1.0 - 10 * TOL, "sampler/static-eager": -1.5},
                            healthy, {})
    assert not verdict.startswith("sampler CUDA graph replay"), "both static paths off: not the graph's fault"


@pytest.mark.gpu
def test_graph_vs_eager_pair_runs_on_cuda_and_names_an_altered_replay(tmp_path, monkeypatch):
    from artifacts import read_json
    from engine import cuda_graphs as CG
    from engine import runtime
    from stages.diagnose import diagnose

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"device": "cuda", "model.dtype": "bfloat16", "threads": None,
                                             "bootstrap.episodes": 128, "sampler.max_answer_tokens": 24})
    prep = read_json(f"{run_dir}/prepared.json")
    s0 = fresh_step(run_dir, 0, prep["adapter_init"])
    report = _worst_report(run_dir, 0, s0["rollouts"], min_token=2)
    d = diagnose(run_dir, 0, "rollout-parity", report, prep["adapter_init"], s0["base"], s0["rollouts"])
    g = read_json(d["path"])["graph_vs_eager"]
    assert g["status"] == "run" and g["used_by_run"] is True, g
    assert g["tokens"] and all(t["bitwise_equal"] and t["max_abs_diff"] == 0.0 for t in g["tokens"]), g
    assert all(t["graph_replays"] >= 1 for t in g["tokens"]), "tokens at index >= 2 come from graph replays"
    assert "sampler/static-graphed" not in d["disagreeing_paths"]

    real = CG._StaticDecoder._run_step

    def altered_replay(self, key):  # the injected defect: a replayed step returns shifted log-probs
        real(self, key)
        if self.graphed and self.graph is not None and isinstance(self, CG.GraphedDecoder):
            self.logp.sub_(0.5)

    monkeypatch.setattr(CG._StaticDecoder, "_run_step", altered_replay)
    d = diagnose(run_dir, 0, "rollout-parity", report, prep["adapter_init"], s0["base"], s0["rollouts"])
    saved = read_json(d["path"])
    assert d["verdict"].startswith("sampler CUDA graph replay"), d["verdict"]
    assert "sampler/static-graphed" in d["disagreeing_paths"] and "sampler/static-eager" not in d["disagreeing_paths"]
    assert not any(t["bitwise_equal"] for t in saved["graph_vs_eager"]["tokens"])
