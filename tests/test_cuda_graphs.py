"""Static-cache decoding (engine.cuda_graphs): the latent loop and the hf sampler, eager vs CUDA-graph replay.

CPU (CI): the eager static path agrees with the dynamic-cache paths of engine.model / engine.prefix_cache, the
frozen DoRA forward is PEFT's bit for bit, buffers are reused across calls.
GPU (`gpu` marker): graphed thoughts / tokens / log-probs equal the eager static path bit for bit (bf16, DoRA
adapter, both prefill routes, graph reused by a second call); prefix-cached vs recomputed thoughts are bitwise equal
on the GPU (turn boundaries), through latent_loop_cached and through the graphed loop.
"""

from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from engine import cuda_graphs as CG
from engine import model as M
from engine import answers as AN
from engine import latent as LT
from engine import prefix_cache as PC

torch.set_num_threads(1)

V = 64
TOKS = M.Tokens(pad=0, eos=1, think=2, answer_open=3)


def _model(dtype="float32", adapter: str | None = None, device="cpu", seed=0):
    cfg = load_config("tiny")
    model = M.build_random_model(cfg.model.arch, V, TOKS.pad, TOKS.eos, seed=seed, dtype=dtype)
    if adapter:
        acfg = cfg.adapter.model_copy(update={"type": adapter})
        torch.manual_seed(seed)
        model = M.attach_adapter(model, acfg)
        with torch.no_grad():  # a trained-like adapter: non-zero B, magnitudes off the weight norms
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
                if "magnitude" in n:
                    p.mul_(1 + 0.1 * torch.rand_like(p))
    return model.to(device).eval()


def _episodes(rows=4, turns=3, prompt=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(4, V, (n,), generator=g).tolist()  # noqa: E731
    c0 = rnd(prompt)
    per_turn = [[list(c0) for _ in range(rows)]]
    for _ in range(turns - 1):
        per_turn.append([p + rnd(int(torch.randint(3, 12, (1,), generator=g))) + rnd(6) for p in per_turn[-1]])
    return per_turn


def _prefixes(rows=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, V, (int(n),), generator=g).tolist() for n in torch.randint(9, 30, (rows,), generator=g)]


def _prompt(model, prefix, thoughts):
    """AN.prompt_embeddings on the model's device."""
    emb = M._parts(model)[2]
    dev = emb.weight.device
    head = emb(torch.tensor(prefix + [TOKS.think], device=dev))
    tail = emb(torch.tensor([TOKS.answer_open], device=dev))
    return torch.cat([head, thoughts.to(device=dev, dtype=head.dtype), tail], 0)


def _gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# CPU: the eager static path


@pytest.fixture(scope="module")
def fp32_model():
    return _model()


@pytest.mark.parametrize("attention", ["gqa", "hf"])
def test_static_latent_loop_matches_dynamic_cache(fp32_model, attention):
    model = fp32_model
    prefixes = _prefixes()
    scale = M.embed_scale(model)
    ref_z, ref_q = LT.latent_loop(model, prefixes, 5, 0.05 * scale, scale, TOKS, _gen(3))
    loop = CG.GraphedLatentLoop(model, graphed=False, attention=attention)
    z, q = loop.run(prefixes, 5, 0.05 * scale, scale, TOKS, _gen(3))
    assert z.shape == ref_z.shape and q.shape == ref_q.shape
    torch.testing.assert_close(z, ref_z, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q, ref_q, atol=1e-3, rtol=1e-5)
    # a second call reuses the buffers (reset in place) and gives the same thoughts bit for bit
    z2, q2 = loop.run(prefixes, 5, 0.05 * scale, scale, TOKS, _gen(3))
    assert torch.equal(z, z2) and torch.equal(q, q2)


def test_static_latent_rows_match_latent_loop_cached(fp32_model):
    model = fp32_model
    scale = M.embed_scale(model)
    turns = _episodes()
    bounds = [[] for _ in turns[-1]]
    ref_z, ref_q = PC.latent_loop_cached(model, turns[-1], 4, 0.05 * scale, scale, TOKS, _gen(5), None, bounds)
    rs = PC.prefill_rows(model, turns[-1], None, bounds)
    z, q = CG.GraphedLatentLoop(model, graphed=False).run_rows(rs, 4, 0.05 * scale, scale, TOKS, _gen(5))
    torch.testing.assert_close(z, ref_z, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q, ref_q, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("attention", ["gqa", "hf"])
def test_static_decoder_matches_sample_answers(fp32_model, attention):
    model = fp32_model
    scale = M.embed_scale(model)
    prefixes = _prefixes(3, seed=1)
    z, _ = LT.latent_loop(model, prefixes, 3, 0.05 * scale, scale, TOKS, _gen(1))
    prompts = [AN.prompt_embeddings(model, p, z[i], TOKS) for i, p in enumerate(prefixes)]
    limits = [9, 3, 12]
    ref_ids, ref_lps = AN.sample_answers(model, prompts, 10, 1.0, TOKS, _gen(2), limits=limits)
    dec = CG.GraphedDecoder(model, graphed=False, attention=attention)
    ids, lps = dec.sample(prompts, 10, 1.0, TOKS, _gen(2), limits=limits)
    assert ids == ref_ids
    assert [len(a) for a in ids] == [len(a) for a in ref_lps]
    for a, b in zip(lps, ref_lps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-5)
    # through the prefix-cache route: prefill_rows, then <think> ⊕ z ⊕ </think> as one chunk
    rs = PC.prefill_rows(model, prefixes, None)
    ref_ids2, ref_lps2 = PC.sample_answers_cached(model, prefixes, z, 10, 1.0, TOKS, _gen(2), None, limits=limits)
    ids2, lps2 = dec.sample_rows(rs, z, 10, 1.0, TOKS, _gen(2), limits=limits)
    assert ids2 == ref_ids2
    for a, b in zip(lps2, ref_lps2):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("adapter", ["dora", "lora"])
def test_frozen_adapter_is_pefts_forward_bit_for_bit(adapter):
    model = _model(adapter=adapter)
    x = torch.randint(4, V, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=x).logits
        frozen = CG.FrozenAdapter(model)
        assert len(frozen.layers) > 0 and (len(frozen.ms) > 0) == (adapter == "dora")
        with frozen:
            got = model(input_ids=x).logits
        assert torch.equal(got, ref)
        after = model(input_ids=x).logits  # removed again: PEFT's own forward
        assert torch.equal(after, ref)
        # an in-place adapter update is picked up by sync() (values, same addresses)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(1.5)
        ref2 = model(input_ids=x).logits
        assert frozen.sync() == "values"
        with frozen:
            assert torch.equal(model(input_ids=x).logits, ref2)
        assert frozen.sync() == "same"


def test_prefill_under_the_frozen_adapter_is_pefts_bit_for_bit_without_recomputing_dora_norms(monkeypatch):
    """engine.runtime prefills the rows of a graphed turn inside `adapter_frozen()`: the per-row states equal PEFT's
    own forward bit for bit, and no DoRA weight norm is computed per prefilled row or chunk (PEFT computes one per
    adapted layer on every forward: at 27B with an NF4 base that dequantizes the whole model once per row)."""
    from peft.tuners.lora.dora import DoraLinearLayer

    model = _model(adapter="dora")
    calls = {"n": 0}
    norm = DoraLinearLayer.get_weight_norm

    def counted(self, *a, **k):
        calls["n"] += 1
        return norm(self, *a, **k)

    monkeypatch.setattr(DoraLinearLayer, "get_weight_norm", counted)
    turns = _episodes(rows=3, turns=3)
    bounds = [[len(turns[0][i]), len(turns[1][i])] for i in range(3)]
    loop = CG.GraphedLatentLoop(model, graphed=False)
    layers = len(loop.frozen.ms)
    for update in (False, True):
        if update:  # an adapter update in place (an optimizer step): the next block re-syncs the scale once
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.mul_(1.5)
        calls["n"] = 0
        ref = PC.prefill_rows(model, turns[-1], None, bounds)
        peft_calls = calls["n"]
        calls["n"] = 0
        with loop.adapter_frozen():
            got = PC.prefill_rows(model, turns[-1], None, bounds)
        assert peft_calls == layers * 3 * 3  # PEFT: every layer, every row, every chunk (3 turns)
        assert calls["n"] == (layers if update else 0)  # frozen: synced when the adapter changed, else none
        for a, b in zip(got.rows, ref.rows):
            assert a.length == b.length and torch.equal(a.last_hidden, b.last_hidden)
            assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(a.layers, b.layers))
    assert "forward" not in next(iter(loop.frozen.layers.values()))[0].__dict__  # PEFT's forward is back


def test_static_path_with_dora_adapter_matches_peft_dynamic():
    model = _model(adapter="dora")
    scale = M.embed_scale(model)
    prefixes = _prefixes(2, seed=4)
    ref_z, _ = LT.latent_loop(model, prefixes, 3, 0.05 * scale, scale, TOKS, _gen(9))
    z, _ = CG.GraphedLatentLoop(model, graphed=False).run(prefixes, 3, 0.05 * scale, scale, TOKS, _gen(9))
    torch.testing.assert_close(z, ref_z, atol=1e-4, rtol=1e-4)


def test_graphed_needs_cuda(fp32_model):
    with pytest.raises(ValueError, match="CUDA"):
        CG.GraphedLatentLoop(fp32_model, graphed=True)


# ----------------------------------------------------------------------------------------------------------------
# GPU: graphed vs eager static, bit for bit


@pytest.fixture(scope="module")
def gpu_model():
    return _model(dtype="bfloat16", adapter="dora", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["gqa", "hf"])
def test_graphed_latent_loop_bitwise_equals_eager_static(gpu_model, attention):
    model = gpu_model
    scale = M.embed_scale(model)
    prefixes = _prefixes(4, seed=7)
    K = 6
    eager = CG.GraphedLatentLoop(model, graphed=False, attention=attention)
    graphed = CG.GraphedLatentLoop(model, graphed=True, attention=attention)
    for gen_dev in ("cpu", "cuda"):
        ze, qe = eager.run(prefixes, K, 0.05 * scale, scale, TOKS, _gen(11, gen_dev))
        zg, qg = graphed.run(prefixes, K, 0.05 * scale, scale, TOKS, _gen(11, gen_dev))
        assert graphed.graph is not None  # captured (first call) or replayed (second call)
        assert torch.equal(ze, zg) and torch.equal(qe, qg)
        assert torch.isfinite(zg).all()
    # the prefix-cache route: rows restored from prefill_rows, <think> as the first decode step
    turns = _episodes(rows=4, turns=3)
    bounds = [[len(turns[0][i]), len(turns[1][i])] for i in range(4)]
    rs = PC.prefill_rows(model, turns[-1], None, bounds)
    ze, qe = eager.run_rows(rs, K, 0.05 * scale, scale, TOKS, _gen(12))
    zg, qg = graphed.run_rows(rs, K, 0.05 * scale, scale, TOKS, _gen(12))
    assert torch.equal(ze, zg) and torch.equal(qe, qg)
    zg2, qg2 = graphed.run_rows(rs, K, 0.05 * scale, scale, TOKS, _gen(12))  # replay of the kept graph
    assert torch.equal(zg2, zg) and torch.equal(qg2, qg)
    # close to the dynamic-cache reference (not bitwise: attention over a masked static length); compared on the
    # first thought -- later ones feed back through a random bf16 model and drift apart chaotically
    zr, _ = PC.latent_loop_cached(model, turns[-1], K, 0.05 * scale, scale, TOKS, _gen(12), None, bounds)
    gap = (zr[:, 0].float() - zg[:, 0].float()).abs()
    print(f"{attention}: first thought vs dynamic cache: mean |dz| {gap.mean() / scale:.2e}, max {gap.max() / scale:.2e}"
          f" (x embedding RMS); all thoughts mean {(zr - zg).abs().mean() / scale:.2e}")
    assert gap.mean() < 0.02 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["gqa", "hf"])
def test_graphed_decoder_bitwise_equals_eager_static(gpu_model, attention):
    model = gpu_model
    scale = M.embed_scale(model)
    prefixes = _prefixes(4, seed=8)
    z, _ = CG.GraphedLatentLoop(model, graphed=False).run(prefixes, 4, 0.05 * scale, scale, TOKS, _gen(1))
    prompts = [_prompt(model, p, z[i]) for i, p in enumerate(prefixes)]
    limits = [20, 5, 20, 13]
    eager = CG.GraphedDecoder(model, graphed=False, attention=attention)
    graphed = CG.GraphedDecoder(model, graphed=True, attention=attention)
    for gen_dev in ("cuda", "cpu"):
        ie, le = eager.sample(prompts, 20, 1.0, TOKS, _gen(21, gen_dev), limits=limits)
        ig, lg = graphed.sample(prompts, 20, 1.0, TOKS, _gen(21, gen_dev), limits=limits)
        assert ie == ig and le == lg
        assert [len(a) for a in ig] == [20, 5, 20, 13] or any(a and a[-1] == TOKS.eos for a in ig)
    rs = PC.prefill_rows(model, prefixes, None)
    ie, le = eager.sample_rows(rs, z, 16, 0.9, TOKS, _gen(22, "cuda"))
    ig, lg = graphed.sample_rows(rs, z, 16, 0.9, TOKS, _gen(22, "cuda"))
    assert ie == ig and le == lg
    ig2, lg2 = graphed.sample_rows(rs, z, 16, 0.9, TOKS, _gen(22, "cuda"))  # kept graph
    assert ig2 == ig and lg2 == lg


@pytest.mark.gpu
def test_prefix_cached_vs_recomputed_bitwise_on_gpu(gpu_model):
    model = gpu_model
    scale = M.embed_scale(model)
    turns = _episodes(rows=4, turns=4, prompt=48, seed=3)
    cache = PC.PrefixCache(1 << 30)
    loop = CG.GraphedLatentLoop(model, graphed=True)
    for t, prefixes in enumerate(turns):
        bounds = [[len(turns[s][i]) for s in range(t)] for i in range(len(prefixes))]
        warm = PC.latent_loop_cached(model, prefixes, 4, 0.05 * scale, scale, TOKS, _gen(t), cache, bounds)
        cold = PC.latent_loop_cached(model, prefixes, 4, 0.05 * scale, scale, TOKS, _gen(t), None, bounds)
        assert torch.equal(warm[0], cold[0]) and torch.equal(warm[1], cold[1]), f"turn {t}"
        rs_warm = PC.prefill_rows(model, prefixes, cache, bounds)
        rs_cold = PC.prefill_rows(model, prefixes, None, bounds)
        for a, b in zip(rs_warm.rows, rs_cold.rows):
            assert torch.equal(a.last_hidden, b.last_hidden)
            assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(a.layers, b.layers))
        gw = loop.run_rows(rs_warm, 4, 0.05 * scale, scale, TOKS, _gen(t))
        gc = loop.run_rows(rs_cold, 4, 0.05 * scale, scale, TOKS, _gen(t))
        assert torch.equal(gw[0], gc[0]) and torch.equal(gw[1], gc[1])
    c = cache.counters()
    assert c["computed_tokens"] < c["input_tokens"]


def test_static_cache_capacity_is_rounded_so_a_growing_prefix_keeps_its_cache(fp32_model):
    """Turn after turn the prefix grows; within one capacity step the static cache (and, on CUDA, its captured
    graph) is kept -- reset in place -- instead of rebuilt for every new length. Results stay those of the
    dynamic-cache loop."""
    model = fp32_model
    scale = M.embed_scale(model)
    loop = CG.GraphedLatentLoop(model, graphed=False, capacity_step=64)
    short = _prefixes()
    longer = [p + p[:5] for p in short]
    loop.run(short, 3, 0.05 * scale, scale, TOKS, _gen(1))
    cache, cap = loop.cache, loop.cache.max_len
    assert cap % 64 == 0 and cap >= max(len(p) for p in short) + 3
    z, q = loop.run(longer, 3, 0.05 * scale, scale, TOKS, _gen(2))
    assert loop.cache is cache and loop.cache.max_len == cap  # same buffers: no new cache, no new capture
    ref_z, ref_q = LT.latent_loop(model, longer, 3, 0.05 * scale, scale, TOKS, _gen(2))
    torch.testing.assert_close(z, ref_z, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q, ref_q, atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match="capacity_step"):
        CG.GraphedLatentLoop(model, graphed=False, capacity_step=0)


@pytest.mark.slow
@pytest.mark.parametrize("adapter_type,dtype,cached", [("lora", "float32", True), ("lora", "float32", False),
                                                        ("dora", "float32", True), ("dora", "bfloat16", False)])
def test_eager_engine_paths_give_peft_bits_through_the_frozen_adapter(tmp_path, adapter_type, dtype, cached):
    """Engine.thoughts and Engine.answers on the CPU (not graphed) run under FrozenAdapter's forwards: thoughts,
    their log-densities, answer tokens and answer log-probs are bit for bit those of PEFT's own forward, for an
    adapter that changes the outputs (non-zero LoRA B), and the PEFT forwards are back afterwards."""
    import contextlib

    from artifacts import read_json
    from engine import runtime
    from engine.adapter_grad import adapter_layers
    from stages.context import run_config
    from tests.conftest import make_run
    from tests.test_gates import trained_like_adapter

    runtime.clear()
    run_dir = make_run(tmp_path / "run", **{"adapter.type": adapter_type, "model.dtype": dtype})
    cfg = run_config(run_dir)
    base = read_json(f"{run_dir}/prepared.json")["base"]
    eng = runtime.build(cfg, base, base, adapter_dir=trained_like_adapter(run_dir, tmp_path / "adapter"))
    assert not eng.graphs
    cache = runtime._new_prefix_cache(cfg) if cached else None  # cleared before each run: both prefill
    prefixes = [[5, 6, 7, 8, 9], [5, 6, 7], [10, 11, 12, 13]]

    def run(frozen: bool):
        if not frozen:
            eng.frozen_adapter = lambda: contextlib.nullcontext()  # PEFT's forward
        if cache is not None:
            cache.clear()
        eng.prefix_cache = cache  # the cache answers() prefills through (answer_cache: the engine's own)
        try:
            z, logq = eng.thoughts(prefixes, None, 3, cfg.latent.sigma * eng.scale, [1, 2, 3], cache)
            ids, lps = eng.answers(prefixes, None, z, 8, cfg.sampler.temperature, [4, 5, 6], [8, 8, 8], eng)
        finally:
            eng.__dict__.pop("frozen_adapter", None)
        return z, logq, ids, lps

    peft, frozen = run(False), run(True)
    assert torch.equal(peft[0], frozen[0]) and torch.equal(peft[1], frozen[1])
    assert peft[2] == frozen[2] and peft[3] == frozen[3]
    assert eng._frozen and eng._frozen.layers  # the frozen path really ran on the adapter layers
    assert all("forward" not in m.__dict__ for m in adapter_layers(eng.model).values())
