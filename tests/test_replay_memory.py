"""Replay memory policy: the lean adapter backward, chunked log-probs, packing, tiers, two-pass and the preflight.

References: PEFT's own forward and autograd (the adapter), torch.log_softmax (the chunked log-probs), and the FP32
full-batch reference of stages.gradcheck (every tier; gate relative L2 <= 0.002, no tensor outside).
"""

from __future__ import annotations

import pytest
import torch

from engine import model as M

ARCH = {
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
TOKS = M.Tokens(pad=0, eos=1, think=2, answer_open=3)


def _model(adapter_type: str, dtype: str = "float32", seed: int = 0):
    from configs.schema import AdapterConfig

    torch.manual_seed(seed)
    base = M.build_random_model(ARCH, 300, 0, 1, seed, dtype)
    model = M.attach_adapter(base, AdapterConfig(type=adapter_type, rank=4, alpha=8))
    with torch.no_grad():  # a trained-like adapter: non-zero B, magnitudes off their init
        for n, p in model.named_parameters():
            if p.requires_grad and "lora_B" in n:
                p.normal_(0, 0.05)
            elif p.requires_grad and "magnitude" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    model.eval()
    return model


def _turns(n: int = 5, seed: int = 1):
    from engine.replay import Turns

    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(4, 300, (int(x),), generator=g).tolist() for x in torch.randint(10, 60, (n,), generator=g)]
    answers = [torch.randint(4, 300, (int(x),), generator=g).tolist() for x in torch.randint(2, 9, (n,), generator=g)]
    thoughts = [torch.randn(3, ARCH["hidden_size"], generator=g) for _ in range(n)]
    return Turns(prefixes, thoughts, answers, list(range(n)))


def _Eng(model):
    """The trainer role (engine.runtime.Engine) around a test model."""
    from engine.runtime import Engine

    return Engine(model=model, toks=TOKS, scale=M.embed_scale(model))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}


def _zero(model):
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def _objective(a, q, idx):
    # a fixed, non-trivial weighting of every answer token and thought term (what optimize back-propagates)
    return sum((a[n] * (1 + 0.1 * torch.arange(a[n].numel()))).sum() + 0.01 * (q[n] * (n + 1)).sum()
               for n, _ in enumerate(idx))


def tiered_gradients(model, turns, rc, weights_q, weights_a):
    """Gradients of Σ w·logp through the production path: the plan of `rc` (engine.replay.plan_replay, with the
    packer rc asks for), each micro-batch scored in its tier, stages.optimize.accumulate_gradients. -> (grads, plan)"""
    from engine.replay import packer_for, plan_replay, score_microbatch
    from stages.optimize import accumulate_gradients

    class Cfg:  # what accumulate_gradients reads
        sampler = type("S", (), {"temperature": 1.0})()
        replay = rc

    class LI:
        pass

    eng = _Eng(model)
    plan = plan_replay(turns.lengths(), rc, packer=packer_for(turns, rc))
    _zero(model)
    live, lp_turn = [], [None] * len(turns.rows)
    for idx, tier in zip(plan.microbatches, plan.tiers):
        with torch.set_grad_enabled(tier != "two_pass"):
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)
        live.append((idx, a, q) if tier != "two_pass" else None)
        for n, i in enumerate(idx):
            lp_turn[i] = torch.cat([q[n].detach().float(), a[n].detach().float()])
    li = LI()
    li.turns, li.sigma, li.lp_turn = turns, 0.05, lp_turn
    accumulate_gradients(Cfg, eng, li, weights_q, weights_a, live=live, plan=(plan.microbatches, plan.tiers))
    return _grads(model), plan


# ----------------------------------------------------------------------------------------------------------------
# the lean adapter backward vs PEFT


@pytest.mark.parametrize("adapter_type", ["lora", "dora"])
@pytest.mark.parametrize("dtype,split", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_replay_adapter_forward_is_peft_bit_for_bit_and_gradients_match(adapter_type, dtype, split, monkeypatch):
    """split: the backward's rank-r products take the CUDA path (BF16 GEMMs of the split FP32 side, emulated here
    with the same BF16 operands and FP32 accumulation) instead of the FP32 products."""
    from configs.schema import ReplayConfig
    from engine import adapter_grad as AG
    from engine.replay import score_microbatch

    if split:
        monkeypatch.setattr(AG, "_split_here", lambda dtype, device: dtype == torch.bfloat16)
    model = _model(adapter_type, dtype)
    eng, turns = _Eng(model), _turns()
    idx = list(range(len(turns.rows)))
    _zero(model)
    a0, q0 = score_microbatch(eng, turns, idx, 1.0, 0.05)  # PEFT's own forward and autograd
    _objective(a0, q0, idx).backward()
    g_peft = _grads(model)
    _zero(model)
    rc = ReplayConfig(adapter_forward="lean", logprob_chunk=300)  # one chunk: the log-softmax is the same op
    a1, q1 = score_microbatch(eng, turns, idx, 1.0, 0.05, "keep", rc)
    _objective(a1, q1, idx).backward()
    g_lean = _grads(model)
    # forward: PEFT's expression for expression; the hidden states (and thus mu, log q) are identical
    assert torch.equal(q0.detach(), q1.detach())
    assert max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a0, a1)) < 1e-5
    def rel(g, ref):
        num = sum(float((g[k] - ref[k]).pow(2).sum()) for k in ref) ** 0.5
        return num / sum(float(ref[k].pow(2).sum()) for k in ref) ** 0.5

    if dtype == "float32":  # only summation order differs
        assert rel(g_lean, g_peft) < 1e-5, rel(g_lean, g_peft)
        return
    # BF16: both against the FP32 truth (same weights in FP32, PEFT's path). The lean path rounds the chunked
    # log-prob's input gradient once after an FP32 product (PEFT's path rounds the logits' gradient to BF16 before
    # the head's matmul), so it may differ from PEFT by BF16 noise but must be no less accurate.
    ref_model = _model(adapter_type, "float32")
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    _zero(ref_model)
    a2, q2 = score_microbatch(_Eng(ref_model), turns, idx, 1.0, 0.05)
    _objective(a2, q2, idx).backward()
    g_ref = _grads(ref_model)
    print(f"{adapter_type} bf16 vs fp32: peft {rel(g_peft, g_ref):.2e}, lean {rel(g_lean, g_ref):.2e}")
    assert rel(g_lean, g_ref) <= 1.25 * rel(g_peft, g_ref) + 1e-4


def _split_forward_case(adapter_type: str, dev: str = "cpu") -> None:
    """replay.lora_product: split against PEFT's BF16 forward and the FP32 reference (see the tests below)."""
    from configs.schema import ReplayConfig
    from engine import adapter_grad as AG
    from engine.replay import score_microbatch

    calls = []
    real = AG.mm_exact_lhs

    def counted(a, b):
        calls.append(a.shape)
        return real(a, b)

    model = _model(adapter_type, "bfloat16").to(dev)
    eng, turns = _Eng(model), _turns()
    idx = list(range(len(turns.rows)))
    _zero(model)
    with torch.enable_grad():
        a0, q0 = score_microbatch(eng, turns, idx, 1.0, 0.05)  # PEFT's own forward and autograd
        _objective([x.cpu() for x in a0], q0.cpu(), idx).backward()
    g_peft = _grads(model)
    got = {}
    widths = {m.in_features for m in AG.adapter_layers(model).values()}
    for tier in ("keep", "checkpoint"):
        _zero(model)
        calls.clear()
        rc = ReplayConfig(adapter_forward="lean", lora_product="split", logprob_chunk=300)
        with torch.enable_grad():
            AG.mm_exact_lhs = counted
            try:
                a1, q1 = score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)
            finally:
                AG.mm_exact_lhs = real
            # the forward's products took the split path (before any backward): x (tokens, in) against A's halves
            assert len(calls) >= len(AG.adapter_layers(model)) and all(c[0] > 16 and c[-1] in widths for c in calls)
            _objective([x.cpu() for x in a1], q1.cpu(), idx).backward()
        got[tier] = (_grads(model), [x.detach().cpu() for x in a1], q1.detach().cpu())
    g_split, a1, q1 = got["keep"]
    assert all(torch.equal(x, y) for x, y in zip(a1, got["checkpoint"][1])) and torch.equal(q1, got["checkpoint"][2])
    assert max(float((x.detach().cpu().float() - y.float()).abs().max()) for x, y in zip(a0, a1)) < 0.05
    ref_model = _model(adapter_type, "float32").to(dev)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    _zero(ref_model)
    with torch.enable_grad():
        a2, q2 = score_microbatch(_Eng(ref_model), turns, idx, 1.0, 0.05)
        _objective([x.cpu() for x in a2], q2.cpu(), idx).backward()
    g_ref = _grads(ref_model)

    def rel(g, ref):
        num = sum(float((g[k].cpu() - ref[k].cpu()).pow(2).sum()) for k in ref) ** 0.5
        return num / sum(float(ref[k].cpu().pow(2).sum()) for k in ref) ** 0.5

    print(f"{adapter_type} bf16 vs fp32 on {dev}: peft {rel(g_peft, g_ref):.2e}, split forward {rel(g_split, g_ref):.2e}")
    assert rel(g_split, g_ref) <= 1.25 * rel(g_peft, g_ref) + 1e-4


@pytest.mark.parametrize("adapter_type", ["lora", "dora"])
def test_split_forward_product_passes_the_gradient_gate(adapter_type, monkeypatch):
    """replay.lora_product: split (the CUDA path, emulated): h = A x from one BF16 GEMM of x with A's BF16 halves.
    Not PEFT's forward bit for bit any more, but its log-probs within BF16 noise of it and its gradients as close to
    the FP32 reference as PEFT's own BF16 path (the test above's criterion); both tiers' forwards agree bit for bit."""
    from engine import adapter_grad as AG

    monkeypatch.setattr(AG, "_split_here", lambda dtype, device: dtype == torch.bfloat16)
    _split_forward_case(adapter_type)


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_type", ["lora", "dora"])
def test_split_forward_product_on_the_gpu(adapter_type):
    """The same on CUDA with the split products qualified there (engine.adapter_grad._bf16_mm_f32_ok)."""
    from engine import adapter_grad as AG

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert AG._split_here(torch.bfloat16, torch.device("cuda")), "the split BF16 products do not qualify on this GPU"
    _split_forward_case(adapter_type, "cuda")


def test_lora_h_paths(monkeypatch):
    """lora_h: PEFT's FP32 product by default (bit for bit F.linear of the FP32 copy), also when split is asked for
    where the split products do not qualify (this CPU); the split path within 2e-5 relative of FP64. The config
    refuses split without the lean forward, naming both settings."""
    from configs.schema import ReplayConfig
    from engine import adapter_grad as AG

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 300, generator=g).bfloat16()
    A = torch.randn(16, 300, generator=g) * 0.05
    fp32 = torch.nn.functional.linear(x.float(), A)
    assert torch.equal(AG.lora_h(x, A), fp32) and torch.equal(AG.lora_h(x, A, split=True), fp32)
    monkeypatch.setattr(AG, "_split_here", lambda dtype, device: dtype == torch.bfloat16)
    split = AG.lora_h(x, A, split=True)
    ref = x.double() @ A.double().t()
    assert split.shape == fp32.shape and split.dtype == torch.float32
    assert float((split.double() - ref).norm() / ref.norm()) <= 2e-5
    assert torch.equal(AG.lora_h(x, A), fp32)  # not asked: the FP32 product
    with pytest.raises(ValueError, match="replay.adapter_forward: lean"):
        ReplayConfig(adapter_forward="peft", lora_product="split")


def test_split_bf16_products_equal_the_fp32_products_to_about_1e_5(monkeypatch):
    """mm_exact_lhs and lora_input_grad on their CUDA path (split FP32 operand, BF16 GEMM, FP32 accumulation; emulated
    on the CPU with the same operands) against FP64: the products within 2e-5 relative L2, as the FP32 products are;
    the rounded input gradient is as close to FP64 as the FP32 product rounded, and differs from it in <= 1 % of its
    elements (ties of the rounding)."""
    from engine import adapter_grad as AG

    g = torch.Generator().manual_seed(0)
    a = torch.randn(700, 300, generator=g).bfloat16()  # BF16 values, exact
    b = torch.randn(300, 16, generator=g) * 1e-3
    gh, A = torch.randn(700, 16, generator=g), torch.randn(16, 300, generator=g) * 0.05
    ref = a.double() @ b.double()
    plain = AG.mm_exact_lhs(a, b)
    gx_plain = AG.lora_input_grad(gh, A, torch.bfloat16)
    monkeypatch.setattr(AG, "_split_here", lambda dtype, device: dtype == torch.bfloat16)
    split = AG.mm_exact_lhs(a, b)
    gx_split = AG.lora_input_grad(gh, A, torch.bfloat16)

    def rel(x):
        return float((x.double() - ref).norm() / ref.norm())

    assert split.dtype == torch.float32 and rel(split) <= 2e-5 and rel(plain) <= 2e-5, (rel(split), rel(plain))
    assert gx_split.dtype == torch.bfloat16
    exact = gh.double() @ A.double()
    err_plain, err_split = (float((x.double() - exact).norm() / exact.norm()) for x in (gx_plain, gx_split))
    assert err_split <= 1.01 * err_plain + 1e-6, (err_split, err_plain)  # BF16 rounding of both: ~2^-9
    assert float((gx_plain != gx_split).float().mean()) <= 0.01


def test_split_products_are_qualified_per_device_with_one_log_line(monkeypatch, caplog):
    """The split path runs only where torch.mm's FP32-output BF16 GEMM exists and is accurate: on this CPU it does
    not exist (one log line, the FP32 products run); an emulated accurate one qualifies; one that rounds its output to
    BF16 does not."""
    import logging

    from engine import adapter_grad as AG

    real_mm = torch.mm
    monkeypatch.setattr(AG, "_MM_OUT_DTYPE", {})
    with caplog.at_level(logging.WARNING, logger="lgrpo.adapter"):
        assert not AG._bf16_mm_f32_ok("cpu")
        assert not AG._bf16_mm_f32_ok("cpu")  # checked once
    lines = [r.getMessage() for r in caplog.records if "split BF16 products" in r.getMessage()]
    assert len(lines) == 1 and "FP32 products run" in lines[0], lines

    def emulated(a, b, out_dtype=None):
        return (a.float() @ b.float()).to(out_dtype or a.dtype)

    def rounding(a, b, out_dtype=None):
        return (a.float() @ b.float()).to(torch.bfloat16).to(out_dtype or a.dtype)

    for fake, ok in ((emulated, True), (rounding, False)):
        monkeypatch.setattr(AG, "_MM_OUT_DTYPE", {})
        monkeypatch.setattr(torch, "mm", fake)
        assert AG._bf16_mm_f32_ok("cpu") is ok
        monkeypatch.setattr(torch, "mm", real_mm)


def test_replay_adapter_keeps_less_graph_than_peft():
    """What autograd keeps per replayed token, counted through saved-tensor hooks (CPU stand-in for the GPU
    allocator): the lean backward keeps no FP32 copy of a layer input or output."""
    from configs.schema import ReplayConfig
    from engine.replay import score_microbatch

    model = _model("dora", "bfloat16")
    eng, turns = _Eng(model), _turns(3)
    idx = [0, 1, 2]

    def saved_bytes(rc):
        seen = {}

        def pack(t):
            seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, "keep", rc)
        fp32 = sum(v for (p, dt), v in seen.items() if dt == torch.float32)
        return sum(seen.values()), fp32

    peft_all, peft_fp32 = saved_bytes(ReplayConfig(adapter_forward="peft"))
    lean_all, lean_fp32 = saved_bytes(ReplayConfig(adapter_forward="lean"))
    from engine.adapter_grad import adapter_layers

    # PEFT keeps, per adapted layer, an FP32 copy of its input (tokens x in_features x 4 bytes); the lean path none
    n_tok = len(idx) * max(turns.lengths()[i] for i in idx)
    fp32_inputs = sum(n_tok * m.get_base_layer().in_features * 4 for m in adapter_layers(model).values())
    print(f"saved: peft {peft_all} B ({peft_fp32} fp32), lean {lean_all} B ({lean_fp32} fp32); "
          f"FP32 layer-input copies {fp32_inputs} B")
    assert peft_fp32 - lean_fp32 >= 0.9 * fp32_inputs
    assert lean_all < peft_all - 0.9 * fp32_inputs


# ----------------------------------------------------------------------------------------------------------------
# chunked log-probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_full_log_softmax_values_and_gradients(dtype):
    from engine.logprobs import selected_logprobs

    g = torch.Generator().manual_seed(0)
    V, d, N, T = 1000, 32, 7, 1.3
    W = (torch.randn(V, d, generator=g) * 0.3).to(dtype)
    h0 = (torch.randn(N, d, generator=g)).to(dtype)
    tgt = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g)
    h1 = h0.clone().requires_grad_(True)
    ref = torch.log_softmax((h1 @ W.t()).float() / T, -1).gather(1, tgt[:, None])[:, 0]
    (ref * w).sum().backward()
    for chunk in (1000, 256, 300):  # one chunk, even chunks, a ragged last chunk
        h2 = h0.clone().requires_grad_(True)
        got = selected_logprobs(h2, W, tgt, T, chunk)
        (got * w).sum().backward()
        assert float((got - ref).abs().max()) < 1e-5
        rel = float((h2.grad.float() - h1.grad.float()).norm() / h1.grad.float().norm())
        assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel
    with pytest.raises(ValueError, match="frozen"):
        selected_logprobs(h0, W.clone().requires_grad_(True), tgt, T)


# ----------------------------------------------------------------------------------------------------------------
# packing, tiers, preflight


def test_pack_keeps_turns_whole_fills_by_tokens_and_is_deterministic():
    from engine.replay import pack, padded_tokens

    lengths = [900, 120, 130, 880, 4000, 125, 60, 61, 62]
    mbs = pack(lengths, 1024)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))  # every turn exactly once
    assert [4] in mbs  # longer than the budget: alone, never split
    assert all(padded_tokens(lengths, mb) <= 1024 for mb in mbs if mb != [4])
    assert any(len(mb) >= 4 for mb in mbs)  # short turns share a micro-batch
    assert mbs == pack(list(lengths), 1024)


def test_tiers_by_cumulative_tokens_without_a_budget():
    from configs.schema import ReplayConfig
    from engine.replay import plan_replay

    lengths = [100] * 6
    rc = ReplayConfig(microbatch_tokens=200, keep_graph_tokens=200, checkpoint_tokens=400)
    plan = plan_replay(lengths, rc)
    assert plan.tiers == ["keep", "checkpoint", "two_pass"] and plan.tokens == [200, 200, 200]
    assert plan_replay(lengths, ReplayConfig(microbatch_tokens=200)).tiers == ["keep"] * 3  # the CPU default


def test_preflight_picks_tiers_to_fit_and_refuses_what_cannot_fit_naming_the_setting():
    from configs.schema import ReplayConfig
    from engine.replay import ReplayMemoryError, TokenCosts, plan_replay

    MB = 2**20
    costs = TokenCosts(keep=10 * MB, checkpoint=1 * MB, transient=2 * MB, source="config")
    lengths = [1000] * 20  # 20k tokens: 200 GB kept whole, 20 GB checkpointed
    plan = plan_replay(lengths, ReplayConfig(microbatch_tokens=2000), costs, base_bytes=10 * 2**30,
                       budget_bytes=40 * 2**30)
    assert plan.tiers[0] == "keep" and "checkpoint" in plan.tiers
    assert plan.est_peak_bytes <= plan.budget_bytes
    # tiers come in order: keep, then checkpoint, then two-pass
    order = {"keep": 0, "checkpoint": 1, "two_pass": 2}
    assert [order[t] for t in plan.tiers] == sorted(order[t] for t in plan.tiers)
    # a tight budget pushes the rest to two-pass instead of failing
    tight = plan_replay(lengths, ReplayConfig(microbatch_tokens=2000), costs, 10 * 2**30, 16 * 2**30)
    assert tight.tiers[-1] == "two_pass" and tight.est_peak_bytes <= 16 * 2**30
    # the estimate: resident + kept graphs + the largest micro-batch in flight, plus a re-forward's checkpointed graph
    # only when the plan has two-pass micro-batches
    per = {"keep": costs.keep, "checkpoint": costs.checkpoint, "two_pass": 0.0}
    ckpt_only = plan_replay(lengths, ReplayConfig(microbatch_tokens=2000, keep_graph_tokens=0), costs, 10 * 2**30,
                            40 * 2**30)
    for p in (plan, tight, ckpt_only):
        two = costs.checkpoint if "two_pass" in p.tiers else 0.0
        want = 10 * 2**30 + sum(per[t] * n for t, n in zip(p.tiers, p.tokens)) + (costs.transient + two) * 2000
        assert p.est_peak_bytes == pytest.approx(want)
    assert set(ckpt_only.tiers) == {"checkpoint"} and "two_pass" in tight.tiers
    # a forced keep tier that cannot fit: refused before replay, naming the setting
    with pytest.raises(ReplayMemoryError, match="replay.keep_graph_tokens"):
        plan_replay(lengths, ReplayConfig(microbatch_tokens=2000, keep_graph_tokens=20000), costs, 10 * 2**30,
                    40 * 2**30)
    # micro-batches too large to be in flight
    with pytest.raises(ReplayMemoryError, match="replay.microbatch_tokens"):
        plan_replay(lengths, ReplayConfig(microbatch_tokens=20000), costs, 10 * 2**30, 40 * 2**30)
    # a single turn that cannot be in flight: names the episode length and the budget
    with pytest.raises(ReplayMemoryError, match="gym.token_budget"):
        plan_replay([20000], ReplayConfig(), costs, 10 * 2**30, 40 * 2**30)


def test_replay_config_rejects_inverted_tiers():
    from configs.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="checkpoint_tokens"):
        load_config("tiny", {"replay.keep_graph_tokens": 100, "replay.checkpoint_tokens": 50})


# ----------------------------------------------------------------------------------------------------------------
# every tier's gradients vs the kept-graph path and the FP32 reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tier_gives_the_kept_graph_gradients(dtype):
    """keep / checkpoint / two-pass through stages.optimize.accumulate_gradients (the production backward): the
    checkpoint and two-pass tiers equal the kept-graph gradients bit for bit (the forward is the same ops; backward
    recomputes them), and in FP32 all are within the equivalence gate of a full-batch reference through PEFT's own
    forward and full log-softmax."""
    from configs.schema import ReplayConfig
    from engine.replay import score_microbatch
    from stages.gradcheck import REL_L2_MAX, compare

    turns = _turns(6)
    lengths = turns.lengths()
    weights_a = [torch.linspace(-1, 1, len(a)) for a in turns.answers]
    weights_q = [torch.full((3,), 0.01 * (i + 1)) for i in range(len(turns.rows))]

    def run(rc, model):
        return tiered_gradients(model, turns, rc, weights_q, weights_a)

    model = _model("dora", dtype)
    base = dict(microbatch_tokens=2 * max(lengths))
    g_keep, p_keep = run(ReplayConfig(**base), model)
    g_ckpt, p_ckpt = run(ReplayConfig(**base, keep_graph_tokens=0), model)
    g_two, p_two = run(ReplayConfig(**base, keep_graph_tokens=0, checkpoint_tokens=0), model)
    g_mix, p_mix = run(ReplayConfig(**base, keep_graph_tokens=p_keep.tokens[0],
                                    checkpoint_tokens=sum(p_keep.tokens[:2])), model)
    assert set(p_keep.tiers) == {"keep"} and set(p_ckpt.tiers) == {"checkpoint"} and set(p_two.tiers) == {"two_pass"}
    assert {"keep", "checkpoint", "two_pass"} <= set(p_mix.tiers)
    for g in (g_ckpt, g_two, g_mix):
        assert all(torch.equal(g[k], g_keep[k]) for k in g_keep)

    if dtype != "float32":
        return  # BF16 against FP32: tests/test_precision.py (the gate is about precision, the tiers are bitwise)
    # the FP32 reference: the same weights in FP32, PEFT's forward, every turn in one batch, direct autograd
    ref_model = _model("dora", "float32")
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    _zero(ref_model)
    idx = list(range(len(turns.rows)))
    with torch.enable_grad():
        a, q = score_microbatch(_Eng(ref_model), turns, idx, 1.0, 0.05)
        sum((weights_a[n] * a[n]).sum() + (weights_q[n] * q[n]).sum() for n in idx).backward()
    ref = _grads(ref_model)
    for g in (g_keep, g_ckpt, g_two):
        got = compare(g, ref)
        assert got["passed"] and got["rel_l2"] <= REL_L2_MAX, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adapter_type", ["lora", "dora"])
def test_checkpoint_keeping_matmuls_skips_their_recompute_with_the_same_gradients(dtype, adapter_type):
    """replay.checkpoint_keeps: matmuls keeps the wide matrix products' outputs: backward runs none of the
    forward's wide products again (counted at the dispatcher), the LoRA terms' narrow ones still are, and the
    gradients equal the plain checkpoint tier's (and the kept graph's) bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from configs.schema import ReplayConfig
    from engine.replay import LOW_RANK, score_microbatch

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.wide = self.narrow = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name in ("aten::mm", "aten::addmm", "aten::bmm"):
                a = args[1] if name == "aten::addmm" else args[0]
                if a.shape[-1] > LOW_RANK:
                    self.wide += 1
                else:
                    self.narrow += 1
            return func(*args, **(kwargs or {}))

    turns = _turns(3)
    model = _model(adapter_type, dtype)
    eng = _Eng(model)
    idx = [0, 1, 2]
    out = {}
    for label, tier, keeps in (("keep", "keep", "inputs"), ("inputs", "checkpoint", "inputs"),
                               ("matmuls", "checkpoint", "matmuls")):
        rc = ReplayConfig(checkpoint_keeps=keeps)
        _zero(model)
        fwd, bwd = Products(), Products()
        with torch.enable_grad(), fwd:
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)
        with bwd:
            _objective(a, q, idx).backward()
        out[label] = (_grads(model), fwd, bwd)
    g_keep, f_keep, b_keep = out["keep"]
    assert f_keep.wide > 0 and f_keep.narrow > 0
    for label in ("inputs", "matmuls"):
        g = out[label][0]
        assert all(torch.equal(g[k], g_keep[k]) for k in g_keep), label
    b_in, b_mm = out["inputs"][2], out["matmuls"][2]
    assert b_in.wide > b_keep.wide and b_mm.wide == b_keep.wide  # matmuls: no wide product recomputed
    assert b_mm.narrow > b_keep.narrow  # the LoRA terms' products are recomputed


def test_two_pass_rerun_detects_a_changed_forward():
    """The second pass must equal the first bit for bit; a changed weight between the passes fails the
    replay-determinism gate instead of silently back-propagating another function."""
    from configs.schema import ReplayConfig
    from engine import gates
    from engine.replay import plan_replay, score_microbatch
    from stages.optimize import accumulate_gradients

    turns = _turns(3)
    model = _model("lora")
    eng = _Eng(model)
    rc = ReplayConfig(keep_graph_tokens=0, checkpoint_tokens=0)
    plan = plan_replay(turns.lengths(), rc)
    lp_turn = [None] * 3
    with torch.no_grad():
        for idx in plan.microbatches:
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, "two_pass", rc)
            for n, i in enumerate(idx):
                lp_turn[i] = torch.cat([q[n].float(), a[n].float()])

    class Cfg:
        sampler = type("S", (), {"temperature": 1.0})()
        replay = rc

    class LI:
        pass

    li = LI()
    li.turns, li.sigma, li.lp_turn = turns, 0.05, lp_turn
    wq = [torch.ones(3)] * 3
    wa = [torch.ones(len(a)) for a in turns.answers]
    _zero(model)
    accumulate_gradients(Cfg, eng, li, wq, wa, live=[None] * len(plan.microbatches),
                         plan=(plan.microbatches, plan.tiers))
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).add_(1e-3)
    with pytest.raises(gates.GateFailed, match="replay-determinism"):
        accumulate_gradients(Cfg, eng, li, wq, wa, live=None, plan=(plan.microbatches, plan.tiers))


def test_a_layer_scope_installs_the_lean_forward_on_that_layer_only():
    """ReplayAdapter.scope(layer) (a checkpointed layer's recompute): only that decoder layer's adapted modules get
    the lean forward, none are left after it, a full entry makes it a no-op, and a changed adapter weight recomputes
    the DoRA norms. The per-recompute CPU cost falls accordingly (printed, not asserted)."""
    import time

    from engine.replay import replay_adapter

    model = _model("dora")
    eng = _Eng(model)
    ra = replay_adapter(eng)
    layers = list(M._parts(model)[0].layers)
    inside = {id(m) for m in layers[1].modules()}
    mods = [m for m, _ in ra.layers.values()]
    with ra.scope(layers[1]):
        got = {id(m) for m in mods if "forward" in m.__dict__}
    assert got and got == {id(m) for m in mods if id(m) in inside}
    assert not any("forward" in m.__dict__ for m in mods)
    with ra:
        with ra.scope(layers[1]):
            assert all("forward" in m.__dict__ for m in mods)
        assert all("forward" in m.__dict__ for m in mods)
    name = next(n for n, (m, _) in ra.layers.items() if id(m) in inside and n in ra.norms)
    before = ra.norms[name].clone()
    mod, a = ra.layers[name]
    with torch.no_grad():
        mod.lora_B[a].weight.add_(0.5)
    with ra.scope(layers[1]):
        pass
    assert not torch.equal(ra.norms[name], before)
    t0 = time.perf_counter()
    for _ in range(20):
        with ra:
            pass
    t1 = time.perf_counter()
    for _ in range(20):
        with ra.scope(layers[1]):
            pass
    print(f"enter/exit: whole adapter {1e3 * (t1 - t0) / 20:.2f} ms, one layer {1e3 * (time.perf_counter() - t1) / 20:.2f} ms")


def test_a_cost_probe_that_runs_out_of_memory_ends_the_preflight_with_what_to_change():
    """measure_costs' probes are the preflight's first allocations: one that does not fit beside what is resident
    (at the 27B shape on an 80 GB card: the trainer and the hf sampler's BF16 weights) stops replay with a
    ReplayMemoryError naming the probe, the memory resident and the setting that skips the probe -- not a raw CUDA
    out-of-memory error from inside the step."""
    from engine.replay import GiB, ReplayMemoryError, probe_or_explain

    def fits(tier, tokens):
        return 1.0, 2.0, tokens

    assert probe_or_explain(fits, "keep", 512, 72 * GiB, 16 * GiB) == (1.0, 2.0, 512)

    def too_big(tier, tokens):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 170.00 MiB.\nmore lines")

    with pytest.raises(ReplayMemoryError) as err:
        probe_or_explain(too_big, "keep", 1024, 72.8 * GiB, 71.0 * GiB)
    msg = str(err.value)
    assert "1024-token probe of the keep tier" in msg and "71.0 GiB resident" in msg and "leaving 1.8 GiB" in msg
    assert "replay.token_costs_mb" in msg and "Tried to allocate 170.00 MiB" in msg and "more lines" not in msg
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_a_refused_replay_plan_names_the_samplers_copy_of_the_base_and_the_setting_that_frees_it(tmp_path):
    """When the preflight refuses and an hf sampler holds its own copy of the base (sampler.weights: export), the
    replay stage's error adds how much that copy holds and names sampler.weights=trainer (at the 27B shape on an
    80 GB GPU it is 54 GB of the memory resident); nothing is scored before the error."""
    from artifacts import read_json
    from engine import runtime
    from engine.replay import GiB, ReplayMemoryError
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from stages.gym import run_gym
    from stages.replay import replay
    from stages.rollouts import collect_rollouts
    from tests.conftest import make_run

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"gym.max_turns": 1, "replay.memory_budget_gb": 1e-4})
    cfg = run_config(run_dir)
    prep = read_json(f"{run_dir}/prepared.json")
    base, adapter = prep["base"], prep["adapter_init"]
    export = export_base(run_dir, base)["path"]
    state = sample_tasks(run_dir, 0, base)["path"]
    tr = generate_turn(run_dir, 0, 0, state, adapter, export, base)
    gr = run_gym(run_dir, 0, 0, state, tr["path"], base)
    ro = collect_rollouts(run_dir, 0, [tr["path"]], [gr["path"]])
    sampler = runtime.sampler(cfg, export, base)
    trainer = runtime.trainer(cfg, base, base)
    assert sampler is not trainer
    held = sum(t.numel() * t.element_size() for t in [*sampler.model.parameters(), *sampler.model.buffers()])
    assert runtime.other_models_bytes(trainer) == held > 0
    assert runtime.other_models_bytes(sampler) > 0  # the trainer's model, seen from the sampler
    with pytest.raises(ReplayMemoryError) as err:
        replay(run_dir, 0, ro["path"], adapter, base, True)
    msg = str(err.value)
    assert msg.startswith("replay preflight") and "exceeds the budget" in msg, msg
    assert f"{held / GiB:.1f} GiB is the hf sampler's own copy of the base" in msg
    assert "--set sampler.weights=trainer" in msg
    assert isinstance(err.value.__cause__, ReplayMemoryError)
    runtime.clear()
