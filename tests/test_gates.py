"""Gates with injected defects: the gate fails and the diagnostic names the guilty path.

Defects: a sampler whose adapter is stale by one update (its reload is skipped), and a sampler DoRA path that
rounds twice (base + LoRA rounded to bf16, then times the magnitude rounded again) instead of combining in FP32
and rounding once. Also: the teacher-forced probe and the verified checkpoint pass on a healthy run, same-seed
thoughts are bitwise identical, and every step appends its parity report.
"""

from __future__ import annotations

import types

import pytest
import torch

from engine.gates import GateFailed
from tests.conftest import fresh_step, make_run

pytestmark = pytest.mark.slow


def test_stale_sampler_adapter_fails_rollout_parity_and_the_diagnostic_names_it(tmp_path, monkeypatch):
    from engine import runtime
    from stages.diagnose import diagnose

    runtime.clear()
    # a learning rate that moves the policy in one update, so one update of staleness is a real difference
    run_dir = make_run(tmp_path / "run", **{"optimizer.lr": 0.05, "grpo.groups_per_step": 4, "bootstrap.episodes": 96,
                                             "bootstrap.epochs": 2,
                                             "steps.pattern": ["fresh"]})
    first = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    assert first["optimize"]["grad_norm"] > 0
    real = runtime.Engine.use_adapter

    def skip_sampler_reload(self, adapter_dir):  # the injected defect: the sampler keeps its old adapter
        if self is runtime.sampler(runtime_cfg, first["export"], first["base"]) and self.adapter_digest:
            return
        real(self, adapter_dir)

    from stages.context import run_config

    runtime_cfg = run_config(run_dir)
    monkeypatch.setattr(runtime.Engine, "use_adapter", skip_sampler_reload)
    adapter1 = f"{run_dir}/step-0000/adapter"
    with pytest.raises(GateFailed) as err:
        fresh_step(run_dir, 1, adapter1)
    assert err.value.gate == "rollout-parity"
    report = err.value.report
    assert report["mean_gap"] > 0.1 and report["worst_tokens"]
    d = diagnose(run_dir, 1, "rollout-parity", report, adapter1, first["base"], f"{run_dir}/step-0001/rollouts.arrow")
    assert d["verdict"].startswith("sampler engine adapter weights"), d["verdict"]
    assert "sampler/rollout" in d["disagreeing_paths"] and "sampler/live-alone" in d["disagreeing_paths"]
    assert "sampler/fresh-alone" not in d["disagreeing_paths"], "a fresh load of the right adapter agrees"
    assert not any(p.startswith("trainer/") for p in d["disagreeing_paths"])
    from artifacts import read_json

    saved = read_json(d["path"])
    assert saved["adapter_weights"]["differing"] > 0
    assert saved["adapter_weights"]["engine_digest"] != saved["adapter_weights"]["step_digest"]


def _round_twice(self, x, *args, **kwargs):
    """The seed's vLLM DoRA bug: base output + LoRA term rounded to the compute dtype, then times the magnitude
    and rounded again (PEFT and this trainer combine in FP32 and round once)."""
    a = self.active_adapters[0]
    base = self.base_layer(x)
    lora = self.lora_B[a](self.lora_A[a](x.to(self.lora_A[a].weight.dtype))) * self.scaling[a]
    summed = (base.float() + lora.float()).to(base.dtype)  # rounding 1
    weight = self.base_layer.weight.float() + self.scaling[a] * (self.lora_B[a].weight @ self.lora_A[a].weight).float()
    scale = self.lora_magnitude_vector[a].weight.float() / torch.linalg.norm(weight, dim=1)
    return (summed.float() * scale).to(base.dtype)  # rounding 2


def trained_like_adapter(run_dir: str, out_dir) -> str:
    """The initial adapter with non-zero LoRA B (as after training), so the adapter changes the outputs."""
    from artifacts import read_adapter_dir, write_adapter_dir

    config, tensors = read_adapter_dir(f"{run_dir}/adapter-init")
    gen = torch.Generator().manual_seed(0)
    for k, v in tensors.items():
        if "lora_B" in k:
            tensors[k] = torch.randn(v.shape, generator=gen) * 0.02
    write_adapter_dir(out_dir, config, tensors)
    return str(out_dir)


def test_dora_double_rounding_fails_the_probe_and_the_diagnostic_names_the_layer(tmp_path):
    from artifacts import read_json
    from engine import runtime
    from engine.diagnose import adapter_modules
    from stages.context import run_config
    from stages.diagnose import diagnose
    from stages.export import export_base
    from stages.probe import probe

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"adapter.type": "dora", "model.dtype": "bfloat16"})
    adapter = trained_like_adapter(run_dir, tmp_path / "adapter")
    base = read_json(f"{run_dir}/prepared.json")["base"]
    export = export_base(run_dir, base)["path"]
    healthy = probe(run_dir, 0, adapter, export, base)  # same arithmetic: every layer bitwise, gap 0
    assert healthy["passed"] and healthy["max_gap"] == 0.0 and healthy["argmax_agreement"] == 1.0
    sampler = runtime.sampler(run_config(run_dir), export, base)
    for module in adapter_modules(sampler.model).values():  # the injected defect, in the sampler only
        module.forward = types.MethodType(_round_twice, module)
    with pytest.raises(GateFailed) as err:
        probe(run_dir, 1, adapter, export, base)
    assert err.value.gate == "teacher-forced-probe"
    first = err.value.report["layers"]["first_differing"]
    assert first is not None and "differs from the trainer's" in str(err.value)
    d = diagnose(run_dir, 1, "teacher-forced-probe", err.value.report, adapter, base)
    assert d["verdict"].startswith("sampler layer arithmetic"), d["verdict"]
    assert first["layer"] in d["verdict"]
    saved = read_json(d["path"])
    assert saved["adapter_weights"]["differing"] == 0, "the weights are right; the arithmetic is not"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_streamed_layer_comparison_reports_what_the_two_dictionaries_report(device):
    """compare_adapter_layers (one model's layer outputs on the host, the other's compared as its layers run: what
    the probe uses, so a full-size probe on one 80 GB GPU does not hold two sets of outputs) gives compare_layers'
    report on the same pair: the same model twice (nothing differs), and a second model whose one adapter layer
    is scaled by 1 + 2^-6 (that layer is the first differing one, with the same size of difference). On a GPU the
    outputs cross to the host: same report."""
    import copy

    from engine import diagnose as D
    from tests.test_cuda_graphs import TOKS, _model

    model = _model(adapter="dora", dtype="bfloat16" if device == "cuda" else "float32", device=device)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(4, 64, (19,), generator=g).tolist()
    thoughts = (torch.randn(3, 128, generator=g) * 0.5).to(device)
    answer = torch.randint(4, 64, (5,), generator=g).tolist()
    full = lambda a, b: D.compare_layers(D.adapter_layer_outputs(a, prefix, thoughts, answer, TOKS),  # noqa: E731
                                         D.adapter_layer_outputs(b, prefix, thoughts, answer, TOKS))
    streamed = lambda a, b: D.compare_adapter_layers(a, TOKS, b, TOKS, prefix, thoughts, answer)  # noqa: E731
    same = streamed(model, model)
    assert same == full(model, model)
    assert same["layers"] == len(D.adapter_modules(model)) > 0 and same["differing"] == 0 and not same["missing"]

    other = copy.deepcopy(model)
    names = list(D.adapter_modules(other))
    victim = D.adapter_modules(other)[names[len(names) // 2]]
    plain = victim.forward
    victim.forward = lambda x, *a, **k: (plain(x, *a, **k) * (1 + 2 ** -6)).to(x.dtype)  # off by a BF16 step
    report = streamed(model, other)
    assert report == full(model, other)
    assert report["differing"] >= 1 and report["first_differing"]["layer"] == names[len(names) // 2]
    assert report["first_differing"]["max_abs"] > 0


def test_probe_checkpoint_and_bitwise_thoughts_on_a_healthy_run(tmp_path):
    from artifacts import read_json, read_jsonl
    from engine import latent as LT
    from engine import runtime
    from stages.context import generator, run_config
    from stages.probe import probe, verify_checkpoint

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"steps.pattern": ["fresh", "reuse"]})
    s0 = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    adapter = f"{run_dir}/step-0000/adapter"
    pr = probe(run_dir, 0, adapter, s0["export"], s0["base"])
    assert pr["passed"] and pr["max_gap"] == 0.0
    cfg = run_config(run_dir)
    eng = runtime.trainer(cfg, s0["base"], s0["base"])
    pc = eng.prefix_cache
    assert pc is not None and pc.hits > 0  # generation reused stored prefixes (each turn's earlier tokens) ...
    assert pc.stored_bytes == 0  # ... and replay released them: nothing can be hit under the next adapter
    vc = verify_checkpoint(run_dir, adapter, s0["base"])
    assert vc["identical"] and vc["max_abs_diff"] == 0.0
    # the end of the run released what only generation uses (room for the second engine on a GPU)
    assert eng.prefix_cache.stored_bytes == 0 and eng._latent_graph is None and not eng.live
    assert vc["memory"] == {"before": {}, "after": {}}  # the census counts CUDA memory only
    history = read_jsonl(f"{run_dir}/probe_history.jsonl")
    assert history[-1]["layers"]["differing"] == 0 and history[-1]["layers"]["compared"] > 0
    # where the probe's time went, part by part (the whole is the stage's wall_s)
    parts = history[-1]["seconds"]
    assert set(parts) == {"engines", "thoughts", "trainer", "sampler", "layers"}
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= pr["wall_s"] + 1e-3
    # bitwise thoughts: the same seed gives the same thought vectors bit for bit, in the same batch layout
    prefixes = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    a = LT.latent_loop(eng.model, prefixes, 4, 0.05 * eng.scale, eng.scale, eng.toks, generator(0, "bitwise"))
    b = LT.latent_loop(eng.model, prefixes, 4, 0.05 * eng.scale, eng.scale, eng.toks, generator(0, "bitwise"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the probe samples its thoughts on the engine generation samples them with (its fastest path: graphed on a GPU);
    # the same thoughts bit for bit as the trainer model's plain loop that verify-checkpoint runs
    from stages.probe import probe_inputs

    sampler = runtime.sampler(cfg, s0["export"], s0["base"])
    thinker = runtime.latent_engine(cfg, eng, sampler)
    assert thinker is eng  # an unquantized base: the trainer samples the thoughts (latent.engine auto)
    plain, fast = probe_inputs(cfg, eng, s0["base"]), probe_inputs(cfg, eng, s0["base"], thinker)
    assert plain[0] == fast[0] and plain[2] == fast[2] and all(torch.equal(x, y) for x, y in zip(plain[1], fast[1]))
    # latent.engine sampler (what auto picks for an NF4 base): the sampler's model samples the probe's thoughts, the
    # same ones here (its model is the unquantized trainer's)
    on_sampler = cfg.with_overrides(**{"latent.engine": "sampler"})
    for e in (eng, sampler):
        e.use_adapter(adapter)
    assert runtime.latent_engine(on_sampler, eng, sampler) is sampler
    via = probe_inputs(on_sampler, eng, s0["base"], runtime.latent_engine(on_sampler, eng, sampler))
    assert all(torch.equal(x, y) for x, y in zip(plain[1], via[1]))
    # a reuse step appends its (ungated) drift report: every step leaves a parity record
    from stages.replay import replay

    replay(run_dir, 1, s0["rollouts"], adapter, s0["base"], False)
    parity = read_jsonl(f"{run_dir}/parity_history.jsonl")
    assert [(p["step"], p["kind"], p["gated"]) for p in parity] == [(0, "fresh", True), (1, "reuse", False)]
    assert parity[1]["tokens"] == parity[0]["tokens"] > 0, "the reuse step measures every replayed answer token"
    assert read_json(f"{run_dir}/step-0001/parity.json")["passed"] is None


def test_thought_sampling_logq_replay_keeps_recorded_rounding_out_of_the_ratio(tmp_path):
    """grpo.thought_sampling_logq: with `replay` (default) the importance ratio compares the sampler's answer tokens
    only (thoughts come from the trainer itself), so a recorded thought log-density that is off (BF16/NF4 rounding of
    mu between the generation and replay layouts: several nats) changes nothing; with `recorded` it enters the
    sequence-level ratio. Either way the gap is reported (thought_logq_gap_max)."""
    import numpy as np
    import pyarrow as pa

    from artifacts import read_table, to_tensor_list, write_table
    from stages.context import run_config
    from stages.optimize import loss_inputs

    run_dir = make_run(tmp_path / "run")
    first = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    # fp32: generation and replay agree to rounding. The size: mu differs between the two layouts by ~1e-7 relative,
    # log q moves by sum_j eps_j dmu_j / sigma ~ 1e-4 per thought (d 128, sigma 0.05 scale); the max over a step's
    # thoughts measured 1.2e-3 with per-row noise (engine/rng.py), 0.9e-3 with the earlier batch-wide stream
    assert first["optimize"]["thought_logq_gap_max"] < 2e-3
    roll = read_table(first["rollouts"])
    shifted = pa.array([np.asarray(x, dtype=np.float32) + 5.0 for x in roll.column("thought_logq").to_pylist()],
                       type=roll.schema.field("thought_logq").type)
    off = str(tmp_path / "shifted.arrow")
    write_table(off, roll.set_column(roll.schema.get_field_index("thought_logq"), "thought_logq", shifted))
    cfg, rp = run_config(run_dir), first["replay"]["path"]
    base, moved = loss_inputs(cfg, first["rollouts"], rp, rp), loss_inputs(cfg, off, rp, rp)
    assert torch.equal(base.is_ratio, moved.is_ratio) and torch.equal(base.samp_lp, moved.samp_lp)
    # max |recorded + 5 - replay| = 5 + max(recorded - replay): within the unshifted gap of 5 (plus the float32
    # rounding of the shifted values); the unshifted gap is machine-dependent rounding (1.2e-3 on one CPU, 1.22e-3
    # on another), so the bound is that gap, not a fixed 1e-3
    assert abs(moved.thought_gap - 5.0) <= base.thought_gap + 1e-5, (moved.thought_gap, base.thought_gap)
    rec = cfg.with_overrides(**{"grpo.thought_sampling_logq": "recorded"})
    r0, r1 = loss_inputs(rec, first["rollouts"], rp, rp), loss_inputs(rec, off, rp, rp)
    # fp32: the two choices differ by exactly the recorded-vs-replayed gap of each sequence's thoughts, exp(sum of
    # (replayed - recorded)) -- small, but a sum over the row's thoughts whose size depends on the CPU's rounding
    recorded = to_tensor_list(read_table(first["rollouts"]), "thought_logq", torch.float32)
    d = torch.zeros(base.n_rows)
    for row, rep_t, rec_t in zip(base.rows, base.lp_turn, recorded):
        d[row] += (rep_t[:base.K] - rec_t).sum()
    assert torch.allclose(r0.is_ratio, base.is_ratio * torch.exp(d)[:, None], rtol=1e-5), (r0.is_ratio, d)
    assert float(d.abs().max()) < 0.05  # and near 1: fp32 rounding, not a different density
    assert float(r1.is_ratio.max()) < 1e-3  # 5 nat per thought: exp(-5 K turns) per sequence
