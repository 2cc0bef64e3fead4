"""model.attention_fp32 and the thought-density gate (gates.thought_logq_gap_max).

In BF16 the latent loop (one query over a cache) and replay (the whole turn at once) round the attention output
differently in a few elements; log q = -|z - mu|^2 / (2 sigma^2) turns the resulting ulp-sized differences of mu into
nats. With attention cores in FP32 in every layout the two compute the same thought means far more often, and the
per-step gap (max |recorded - replayed| log q) is gated. The limit (32 nat) is measured: healthy BF16 steps of the
tiny model stay <= 6.0 nat with the option (<= 8.7 without), a replay under an adapter one update away gives >= 827.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import fresh_step, make_run


def test_fp32_attention_is_sdpa_on_fp32_operands_rounded_once():
    from engine import model as M

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, False
    out, _ = M._sdpa_fp32(module, q, k, v, None, scaling=64 ** -0.5)
    w = (q.float() @ k.float().transpose(-1, -2)) * 64 ** -0.5
    w = w.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -math.inf)
    want = (torch.softmax(w, -1) @ v.float()).transpose(1, 2)  # (B, q, H, hd) like the attention interfaces
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert torch.equal(out, want.to(torch.bfloat16)) or float((out.float() - want).abs().max()) < 1e-2
    bf16_err = float((out.float() - want).abs().max())
    assert bf16_err <= float(want.abs().max()) * 2 ** -8  # one rounding of an FP32 result


@pytest.mark.slow
def test_thought_density_gate_passes_healthy_steps_and_fails_a_stale_adapter(tmp_path):
    from artifacts import read_json
    from engine import gates
    from engine import model as M
    from engine import runtime
    from stages.context import run_config
    from stages.optimize import optimize
    from stages.probe import probe, verify_checkpoint
    from stages.replay import replay

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"model.dtype": "bfloat16", "model.attention_fp32": True})
    cfg = run_config(run_dir)
    prep = read_json(f"{run_dir}/prepared.json")
    s0 = fresh_step(run_dir, 0, prep["adapter_init"])
    trainer = runtime.trainer(cfg, s0["base"], s0["base"])
    sampler = runtime.sampler(cfg, s0["export"], s0["base"])
    for eng in (trainer, sampler):
        assert M._parts(eng.model)[0].config._attn_implementation == M.FP32_ATTENTION
    healthy = s0["optimize"]["thought_logq_gap_max"]
    assert healthy <= cfg.gates.thought_logq_gap_max
    # trainer and hf sampler share the arithmetic: the probe stays bitwise, the reloaded checkpoint identical
    adapter = f"{run_dir}/step-0000/adapter"
    pr = probe(run_dir, 0, adapter, s0["export"], s0["base"])
    assert pr["passed"] and pr["max_gap"] == 0.0
    assert verify_checkpoint(run_dir, adapter, s0["base"])["identical"]

    # the injected defect: step 0's thoughts (sampled under adapter-init) replayed under another adapter (LoRA B as
    # after training), as if generation had run a stale adapter
    from tests.test_gates import trained_like_adapter

    other = trained_like_adapter(run_dir, tmp_path / "other-adapter")
    stale = replay(run_dir, 1, s0["rollouts"], other, s0["base"], False, keep_graph=False)["path"]
    with pytest.raises(gates.GateFailed) as err:
        optimize(run_dir, 1, s0["rollouts"], stale, stale, other, f"{run_dir}/step-0000/optimizer.safetensors",
                 s0["base"])
    assert err.value.gate == "thought-density"
    assert err.value.report["thought_logq_gap_max"] > 10 * cfg.gates.thought_logq_gap_max
    assert "gates.thought_logq_gap_max" in str(err.value)


def test_thought_gap_gate_by_hand():
    from engine import gates

    gates.check_thought_gap(31.9, 32.0, 3)
    with pytest.raises(gates.GateFailed, match="thought-density") as err:
        gates.check_thought_gap(32.5, 32.0, 3)
    assert err.value.report == {"step": 3, "thought_logq_gap_max": 32.5, "limit": 32.0}
