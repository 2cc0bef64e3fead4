"""The decode attention kernels (engine/attention_kernels.py) against the FP32 PyTorch path and FP64, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when kernels are defined). The GPU
qualifies the same kernels at start-up (engine.runtime -> attention_kernels.install) with the same check."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted as _interpreted


def test_the_kernels_are_as_accurate_as_the_fp32_path_against_fp64():
    """Decode (one query token) and short prefills, GQA groups of 1-6 heads, head dims 32-256 (96: not a power of
    two), cache lengths that end inside a split, a query that sees no key, the model's transposed query layout and
    keys that are views of a longer buffer. Stated tolerance: relative L2 vs FP64 within 1.25x of the PyTorch path's,
    largest error within 2x; a batch row alone and a query token alone equal to themselves among the others."""
    q = _interpreted("""
        import json, torch
        from engine import attention_kernels as AT
        cases = ((4, 24, 4, 1, 600, 256), (2, 8, 2, 1, 300, 64), (3, 4, 1, 64, 129, 32), (1, 6, 2, 1, 77, 96),
                 (2, 16, 4, 2, 700, 128))
        print(json.dumps(AT.qualify(torch.device("cpu"), cases=cases)))
    """)
    assert q["passed"], q
    assert len(q["cases"]) == 5
    for c in q["cases"]:
        assert c["kernel_rel_l2"] <= 1.25 * c["torch_rel_l2"] + 1e-6, c
        assert c["kernel_max_abs"] <= 2.0 * c["torch_max_abs"] + 1e-6, c
        assert c["row_alone_bitwise"] and c["token_alone_bitwise"], c
        assert c["torch_rel_l2"] < 5e-3  # both are BF16-rounding accurate (~2^-9), not merely alike
        assert c["equal_to_torch"] > 0.9  # mostly the same BF16 values: only the order of FP32 sums differs


def test_a_bf16_latent_loop_and_decode_through_the_kernels_are_as_accurate_as_the_pytorch_path():
    """The tiny hybrid in BF16 with a DoRA adapter on the static cache (engine.cuda_graphs, eager): thoughts and
    sampled answers with the kernels vs the FP32 PyTorch path. The kernels run (launch count: one per attention layer
    and single-token step), the thoughts agree within 1e-2 relative L2 (a BF16 rounding step of one attention output
    may differ and the loop feeds it back), the sampled tokens are the PyTorch path's and their log-probs within
    0.05 nat. (The kernels' accuracy against FP64 is the test above; the loop's BF16-vs-FP32 drift on a random model
    is chaotic -- ~100 % relative after 6 thoughts on either path -- so it is no yardstick.)"""
    r = _interpreted("""
        import json, torch
        from configs.schema import load_config
        from engine import attention_kernels as AT
        from engine import cuda_graphs as CG
        from engine import model as M
        torch.manual_seed(0)
        cfg = load_config("tiny")
        V = 64
        TOKS = M.Tokens(pad=0, eos=1, think=2, answer_open=3)
        bf = M.build_random_model(cfg.model.arch, V, 0, 1, seed=0, dtype="bfloat16")
        torch.manual_seed(1)
        bf = M.attach_adapter(bf, cfg.adapter.model_copy(update={"type": "dora"}))
        with torch.no_grad():
            for n, p in bf.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        bf.eval()
        scale = M.embed_scale(bf)
        g = torch.Generator().manual_seed(0)
        prefixes = [torch.randint(4, V, (int(n),), generator=g).tolist() for n in (37, 90, 12)]
        layers = sum(t == "full_attention" for t in bf.config.get_text_config().layer_types)
        def loop(model):
            z, q = CG.GraphedLatentLoop(model, graphed=False).run(prefixes, 6, 0.05 * scale, scale, TOKS,
                                                                  torch.Generator().manual_seed(3))
            return z.float(), q.float()
        AT.reset()
        zt, _ = loop(bf)
        AT._STATE["devices"].add("cpu")
        n0 = AT._STATE["launches"]
        zk, _ = loop(bf)
        launched = AT._STATE["launches"] - n0
        dec_t = CG.GraphedDecoder(bf, graphed=False)
        prompts = [bf.get_input_embeddings()(torch.tensor(p)) for p in prefixes]
        ids_k, lps_k = dec_t.sample(prompts, 8, 1.0, TOKS, torch.Generator().manual_seed(4))
        AT.reset()
        ids_t, lps_t = CG.GraphedDecoder(bf, graphed=False).sample(prompts, 8, 1.0, TOKS,
                                                                  torch.Generator().manual_seed(4))
        rel = lambda a, b: float((a - b).norm() / b.norm())
        lp_diff = max(abs(a - b) for x, y in zip(lps_k, lps_t) for a, b in zip(x, y))
        print(json.dumps({"launched": launched, "layers": layers, "z_rel": rel(zk, zt),
                          "same_ids": ids_k == ids_t, "lp_diff": lp_diff}))
    """)
    # 6 thoughts: the prefill's last token (a short query: the kernels) + 5 single-token steps, per attention layer;
    # prefixes longer than the short-query limit prefill through the model's own attention
    assert r["launched"] >= 5 * r["layers"] > 0, r
    assert r["z_rel"] <= 1e-2, r
    assert r["same_ids"], r
    assert r["lp_diff"] <= 0.05, r


def test_install_keeps_the_pytorch_path_on_a_cpu_and_rejects_unknown_modes():
    import torch

    from engine import attention_kernels as AT

    AT.reset()
    assert AT.install("auto", "cpu") == "torch" and AT.install("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="auto, torch"):
        AT.install("fast", "cpu")
    q = torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    assert not AT.enabled(q, k, None)  # nothing qualified on this device: the PyTorch path runs
    out = AT.attention(q, k, k, None, 0.25)
    assert out.shape == (1, 1, 4, 16) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="reads BF16"):
        AT.gqa_fused(q.float(), k, k, None, 0.25)
    with pytest.raises(ValueError, match="bool mask"):
        AT.gqa_fused(q, k, k, torch.zeros(1, 1, 1, 8), 0.25)


@pytest.mark.gpu
def test_on_cuda_the_kernels_qualify_and_keep_graphed_and_eager_steps_bitwise_equal():
    """Qualified on this GPU at the 27B shape's cases; a BF16 DoRA model's graphed latent loop and decode equal the
    eager static path bit for bit with the kernels in both (the kernels run: launches counted)."""
    import torch

    from configs.schema import load_config
    from engine import attention_kernels as AT
    from engine import cuda_graphs as CG
    from engine import model as M

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    AT.reset()
    try:
        q = AT.qualify(torch.device("cuda"))
        assert q["passed"], q
        assert AT.install("auto", "cuda") == "fused"
        cfg = load_config("tiny")
        toks = M.Tokens(pad=0, eos=1, think=2, answer_open=3)
        model = M.build_random_model(cfg.model.arch, 64, 0, 1, seed=0, dtype="bfloat16")
        model = M.attach_adapter(model, cfg.adapter.model_copy(update={"type": "dora"})).cuda().eval()
        scale = M.embed_scale(model)
        g = torch.Generator().manual_seed(0)
        prefixes = [torch.randint(4, 64, (int(n),), generator=g).tolist() for n in (37, 90, 12, 50)]
        out = {}
        for graphed in (False, True):
            n0 = AT._STATE["launches"]
            loop = CG.GraphedLatentLoop(model, graphed=graphed)
            z, lq = loop.run(prefixes, 8, 0.05 * scale, scale, toks, torch.Generator(device="cuda").manual_seed(3))
            out[graphed] = (z, lq, AT._STATE["launches"] - n0)
        assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
        assert out[False][2] > 0  # eager: one launch per attention layer and step (a graph replays its launches)
    finally:
        AT.reset()
