"""The fused RMSNorms (engine/norm_kernels.py) against transformers' expressions and FP64, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when kernels are defined). The GPU
qualifies the same kernels at start-up (engine.runtime -> norm_kernels.install) with the same check."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted as _interpreted


def test_both_norms_forward_and_backward_are_as_accurate_as_transformers_against_fp64():
    q = _interpreted("""
        import json, torch
        from engine import norm_kernels as NK
        print(json.dumps(NK.qualify(torch.device("cpu"))))
    """)
    assert q["passed"], q
    cases = q["cases"]
    assert {(c["kernel"], c["width"], c["weight"]) for c in cases} >= {
        ("rms", 5120, "bfloat16"), ("rms", 256, "bfloat16"), ("gated", 128, "bfloat16"), ("gated", 128, "float32")}
    assert any(c["strided"] for c in cases)  # the q_proj half: a view with rows 2n apart, read without a copy
    for c in cases:
        assert c["row_alone_bitwise"], c
        for part in ("out", "dx") + (("dz",) if c["kernel"] == "gated" else ()):
            e = c[part]
            # stated tolerance: relative L2 vs FP64 within 1.25x of transformers' FP32 chain's, max error within 2x
            assert e["kernel_rel_l2"] <= 1.25 * e["torch_rel_l2"] + 1e-6, (c["kernel"], part, e)
            assert e["kernel_max_abs"] <= 2.0 * e["torch_max_abs"] + 1e-6, (c["kernel"], part, e)
            assert e["torch_rel_l2"] < 5e-3  # both are BF16-rounding accurate (~2^-9), not merely alike


def test_a_model_with_fused_norms_scores_and_backpropagates_like_transformers():
    """The tiny hybrid in BF16 with a DoRA adapter: replay-style forward (selected-token log-probs) and backward
    through the patched Qwen3.5 norm forwards vs transformers' own. Log-probs within 0.05 nat; the adapter
    gradients' relative L2 error against the FP32 model within 1.25x of transformers' BF16 error."""
    r = _interpreted("""
        import json, torch
        from configs.schema import load_config
        from engine import model as M
        from engine import norm_kernels as NK
        torch.manual_seed(0)
        cfg = load_config("tiny")
        V = 64
        def build(dtype):
            m = M.build_random_model(cfg.model.arch, V, 0, 1, seed=0, dtype=dtype)
            torch.manual_seed(1)
            m = M.attach_adapter(m, cfg.adapter.model_copy(update={"type": "dora", "train_final_norm": False}))  # frozen norms: all fused
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.05)
            return m
        ids = torch.randint(4, V, (2, 48), generator=torch.Generator().manual_seed(3))
        def run(model):
            model.zero_grad()
            logits = model(input_ids=ids).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            lp.sum().backward()
            grads = torch.cat([p.grad.float().reshape(-1) for n, p in model.named_parameters() if p.grad is not None])
            return lp.detach(), grads
        lp32, g32 = run(build("float32"))
        bf = build("bfloat16")
        NK.reset()
        lp_t, g_t = run(bf)
        NK._STATE["devices"].add("cpu"); NK._patch()
        n0 = NK._STATE["launches"]
        lp_k, g_k = run(bf)
        launched = NK._STATE["launches"] - n0
        NK.reset()
        n1 = NK._STATE["launches"]
        run(bf)
        rel = lambda a, b: float((a - b).norm() / b.norm())
        print(json.dumps({"launched": launched, "after_reset": NK._STATE["launches"] - n1,
                          "lp_kernel_vs_torch": float((lp_k - lp_t).abs().max()),
                          "grad_kernel_vs_fp32": rel(g_k, g32), "grad_torch_vs_fp32": rel(g_t, g32),
                          "grad_kernel_vs_torch": rel(g_k, g_t)}))
    """)
    # tiny: 3 GDN layers (input, post-attention, gated norm), 1 attention layer (input, post-attention, q, k), final;
    # every forward and every backward but layer 0's input norm (its input, the frozen embedding, needs no gradient)
    assert r["launched"] == 2 * (3 * 3 + 4 + 1) - 1, r
    assert r["after_reset"] == 0, r  # reset restores transformers' forwards
    assert r["lp_kernel_vs_torch"] <= 0.05, r
    assert r["grad_kernel_vs_fp32"] <= 1.25 * r["grad_torch_vs_fp32"], r


def test_install_keeps_transformers_norms_on_a_cpu_and_rejects_unknown_modes():
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from engine import norm_kernels as NK

    before = mq.Qwen3_5RMSNorm.forward
    assert NK.install("auto", "cpu") == "torch" and NK.install("torch", "cpu") == "torch"
    assert mq.Qwen3_5RMSNorm.forward is before  # nothing patched where nothing qualified
    with pytest.raises(ValueError, match="auto, torch"):
        NK.install("fast", "cpu")
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert not NK.enabled(x, torch.zeros(8))
    with pytest.raises(ValueError, match="round to BF16"):
        NK.rms_fused(x.float(), torch.zeros(8), 1e-6)


@pytest.mark.gpu
def test_on_cuda_the_kernels_qualify_and_serve_every_norm_of_a_decode_and_a_replay():
    """Qualified on this GPU; a BF16 model's forward + backward runs every norm through them; a row's norm does not
    depend on its batch (a decode of one row equals that row of a batch of four, bit for bit, in the norm)."""
    import torch

    from configs.schema import load_config
    from engine import model as M
    from engine import norm_kernels as NK

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    NK.reset()
    try:
        assert NK.install("auto", "cuda") == "fused"
        cfg = load_config("tiny")
        model = M.build_random_model(cfg.model.arch, 64, 0, 1, seed=0, dtype="bfloat16").cuda().requires_grad_(False)
        ids = torch.randint(4, 64, (4, 33), device="cuda")
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # frozen base: the input's gradient
        n0 = NK._STATE["launches"]
        out = model(inputs_embeds=emb).logits.float()
        out.logsumexp(-1).sum().backward()
        assert torch.isfinite(emb.grad).all()
        assert NK._STATE["launches"] - n0 == 2 * (3 * 3 + 4 + 1)  # the input embedding needs a gradient here
        w = torch.randn(5120, device="cuda").bfloat16()
        x = torch.randn(4, 5120, device="cuda").bfloat16()
        assert torch.equal(NK.rms_fused(x, w, 1e-6)[2], NK.rms_fused(x[2:3], w, 1e-6)[0])
    finally:
        NK.reset()
