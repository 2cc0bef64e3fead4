"""NF4 base (engine.nf4): bitsandbytes Linear4bit trainer with FP32 DoRA masters, BF16 export for the sampler.

CPU (CI): the export of a plain BF16 base round-trips through safetensors / from_pretrained bit for bit.
GPU (`gpu` marker, bitsandbytes needed): the export equals the trainer's dequantized weights bit for bit (in memory
and on disk, reloaded by from_pretrained); PEFT's DoRA scale on the NF4 trainer equals the one on the BF16 sampler;
the NF4 trainer's latent loop is bitwise equal graphed vs eager.
"""

from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from engine import model as M
from engine import nf4

torch.set_num_threads(1)

V = 64
TOKS = M.Tokens(pad=0, eos=1, think=2, answer_open=3)


def _bf16_base(device="cpu", seed=0):
    cfg = load_config("tiny")
    return M.build_random_model(cfg.model.arch, V, TOKS.pad, TOKS.eos, seed=seed, dtype="bfloat16").to(device)


def _dora(model, seed=0):
    acfg = load_config("tiny").adapter.model_copy(update={"type": "dora"})
    torch.manual_seed(seed)
    model = M.attach_adapter(model, acfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.eval()


def test_bf16_export_roundtrip(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    base = _bf16_base()
    model = _dora(base)
    info = nf4.write_bf16_export(model, tmp_path, shard_bytes=300_000)
    assert len(info["files"]) > 1
    rep = nf4.verify_export(model, tmp_path)
    assert rep["equal"], rep
    back = Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    own = nf4.dequantized_bf16_state(model)
    for k, v in back.state_dict().items():
        if k in own:
            assert torch.equal(v, own[k]), k


@pytest.fixture(scope="module")
def nf4_pair():
    """(NF4 trainer with DoRA, BF16 sampler built from the export with the same adapter, export state)."""
    pytest.importorskip("bitsandbytes")

    base = _bf16_base("cuda")
    n = nf4.quantize_nf4_(base)
    assert n == 4 * 3 + 3 * 5 + 4 + 3 * 0  # 4 MLPs x3, 3 GDN x5, 1 attention x4
    trainer = _dora(base)
    state = nf4.dequantized_bf16_state(trainer)
    sampler_base = _bf16_base("cuda", seed=1)  # different init: every value must come from the export
    nf4.load_state_into(sampler_base, state)
    sampler = _dora(sampler_base, seed=5)
    M.load_adapter_state(sampler, M.adapter_state(trainer))
    return trainer, sampler.eval(), state


@pytest.mark.gpu
def test_nf4_export_equals_trainer_dequantized_weights(nf4_pair, tmp_path):
    import bitsandbytes as bnb
    from transformers import Qwen3_5ForCausalLM

    trainer, sampler, state = nf4_pair
    quantized = [m for m in trainer.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 31
    rep = nf4.verify_export(trainer, state)
    assert rep["equal"] and rep["quantized"] == 31, rep
    # the sampler's weights are the export's values; on disk and back as well
    assert nf4.verify_export(trainer, nf4.dequantized_bf16_state(sampler))["equal"]
    nf4.write_bf16_export(trainer, tmp_path)
    assert nf4.verify_export(trainer, tmp_path)["equal"]
    back = Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert nf4.verify_export(trainer, {k: v for k, v in back.state_dict().items() if k in state})["equal"]
    # a corrupted export is caught
    bad = dict(state)
    k = next(k for k in bad if k.endswith("mlp.up_proj.weight"))
    bad[k] = bad[k].clone()
    bad[k].view(-1)[0] += 1
    assert not nf4.verify_export(trainer, bad)["equal"]
    # PEFT's DoRA uses the same dequantized values: the frozen DoRA scales agree bit for bit
    from engine.cuda_graphs import FrozenAdapter

    ft, fs = FrozenAdapter(trainer), FrozenAdapter(sampler)
    assert set(ft.ms) == set(fs.ms) and len(ft.ms) == 25  # in_proj_b/in_proj_a are quantized, not adapted
    for name in ft.ms:
        assert torch.equal(ft.ms[name], fs.ms[name]), name
    # the forwards differ (bitsandbytes' NF4 matmul vs a BF16 GEMM on the same values): recorded, bounded by the
    # rollout-parity gate's max (1 nat); per layer, the relative output gap of Linear4bit vs F.linear(x, dequantized)
    x = torch.randint(4, V, (2, 9), device="cuda")
    with torch.no_grad():
        lt = torch.log_softmax(trainer(input_ids=x).logits.float(), -1)
        ls = torch.log_softmax(sampler(input_ids=x).logits.float(), -1)
        gaps = {}
        for m_rows in (1, 4, 18, 2048):
            worst = 0.0
            for mod in quantized:
                xin = torch.randn(m_rows, mod.in_features, device="cuda", dtype=torch.bfloat16)
                a = mod(xin).float()
                b = torch.nn.functional.linear(xin, nf4._dequantize(mod)).float()
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
            gaps[m_rows] = worst
    d = (lt - ls).abs()
    print(f"NF4 trainer vs BF16 export forward: max |dlogp| {d.max():.3e}, mean {d.mean():.3e}; "
          f"Linear4bit vs linear(x, dequantized) worst relative gap by rows: {gaps}")
    assert d.max() < 1.0


@pytest.mark.gpu
def test_frozen_adapter_on_nf4_is_pefts_forward(nf4_pair):
    from engine.cuda_graphs import FrozenAdapter

    trainer, _, _ = nf4_pair
    x = torch.randint(4, V, (3, 5), device="cuda")
    with torch.no_grad():
        ref = trainer(input_ids=x).logits
        with FrozenAdapter(trainer):
            got = trainer(input_ids=x).logits
    assert torch.equal(ref, got)


@pytest.mark.gpu
def test_nf4_latent_loop_graphed_bitwise_eager(nf4_pair):
    from engine.cuda_graphs import GraphedLatentLoop

    trainer, _, _ = nf4_pair
    scale = M.embed_scale(trainer)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(4, V, (int(n),), generator=g).tolist() for n in (12, 20, 7, 16)]
    eager = GraphedLatentLoop(trainer, graphed=False)
    graphed = GraphedLatentLoop(trainer, graphed=True)
    for _ in range(2):  # capture, then replay of the kept graph
        ze, qe = eager.run(prefixes, 5, 0.05 * scale, scale, TOKS, torch.Generator("cuda").manual_seed(4))
        zg, qg = graphed.run(prefixes, 5, 0.05 * scale, scale, TOKS, torch.Generator("cuda").manual_seed(4))
        assert torch.equal(ze, zg) and torch.equal(qe, qg)
        assert torch.isfinite(zg).all()


def _adapter_grads(model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the teacher-forced log-likelihood of x under `model` w.r.t. its adapter (FP32 masters)."""
    model.zero_grad(set_to_none=True)
    lp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1).gather(2, x[:, 1:, None])
    lp.sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("init", ["peft-init", "random-B"])
def test_nf4_dora_gradients_match_bf16_dora_on_the_same_values(init):
    """The NF4 trainer's adapter gradients equal, up to the forward's kernel rounding, those of a BF16 model holding
    the same (dequantized) values and the same adapter: every trainable tensor gets its gradient through
    bitsandbytes' Linear4bit (PEFT's DoRA on bnb layers), at PEFT's init (B = 0) and with a trained-like B."""
    pytest.importorskip("bitsandbytes")
    base = _bf16_base("cuda")
    nf4.quantize_nf4_(base)
    if init == "random-B":
        trainer = _dora(base)
    else:
        torch.manual_seed(0)
        trainer = M.attach_adapter(base, load_config("tiny").adapter.model_copy(update={"type": "dora"})).eval()
    ref_base = _bf16_base("cuda", seed=1)
    nf4.load_state_into(ref_base, nf4.dequantized_bf16_state(trainer))
    torch.manual_seed(5)
    ref = M.attach_adapter(ref_base, load_config("tiny").adapter.model_copy(update={"type": "dora"})).eval()
    M.load_adapter_state(ref, M.adapter_state(trainer))
    x = torch.randint(4, V, (3, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    g_nf4, g_ref = _adapter_grads(trainer, x), _adapter_grads(ref, x)
    # 25 DoRA modules x (A, B, magnitude), and the final norm where the tiny preset trains it (adapter.train_final_norm)
    assert set(g_nf4) == set(g_ref) and len(g_ref) == 3 * 25 + load_config("tiny").adapter.train_final_norm
    num = sum(float((g_nf4[k] - g_ref[k]).pow(2).sum()) for k in g_ref)
    den = sum(float(g_ref[k].pow(2).sum()) for k in g_ref)
    norms = {part: (sum(float(g_nf4[k].pow(2).sum()) for k in g_ref if part in k) ** 0.5,
                    sum(float(g_ref[k].pow(2).sum()) for k in g_ref if part in k) ** 0.5)
             for part in ("lora_A", "lora_B", "magnitude")}
    print(f"\nNF4 vs BF16 DoRA gradients ({init}): relative L2 {(num / den) ** 0.5:.3e}; norms (nf4, bf16) {norms}")
    for part, (a, b) in norms.items():
        if b > 0:
            assert 0.5 < a / b < 2.0, (part, a, b)
    assert (num / den) ** 0.5 < 0.2


def test_random_base_built_layer_by_layer_has_the_whole_build_values():
    """A random base built with after_layer (each decoder layer handed over as soon as it is complete, the next one
    not yet materialized) holds exactly the values of the whole build: the NF4 build quantizes in that hook."""
    arch = load_config("tiny").model.arch
    whole = M.build_random_on(arch, V, TOKS.pad, TOKS.eos, 3, torch.bfloat16, "cpu")
    seen = []

    def hook(layer):
        assert all(p.device.type == "cpu" for p in layer.parameters())
        seen.append(layer)

    lazy = M.build_random_on(arch, V, TOKS.pad, TOKS.eos, 3, torch.bfloat16, "cpu", after_layer=hook)
    assert seen == list(lazy.model.layers)
    a, b = whole.state_dict(), lazy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_random_base_build_frees_each_layers_replaced_modules_before_the_next_layer():
    """The NF4 build replaces a decoder layer's Linear modules in after_layer; the replaced BF16 modules must be gone
    before the next layer is handed over (peak: the quantized model plus one BF16 layer). modules()' memo had kept
    every one of them to the end of the build: ~62 GB at the 27B shape, and verify-checkpoint's second engine ran out
    of memory on an 80 GB H100 (bench/results/h100-step-27b-g1-on-trainer-verify-oom-2026-12-07.json)."""
    import weakref

    arch = load_config("tiny").model.arch
    replaced = []  # (layer index, weakref to a replaced Linear)
    alive_at_handover = []

    def hook(layer):
        idx = len(alive_at_handover)
        alive_at_handover.append([i for i, r in replaced if r() is not None])
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    new = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                    new.load_state_dict(child.state_dict())
                    setattr(parent, name, new)
                    replaced.append((idx, weakref.ref(child)))

    model = M.build_random_on(arch, V, TOKS.pad, TOKS.eos, 3, torch.bfloat16, "cpu", after_layer=hook)
    assert len(alive_at_handover) == len(model.model.layers) and replaced
    assert alive_at_handover == [[] for _ in alive_at_handover]  # no earlier layer's old modules when a layer is done
    assert all(r() is None for _, r in replaced)
    whole = M.build_random_on(arch, V, TOKS.pad, TOKS.eos, 3, torch.bfloat16, "cpu")
    a, b = whole.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the walk's order: the same values


@pytest.mark.gpu
def test_random_nf4_base_quantized_per_layer_equals_quantizing_the_whole_model(tmp_path):
    """engine.nf4.load_base_nf4 on a random-base recipe quantizes each layer as it is built (peak: the NF4 model plus
    one BF16 layer); the packed weights and their statistics equal quantize_nf4_ of the whole BF16 model."""
    pytest.importorskip("bitsandbytes")
    import json

    arch = load_config("tiny").model.arch
    (tmp_path / M.RANDOM_BASE).write_text(json.dumps({"arch": arch, "vocab_size": V, "pad_id": TOKS.pad,
                                                       "eos_id": TOKS.eos, "seed": 3, "std": 0.02}))
    lazy = nf4.load_base_nf4(tmp_path, device="cuda")
    whole = M.build_random_on(arch, V, TOKS.pad, TOKS.eos, 3, torch.bfloat16, "cuda")
    nf4.quantize_nf4_(whole)
    a, b = dict(nf4.iter_bf16_state(whole)), dict(nf4.iter_bf16_state(lazy))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qa = {k: v for k, v in whole.state_dict().items()}
    qb = {k: v for k, v in lazy.state_dict().items()}
    assert qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa)
