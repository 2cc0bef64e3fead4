"""engine/gdn_step.py: the static decoder's one-token GDN step (gates + recurrent step in one kernel, state in place).

CPU (Triton's interpreter, in a subprocess): the kernel qualifies by engine.gdn's rule against transformers' FP32 path
and is as accurate as transformers' own BF16 path; wrong steps (state on a copy, key heads mapped wrongly, the decay
dropped) do not qualify; installed, the tiny hybrid's static latent loop runs it in every GDN layer and its thoughts
stay within BF16 rounding of transformers' forward. GPU (`gpu` marker): it qualifies at the 27B head layout, and the
graphed latent loop with it equals the eager static loop bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine import gdn, gdn_step as S
from tests.triton_interpreter import run_interpreted

GROUPED = {"hk": 2, "hv": 4, "dk": 16, "dv": 16, "w": 4}  # two value heads per key head, as the 27B (16 / 48)


def test_the_kernel_qualifies_and_matches_transformers_bf16_path():
    r = run_interpreted("""
        import json, torch
        from engine import gdn_step as S
        L = {"hk": 2, "hv": 4, "dk": 16, "dv": 16, "w": 4}
        q = S.qualify(L, torch.device("cpu"))
        x, a, b, A_log, dt_bias, state = [t.bfloat16() if i < 5 else t for i, t in enumerate(S._inputs(L, 4, "cpu", 5))]
        s1, s2 = state.clone(), state.clone()
        o1 = S.step_fused(x, a, b, A_log, dt_bias, s1, 2, 16)
        o2 = S.step_reference(x, a, b, A_log, dt_bias, s2, 2, 16)
        q["vs_torch_bf16"] = {"o_equal": bool(torch.equal(o1, o2)),
                              "o_max_abs": float((o1.float() - o2.float()).abs().max()),
                              "state_rel": float((s1 - s2).norm() / s2.norm())}
        print(json.dumps(q))
    """)
    assert r["passed"], r
    assert [c["rows"] for c in r["cases"]] == [1, 4, 16] and all(c["in_place"] for c in r["cases"])
    for c in r["cases"]:  # as accurate as transformers' BF16 path against FP32 (stated tolerance: 1.01x + 1e-6)
        for k in ("o", "state"):
            assert c["rel_l2"][k] <= 1.01 * c["torch_bf16_rel_l2"][k] + 1e-6, c
            assert 0 < c["torch_bf16_rel_l2"][k] < 1e-2, c  # BF16 against FP32: small, not zero
    # the same arithmetic as transformers' path on the same BF16 inputs: output within one BF16 rounding, state
    # within FP32 rounding (the exp and the order of the K-sums differ)
    v = r["vs_torch_bf16"]
    assert v["o_max_abs"] <= 2 ** -7 and v["state_rel"] < 1e-6, v


def _on_a_copy(x, a, b, A_log, dt_bias, state, hk, dk):
    """Right output, but the state updated on a copy (the captured graph would never see it)."""
    return S.step_reference(x, a, b, A_log, dt_bias, state.clone(), hk, dk)


def _heads_interleaved(x, a, b, A_log, dt_bias, state, hk, dk):
    """Value head hv read against key head hv % H instead of hv // (HV / H)."""
    rows, hv, _, vd = state.shape
    v = x[:, 2 * hk * dk:].reshape(rows, hv // hk, hk, vd).transpose(1, 2).reshape(rows, -1)
    perm = torch.arange(hv).reshape(hv // hk, hk).t().reshape(-1)
    st = state[:, perm].contiguous()
    o = S.step_reference(torch.cat([x[:, :2 * hk * dk], v], 1), a[:, perm], b[:, perm], A_log[perm], dt_bias[perm],
                         st, hk, dk)
    inv = torch.argsort(perm)
    state.copy_(st[:, inv])
    return o[:, inv]


def _decay_dropped(x, a, b, A_log, dt_bias, state, hk, dk):
    """The gate's decay dropped (exp(A_log) ~ 0: g ~ 0, the state never decays)."""
    return S.step_reference(x, a, b, A_log * 0 - 30, dt_bias, state, hk, dk)


def _fails_to_build(*args):
    """What a kernel that does not compile or launch on this GPU raises."""
    raise RuntimeError("out of resources: shared memory")


@pytest.mark.parametrize("fn", [_on_a_copy, _heads_interleaved, _decay_dropped, _fails_to_build])
def test_wrong_steps_do_not_qualify(fn):
    r = S.qualify_one(fn, GROUPED, 4, torch.device("cpu"), seed=3)
    assert not r["passed"], r
    assert S.qualify_one(S.step_reference, GROUPED, 4, torch.device("cpu"), seed=3)["passed"]


def test_install_on_a_cpu_without_the_interpreter_keeps_transformers_forward():
    from types import SimpleNamespace

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4)
    assert S.install("auto", cfg, "cpu") == "torch" and S.install("torch", cfg, "cpu") == "torch"
    assert S._STATE["orig"] is None


def test_the_static_latent_loop_runs_the_fused_step_in_every_gdn_layer():
    """Tiny hybrid, BF16, DoRA adapter, eager static latent loop on restored prefix-cache rows: with the fused step
    installed every GDN layer of every forward runs it, and the thoughts stay within
    BF16 rounding of transformers' forward (stated tolerance: mean |dz| below 1e-2 x the embedding scale, the same
    bound the GPU test puts on static vs dynamic caches), and finite."""
    r = run_interpreted("""
        import json, torch
        from engine import cuda_graphs as CG, gdn_step as S, model as M, prefix_cache as PC
        from tests.test_cuda_graphs import TOKS as toks, _model
        model = _model(dtype="bfloat16", adapter="dora")
        g = torch.Generator().manual_seed(1)
        prefixes = [torch.randint(4, 64, (int(n),), generator=g).tolist() for n in (12, 20, 9, 17)]
        scale = M.embed_scale(model)
        K = 5
        def thoughts():
            rs = PC.prefill_rows(model, prefixes, None, [[] for _ in prefixes])
            loop = CG.GraphedLatentLoop(model, graphed=False)
            return loop.run_rows(rs, K, 0.05 * scale, scale, toks, torch.Generator().manual_seed(2))[0]
        ref = thoughts()
        chosen = S.install("auto", M._parts(model)[0].config, "cpu")
        n0 = S._STATE["launches"]
        z = thoughts()
        launches = S._STATE["launches"] - n0
        z2 = thoughts()
        model = _model()  # FP32: not the kernel's (BF16 activations); transformers' forward runs, no launch
        n1 = S._STATE["launches"]
        thoughts()
        fp32_launches = S._STATE["launches"] - n1
        S.reset()
        gap = (z.float() - ref.float()).abs()
        print(json.dumps({"chosen": chosen, "launches": launches, "K": K,
                          "mean_gap": float(gap.mean() / scale), "max_gap": float(gap.max() / scale),
                          "finite": bool(torch.isfinite(z).all()), "repeat_equal": bool(torch.equal(z, z2)),
                          "fp32_launches": fp32_launches}))
    """)
    assert r["chosen"] == "fused", r
    # 3 GDN layers in the tiny hybrid, in each of the K forwards (<think>, then the first K - 1 thoughts fed back)
    assert r["launches"] == 3 * r["K"], r
    assert r["finite"] and r["repeat_equal"] and r["fp32_launches"] == 0, r
    print(f"fused step vs transformers' forward: mean |dz| {r['mean_gap']:.2e}, max {r['max_gap']:.2e} (x scale)")
    assert r["mean_gap"] < 1e-2, r


@pytest.mark.gpu
def test_fused_step_qualifies_at_the_27b_layout_and_graphs_equal_eager():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    q = S.qualify({"hk": 16, "hv": 48, "dk": 128, "dv": 128, "w": 4}, dev)
    assert q["passed"], q
    from tests.test_cuda_graphs import TOKS, _gen, _model, _prefixes
    from engine import cuda_graphs as CG, model as M

    model = _model(dtype="bfloat16", adapter="dora", device="cuda")
    gdn.install("auto", M._parts(model)[0].config, dev)
    assert S.install("auto", M._parts(model)[0].config, dev) == "fused"
    try:
        scale = M.embed_scale(model)
        prefixes = _prefixes(4, seed=7)
        n0 = S._STATE["launches"]
        ze, qe = CG.GraphedLatentLoop(model, graphed=False).run(prefixes, 6, 0.05 * scale, scale, TOKS, _gen(11))
        assert S._STATE["launches"] > n0
        zg, qg = CG.GraphedLatentLoop(model, graphed=True).run(prefixes, 6, 0.05 * scale, scale, TOKS, _gen(11))
        assert torch.equal(ze, zg) and torch.equal(qe, qg)
    finally:
        S.reset()
