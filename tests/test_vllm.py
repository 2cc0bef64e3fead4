"""The vLLM sampler on CPU (optional extra: `bash scripts/setup-vllm.sh`): engine settings, sampling semantics, rollout
parity against the HF trainer (both bf16), adapter switches and staleness, and the DoRA layer arithmetic.

The model is the tiny Qwen3.5 hybrid of configs/tiny.yaml (3 GDN + 1 attention layers, head dims 64) in bf16, built
with engine.model.build_random_model; its final norm is scaled so the answer distributions are peaked (mean log-prob
about -3 at T=1.3) instead of near-uniform, which makes the parity comparison meaningful.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import vllm_sampler as V

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: the optional extra is installed by "
                                                      "`bash scripts/setup-vllm.sh [VENV]`")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj",
           "down_proj"]
TEMPERATURE = 1.3
GATE = dict(mean_max=0.1, token_max=1.0, min_prob=0.01)


# ----------------------------------------------------------------------------------------------------------------
# engine settings: pure functions, no vLLM needed


def test_gpu_engine_kwargs_carry_the_seed_settings():
    kw = V.engine_kwargs(model="m", tokenizer=None, device="cuda", seed=3, max_model_len=4096, adapter="lora",
                         max_lora_rank=16)
    assert kw["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kw["attention_backend"] == "FLASH_ATTN"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["enable_prompt_embeds"] is True
    assert kw["enable_prefix_caching"] is False and "speculative_config" not in kw  # MTP off by default
    assert kw["enable_lora"] and kw["max_loras"] == 1 and kw["max_lora_rank"] == 16 and kw["seed"] == 3
    mtp = V.engine_kwargs(model="m", tokenizer=None, device="cuda", seed=0, max_model_len=4096, mtp_tokens=3)
    assert mtp["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    cpu = V.engine_kwargs(model="m", tokenizer=None, device="cpu", seed=0, max_model_len=1024, adapter="dense")
    assert cpu["attention_backend"] == "CPU_ATTN" and cpu["enforce_eager"] and "enable_lora" not in cpu
    assert V.engine_kwargs(model="m", tokenizer=None, device="cpu", seed=0, max_model_len=8, max_lora_rank=12,
                           adapter="lora")["max_lora_rank"] == 16


def test_mtp_with_prefix_caching_on_a_hybrid_is_rejected_before_loading():
    with pytest.raises(V.EngineSettingsError, match="recurrent"):
        V.engine_kwargs(model="m", tokenizer=None, device="cuda", seed=0, max_model_len=64, mtp_tokens=2,
                        prefix_caching=True, hybrid=True)
    V.engine_kwargs(model="m", tokenizer=None, device="cuda", seed=0, max_model_len=64, mtp_tokens=2,
                    prefix_caching=True, hybrid=False)  # a pure-attention model may combine them
    V.engine_kwargs(model="m", tokenizer=None, device="cuda", seed=0, max_model_len=64, mtp_tokens=2)
    with pytest.raises(V.EngineSettingsError, match="bfloat16"):
        V.engine_kwargs(model="m", tokenizer=None, device="cpu", seed=0, max_model_len=64, dtype="float32")


def test_sampler_constructor_rejects_before_loading(tiny):
    with pytest.raises(V.EngineSettingsError):
        V.VllmSampler(tiny.base, adapter=None, mtp_tokens=2, prefix_caching=True, cache_root=tiny.root / "vc")
    assert V.model_is_hybrid(tiny.base)


def test_sampler_settings_from_the_run_config(tiny, tmp_path):
    from configs.schema import load_config

    cfg = load_config("tiny")
    a = V.sampler_settings(cfg, tiny.base, tiny.base, tmp_path, rank=0)
    b = V.sampler_settings(cfg, tiny.base, tiny.base, tmp_path, rank=1)
    assert a["seed"] != b["seed"] and a["seed"] == V.sampler_settings(cfg, tiny.base, tiny.base, tmp_path)["seed"]
    assert a["max_model_len"] == 1024  # 256 + 768 + 4 + 2 = 1030, capped by the tiny model's 1024 positions
    assert Path(a["cache_root"]).is_relative_to(tmp_path) and a["adapter"] is cfg.adapter


def test_row_seeds_differ_by_rank_call_and_row():
    seeds = {V.row_seed(r, c, i) for r in range(3) for c in range(3) for i in range(8)}
    assert len(seeds) == 72 and all(0 <= s < 2**63 for s in seeds)


# ----------------------------------------------------------------------------------------------------------------
# fixtures: a tiny bf16 hybrid, its export dir, a trainer with adapters, two engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from configs.schema import load_config
    from engine import model as M
    from engine.chat import episode_text
    from engine.tokenizer import load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("vllm")
    base = root / "export"
    corpus = [episode_text(f"what is {i} plus {3 * i}?", [f"<tool_call>lookup {i}</tool_call>", f"answer {4 * i}"],
                           [f"value {i}"]) for i in range(200)]
    train_tokenizer(corpus, 512, base)
    tok = load_tokenizer(base)
    toks = M.Tokens.of(tok)
    arch = load_config("tiny").model.arch
    model = M.build_random_model(arch, len(tok), toks.pad, toks.eos, seed=0, dtype="bfloat16")
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)  # Qwen3.5 RMSNorm scales by (1 + w): logits x4, peaked distributions
    model.save_pretrained(base)  # what stages/export.py writes: the checkpoint plus the tokenizer files
    return SimpleNamespace(root=root, base=base, toks=toks)


def _adapter_cfg(kind: str):
    return SimpleNamespace(type=kind, rank=16, alpha=32.0, dropout=0.0, targets=TARGETS)


def _trainer(tiny, kind: str):
    from engine import model as M

    torch.manual_seed(0)
    pm = M.attach_adapter(M.load_base(tiny.base, "bfloat16"), _adapter_cfg(kind))
    pm.eval()
    return pm


def _perturb(pm, seed: int, b_std: float, m_std: float = 0.0) -> None:
    """Give the adapter a visible effect: random lora_B (PEFT starts it at 0) and magnitudes off the weight norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
            elif "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif "magnitude" in n and m_std:
                p.mul_(1 + m_std * torch.randn(p.shape, generator=g))


def _write(pm, path: Path) -> Path:
    from artifacts import write_adapter_dir
    from engine import model as M

    write_adapter_dir(path, M.adapter_config_dict(pm), M.adapter_state(pm))
    return path


@pytest.fixture(scope="module")
def lora(tiny):
    """A LoRA-request engine and a bf16 trainer; adapters a1 (served first) and a2."""
    pm = _trainer(tiny, "lora")
    _perturb(pm, 1, 0.02)
    a1 = _write(pm, tiny.root / "lora-a1")
    _perturb(pm, 2, 0.02)
    a2 = _write(pm, tiny.root / "lora-a2")
    rng_before = torch.random.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    s = V.VllmSampler(tiny.base, adapter=_adapter_cfg("lora"), seed=11, max_model_len=1024,
                      cache_root=tiny.root / "vllm-cache")
    wall = time.perf_counter() - t0
    env = dict(rng_kept=torch.equal(rng_before, torch.random.get_rng_state()),
               set_threads_kept=torch.set_num_threads is set_threads, threads=torch.get_num_threads())
    yield SimpleNamespace(s=s, pm=pm, a1=a1, a2=a2, wall=wall, env=env)
    s.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dora(tiny):
    """A DoRA engine (dense adapter path) and a bf16 trainer with a DoRA adapter."""
    pm = _trainer(tiny, "dora")
    _perturb(pm, 3, 0.02, m_std=0.05)
    a = _write(pm, tiny.root / "dora-a")
    s = V.VllmSampler(tiny.base, adapter=_adapter_cfg("dora"), seed=12, max_model_len=1024,
                      cache_root=tiny.root / "vllm-cache")
    yield SimpleNamespace(s=s, pm=pm, a=a)
    s.close()


def _turns(pm, toks, n: int, seed: int, K: int = 4):
    """n turns: random prefixes, thoughts at the embedding scale, and their prompt embeddings (trainer-side)."""
    from engine import model as M
    from engine import answers as AN

    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(10, 500, (int(torch.randint(8, 48, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]
    scale = M.embed_scale(pm)
    thoughts = [(scale * torch.randn(K, 128, generator=g)).to(torch.bfloat16) for _ in range(n)]
    with torch.no_grad():
        prompts = [AN.prompt_embeddings(pm, p, z, toks) for p, z in zip(prefixes, thoughts)]
    return prefixes, thoughts, prompts, scale


def _trainer_logps(pm, toks, prefixes, thoughts, answers, scale) -> list[list[float]]:
    """The trainer's teacher-forced, post-temperature log-probs of the sampled answers (replay's scoring)."""
    from engine import scoring as SC

    keep = [i for i, a in enumerate(answers) if a]
    out = [[] for _ in answers]
    with torch.no_grad():
        lps, _ = SC.score_turns(pm, [prefixes[i] for i in keep], [thoughts[i] for i in keep],
                               [answers[i] for i in keep], TEMPERATURE, 0.05, scale, toks)
    for i, lp in zip(keep, lps):
        out[i] = lp.float().tolist()
    return out


def _parity(sampler, pm, toks, rounds: int, seed: int, rows: int = 16):
    from engine.gates import rollout_parity

    tr_all, sp_all, secs = [], [], []
    for r in range(rounds):
        prefixes, thoughts, prompts, scale = _turns(pm, toks, rows, seed + r)
        t0 = time.perf_counter()
        ids, lps = sampler.sample(prompts, 48, TEMPERATURE, seed=seed + r)
        secs.append(time.perf_counter() - t0)
        tr_all += _trainer_logps(pm, toks, prefixes, thoughts, ids, scale)
        sp_all += lps
    report, _ = rollout_parity(tr_all, sp_all, **GATE)
    return report, secs


# ----------------------------------------------------------------------------------------------------------------
# engine start and sampling semantics


@needs_vllm
@pytest.mark.slow
def test_engine_starts_in_process_and_leaves_the_trainer_alone(lora, capsys):
    with capsys.disabled():
        print(f"\n[vllm] import {lora.s.import_s:.1f}s, engine start {lora.s.start_s:.1f}s, fixture wall "
              f"{lora.wall:.1f}s")
    assert lora.env == dict(rng_kept=True, set_threads_kept=True, threads=1)
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert Path(os.environ["VLLM_CACHE_ROOT"]).is_relative_to(lora.s.export_dir.parent)


@needs_vllm
@pytest.mark.slow
def test_sample_semantics(lora, tiny):
    s, toks = lora.s, tiny.toks
    s.use_adapter(lora.a1)
    _, _, prompts, _ = _turns(lora.pm, toks, 6, 100)
    limits = [0, 1, 3, 40, 40, 40]
    ids, lps = s.sample(prompts, 24, TEMPERATURE, limits=limits, seed=5)
    assert ids[0] == [] and lps[0] == []
    for a, lp, lim in zip(ids, lps, limits):
        assert len(a) == len(lp) <= min(24, lim)
        assert all(t != toks.eos for t in a[:-1])            # stops at the first <|im_end|> ...
        assert len(a) == min(24, lim) or a[-1] == toks.eos   # ... kept as the last token, or at the cap
        assert all(x <= 0.0 and math.isfinite(x) for x in lp)
    again = s.sample(prompts, 24, TEMPERATURE, limits=limits, seed=5)
    assert again == (ids, lps)                               # seeded per row: reproducible
    other = s.sample(prompts, 24, TEMPERATURE, limits=limits, seed=6)
    assert other[0] != ids
    # a row's tokens do not depend on the rest of the batch (per-request seeds): row 3 alone (the others have no
    # budget left, so they send no request) samples what it sampled in the batch of five
    alone = s.sample(prompts, 24, TEMPERATURE, limits=[0, 0, 0, 40, 0, 0], seed=5)
    assert alone[0][3] == ids[3] and all(a == [] for i, a in enumerate(alone[0]) if i != 3)


@needs_vllm
@pytest.mark.slow
def test_logprobs_are_post_temperature(lora, tiny):
    """The reported log-prob is log_softmax(logits / T): the trainer agrees at the sampling temperature, and scoring
    the same tokens at another temperature does not."""
    from engine import model as M
    from engine import scoring as SC

    s, toks = lora.s, tiny.toks
    s.use_adapter(lora.a1)
    from artifacts import read_adapter_dir

    M.load_adapter_state(lora.pm, read_adapter_dir(lora.a1)[1])
    prefixes, thoughts, prompts, scale = _turns(lora.pm, toks, 8, 200)
    ids, lps = s.sample(prompts, 12, 2.0, seed=1)

    def mean_gap(T):
        with torch.no_grad():
            tr, _ = SC.score_turns(lora.pm, prefixes, thoughts, ids, T, 0.05, scale, toks)
        g = [abs(a - b) for t, l in zip(tr, lps) for a, b in zip(t.tolist(), l)]
        return sum(g) / len(g)

    assert mean_gap(2.0) < 0.1
    assert mean_gap(1.0) > 5 * mean_gap(2.0)
    with pytest.raises(ValueError, match="temperature"):
        s.sample(prompts, 4, 2.5)  # vLLM accepts (0.01, 2]; our config allows more


# ----------------------------------------------------------------------------------------------------------------
# rollout parity, adapter switches, staleness


@needs_vllm
@pytest.mark.slow
def test_rollout_parity_lora_over_2000_tokens(lora, tiny, capsys):
    lora.s.use_adapter(lora.a2)
    from engine import model as M
    from artifacts import read_adapter_dir

    M.load_adapter_state(lora.pm, read_adapter_dir(lora.a2)[1])
    report, secs = _parity(lora.s, lora.pm, tiny.toks, rounds=3, seed=1000)
    with capsys.disabled():
        print(f"\n[vllm] LoRA parity: {report['tokens']} tokens ({report['tokens_considered']} >= 1 %), mean gap "
              f"{report['mean_gap']:.4f}, max {report['max_gap']:.4f} nat; sampling 16 rows x <=48 tokens: "
              + ", ".join(f"{x:.2f}s" for x in secs))
    assert report["tokens"] >= 2000
    assert report["passed"] and report["mean_gap"] <= 0.1 and report["max_gap"] <= 1.0, report["worst_tokens"]


@needs_vllm
@pytest.mark.slow
def test_adapter_switch_reloads_and_a_stale_adapter_fails_the_gate(lora, tiny, capsys):
    from artifacts import read_adapter_dir
    from engine import model as M
    from engine.gates import rollout_parity

    s, pm, toks = lora.s, lora.pm, tiny.toks
    _, _, prompts, _ = _turns(pm, toks, 8, 300)
    s.use_adapter(lora.a1)
    assert s.use_adapter(lora.a1) is False                  # same content: no reload
    first = s.sample(prompts, 16, TEMPERATURE, seed=9)
    assert s.use_adapter(lora.a2) is True and s.lora_request.lora_int_id > 1
    second = s.sample(prompts, 16, TEMPERATURE, seed=9)
    assert first != second                                  # the served model changed
    assert s.llm.llm_engine.list_loras() == {s.lora_request.lora_int_id}  # exactly one adapter active
    s.use_adapter(lora.a1)
    assert s.sample(prompts, 16, TEMPERATURE, seed=9) == first  # switching back gives the a1 model again

    # the trainer moves to a2; the sampler skips the reload and still serves a1: the parity gate must fail
    M.load_adapter_state(pm, read_adapter_dir(lora.a2)[1])
    prefixes, thoughts, prompts, scale = _turns(pm, toks, 16, 400)
    ids, lps = s.sample(prompts, 48, TEMPERATURE, seed=4)
    stale, _ = rollout_parity(_trainer_logps(pm, toks, prefixes, thoughts, ids, scale), lps, **GATE)
    s.use_adapter(lora.a2)
    ids, lps = s.sample(prompts, 48, TEMPERATURE, seed=4)
    fresh, _ = rollout_parity(_trainer_logps(pm, toks, prefixes, thoughts, ids, scale), lps, **GATE)
    with capsys.disabled():
        print(f"\n[vllm] stale adapter: mean gap {stale['mean_gap']:.3f} max {stale['max_gap']:.3f}; reloaded: "
              f"mean {fresh['mean_gap']:.4f} max {fresh['max_gap']:.3f}")
    assert not stale["passed"] and fresh["passed"]

    # new content at the same path reloads (the switch is keyed by content, not by path)
    same_path = tiny.root / "lora-moving"
    _perturb(pm, 6, 0.02)
    _write(pm, same_path)
    assert s.use_adapter(same_path) is True
    _perturb(pm, 7, 0.02)
    _write(pm, same_path)
    assert s.use_adapter(same_path) is True
    M.load_adapter_state(pm, read_adapter_dir(lora.a2)[1])


# ----------------------------------------------------------------------------------------------------------------
# DoRA: the sampler's layers against the trainer's, and rollout parity


def _dora_layer_pairs(dora):
    """(HF module name, PEFT module, vLLM layer, its adapter slice) for every DoRA-wrapped Linear."""
    model = dora.s.model()
    dense = dora.s._dense
    for name in dense.names:
        vname, start, size = dense.locate(name)
        s = next(s for s in dense.slices[vname] if s.name == name)
        yield name, dora.pm.base_model.model.get_submodule(name), model.get_submodule(vname), s


def _vllm_out(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


@needs_vllm
@pytest.mark.slow
def test_dora_layers_match_the_trainer_bitwise(dora, capsys):
    """Every DoRA layer of the sampler equals the trainer's (PEFT) output bit for bit where the base matmul is the same
    kernel; the combination itself (base output, FP32 LoRA term, magnitude, one rounding) is bitwise everywhere."""
    dora.s.use_adapter(dora.a)
    g = torch.Generator().manual_seed(0)
    layers = bitwise = 0
    with torch.no_grad():
        for name, peft_mod, layer, s in _dora_layer_pairs(dora):
            sl = slice(s.start, s.start + s.size)
            x = (torch.randn(9, peft_mod.in_features, generator=g) * 0.5).to(torch.bfloat16)
            want = peft_mod(x)
            base_t = peft_mod.base_layer(x)
            base_v = layer.quant_method.apply(layer, x)[..., sl]
            # the sampler's combination on the trainer's base output: identical arithmetic, identical bits
            assert torch.equal(V.lora_combine(base_t, x, s.A, s.B, dora.s.scaling, s.mag_scale), want), name
            got = _vllm_out(layer, x)[..., sl]
            layers += 1
            if torch.equal(base_v, base_t):  # vLLM's base matmul is torch's here: the whole layer is bitwise
                assert torch.equal(got, want), name
                bitwise += 1
            else:
                assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7, name
    with capsys.disabled():
        print(f"\n[vllm] DoRA layers bitwise equal to the trainer: {bitwise}/{layers}")
    assert layers == len(dora.s._dense.names) and bitwise > 0


@needs_vllm
@pytest.mark.slow
def test_dora_rounding_twice_is_caught(dora, tiny, capsys):
    """The seeds' bug: base + LoRA rounded to bf16 first, magnitude applied after. With a realistic small adapter
    (contribution ~1e-4 of the output, below one bf16 step) it differs from the trainer's output and erases a share of the adapter."""
    from engine import model as M

    pm = _trainer(tiny, "dora")
    _perturb(pm, 5, 2e-4, m_std=2e-4)
    mods = V.adapter_modules(M.adapter_state(pm))
    g = torch.Generator().manual_seed(1)
    differ = total = 0
    kept = []
    with torch.no_grad():
        for name, d in sorted(mods.items()):
            mod = pm.base_model.model.get_submodule(name)
            x = (torch.randn(16, mod.in_features, generator=g) * 0.5).to(torch.bfloat16)
            want = mod(x)
            base = mod.base_layer(x)
            ms = V.dora_scale(mod.base_layer.weight, d["A"], d["B"], d["m"], dora.s.scaling)
            once = V.lora_combine(base, x, d["A"], d["B"], dora.s.scaling, ms)
            twice = V.lora_combine_rounding_twice(base, x, d["A"], d["B"], dora.s.scaling, ms)
            assert torch.equal(once, want), name
            differ += int((twice != want).sum())
            total += want.numel()
            delta = want.double() - base.double()  # the adapter's contribution in the trainer's output
            kept.append(float(((twice.double() - base.double()) * delta).sum() / (delta * delta).sum()))
    share = differ / total
    with capsys.disabled():
        print(f"\n[vllm] rounding twice: {share:.1%} of DoRA outputs differ from the trainer's; it keeps "
              f"{sum(kept) / len(kept):.2f} of the trainer's adapter contribution (rounding once: bitwise equal)")
    assert share > 0.01


@needs_vllm
@pytest.mark.slow
def test_dora_rollout_parity(dora, tiny, capsys):
    dora.s.use_adapter(dora.a)
    report, secs = _parity(dora.s, dora.pm, tiny.toks, rounds=3, seed=2000)
    with capsys.disabled():
        print(f"\n[vllm] DoRA parity: {report['tokens']} tokens, mean gap {report['mean_gap']:.4f}, max "
              f"{report['max_gap']:.4f} nat; sampling: " + ", ".join(f"{x:.2f}s" for x in secs))
    assert report["tokens"] >= 2000
    assert report["passed"] and report["max_gap"] <= 1.0, report["worst_tokens"]
    # serving the base again is exact: zeroed buffers leave every layer's output bit-identical to the base
    dora.s.use_adapter(None)
    _, _, prompts, _ = _turns(dora.pm, tiny.toks, 4, 77)
    ids, lps = dora.s.sample(prompts, 12, TEMPERATURE, seed=3)
    dora.s.use_adapter(dora.a)
    assert dora.s.sample(prompts, 12, TEMPERATURE, seed=3) != (ids, lps)


# ----------------------------------------------------------------------------------------------------------------
# teacher-forced scoring (the probe) and the dense LoRA path


def _trainer_full(pm, toks, prefixes, thoughts, answers, T):
    """The trainer's post-temperature log-softmax at every answer position (teacher-forced), [(L_i, V)]."""
    from engine import model as M

    text, head, emb = M._parts(pm)
    seqs = [torch.cat([emb(torch.tensor(p + [toks.think])), z.to(torch.bfloat16),
                       emb(torch.tensor([toks.answer_open] + a[:-1]))], 0) for p, z, a in zip(prefixes, thoughts, answers)]
    x, mask, pos = M.left_pad(seqs)
    with torch.no_grad():
        hid = text(inputs_embeds=x, attention_mask=mask, position_ids=pos).last_hidden_state
    S = hid.shape[1]
    return [torch.log_softmax(head(hid[i, S - len(a):]).float() / T, -1) for i, a in enumerate(answers)]


@needs_vllm
@pytest.mark.slow
def test_teacher_forced_scoring_matches_the_trainer(lora, tiny, capsys):
    from artifacts import read_adapter_dir
    from engine import model as M

    s, pm, toks = lora.s, lora.pm, tiny.toks
    s.use_adapter(lora.a2)
    M.load_adapter_state(pm, read_adapter_dir(lora.a2)[1])
    prefixes, thoughts, prompts, _ = _turns(pm, toks, 6, 500)
    ids, lps = s.sample(prompts, 16, TEMPERATURE, seed=2)
    t0 = time.perf_counter()
    tf = s.teacher_forced(prompts, ids, TEMPERATURE)
    secs = time.perf_counter() - t0
    tr = _trainer_full(pm, toks, prefixes, thoughts, ids, TEMPERATURE)
    gaps, agree, n, dec = [], 0, 0, []
    for a, v, t, lp in zip(ids, tf, tr, lps):
        assert v.shape == t.shape == (len(a), t.shape[1])
        assert torch.allclose(v.exp().sum(-1), torch.ones(len(a)), atol=1e-3)  # full, normalized distributions
        idx = torch.tensor(a)[:, None]
        gaps += (v.gather(1, idx) - t.gather(1, idx)).abs()[:, 0].tolist()
        dec += (v.gather(1, idx)[:, 0] - torch.tensor(lp)).abs().tolist()  # prefill path vs the sampler's decode
        agree += int((v.argmax(-1) == t.argmax(-1)).sum())
        n += len(a)
    with capsys.disabled():
        print(f"\n[vllm] teacher-forced: {n} positions in {secs:.1f}s, gap to trainer mean {sum(gaps) / n:.4f} max "
              f"{max(gaps):.3f}, argmax agreement {agree / n:.1%}, vs own decode path max {max(dec):.3f}")
    assert sum(gaps) / n <= 0.1 and max(gaps) <= 1.0 and agree / n >= 0.9 and max(dec) <= 0.5


@needs_vllm
@pytest.mark.slow
def test_teacher_forcing_more_positions_than_one_scheduler_step(lora, tiny):
    """The probe's load: requests totalling far more than vLLM's 4096-token step budget. vLLM 0.32's CPU worker
    crashed ("CPU Generator does not use offset") when it prefilled a seeded request in chunks; grouping the calls
    keeps every prefill whole, and the result does not depend on the grouping. (Before the dense-path test: closing an
    engine tears down vLLM's process-wide parallel state, which this module's `lora` engine shares.)"""
    s, pm, toks = lora.s, lora.pm, tiny.toks
    s.use_adapter(lora.a2)
    _, _, prompts, _ = _turns(pm, toks, 8, 300)
    answers = [list(range(20, 44))] * len(prompts)  # 8 prompts x 24 positions: ~8k prefill positions in all
    together = s.teacher_forced(prompts, answers, TEMPERATURE)
    alone = [s.teacher_forced([p], [a], TEMPERATURE)[0] for p, a in zip(prompts[:2], answers[:2])]
    assert all(torch.equal(x, y) for x, y in zip(together[:2], alone))
    ids, lps = s.sample(prompts * 8, 4, TEMPERATURE, seed=5)  # 64 seeded rows, ~20k prompt positions
    again, lps2 = s.sample(prompts * 8, 4, TEMPERATURE, seed=5)
    assert ids == again and lps == lps2


@needs_vllm
@pytest.mark.slow
def test_dense_lora_path_parity(tiny, lora, capsys):
    """adapter_path="dense": LoRA through the same hooks as DoRA (FP32 LoRA term, one rounding), no LoRARequest."""
    from artifacts import read_adapter_dir
    from engine import model as M

    s = V.VllmSampler(tiny.base, adapter=_adapter_cfg("lora"), adapter_path="dense", seed=13, max_model_len=1024,
                      cache_root=tiny.root / "vllm-cache")
    try:
        assert s.lora_request is None and "enable_lora" not in s.engine_kwargs
        s.use_adapter(lora.a2)
        M.load_adapter_state(lora.pm, read_adapter_dir(lora.a2)[1])
        report, _ = _parity(s, lora.pm, tiny.toks, rounds=1, seed=3000)
        with capsys.disabled():
            print(f"\n[vllm] dense LoRA parity: {report['tokens']} tokens, mean gap {report['mean_gap']:.4f}, max "
                  f"{report['max_gap']:.4f}")
        assert report["tokens"] >= 500 and report["passed"] and report["max_gap"] <= 1.0
    finally:
        s.close()


# ----------------------------------------------------------------------------------------------------------------
# the pipeline with `sampler.kind: vllm`: generate-turn samples through vLLM, replay gates it. Keep it last: closing
# its engines (runtime.clear) tears down vLLM's process-wide parallel state, which the module's fixture engines share


def _peaked_checkpoint(run_root: Path) -> Path:
    """A bf16 tiny hybrid whose answer distributions are peaked (final norm scaled), with a tokenizer trained on the
    table gym's oracle text: a stand-in for a pretrained base, so parity compares meaningful probabilities."""
    from configs.schema import load_config
    from engine import model as M
    from engine.chat import episode_text
    from engine.tokenizer import load_tokenizer, train_tokenizer
    from gyms import TableGym

    path = run_root / "pretrained"
    env = TableGym(max_turns=5, table_size=4, max_value=20, ops=["plus"])
    corpus = []
    for task in env.sample_tasks(400, seed=1):
        q, answers, obs = env.reset(task), env.oracle_answers(task), []
        for a in answers:
            res = env.step(a)
            if not res.done:
                obs.append(res.observation)
        corpus.append(episode_text(q, answers, obs))
    train_tokenizer(corpus, 512, path)
    tok = load_tokenizer(path)
    toks = M.Tokens.of(tok)
    model = M.build_random_model(load_config("tiny").model.arch, len(tok), toks.pad, toks.eos, seed=0, dtype="bfloat16")
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)
    model.save_pretrained(path)
    return path


@needs_vllm
@pytest.mark.slow
def test_pipeline_step_with_vllm_passes_parity_and_a_skipped_reload_fails_it(tmp_path, monkeypatch):
    """`sampler.kind: vllm` through the stages: generate-turn samples with vLLM, replay's rollout parity gate passes;
    then the adapter moves but the sampler's reload is skipped: the gate fails and the diagnostic names the sampler's
    adapter."""
    from artifacts import RunDir, read_adapter_dir, read_json, write_adapter_dir
    from engine import runtime
    from engine.gates import GateFailed
    from stages.diagnose import diagnose
    from tests.conftest import make_run
    from tests.conftest import fresh_step

    runtime.clear()
    ckpt = _peaked_checkpoint(tmp_path)
    run_dir = make_run(tmp_path / "run", **{"sampler.kind": "vllm", "model.dtype": "bfloat16",
                                             "adapter.train_final_norm": False,
                                             "model.source": "pretrained", "model.path": str(ckpt),
                                             "tokenizer.path": str(ckpt), "steps.pattern": ["fresh"],
                                             "bootstrap.enabled": False,
                                             "grpo.groups_per_step": 4})
    first = fresh_step(run_dir, 0, f"{run_dir}/adapter-init")
    report = read_json(RunDir(run_dir).parity(0))
    print(f"\npipeline vLLM step 0: {report['tokens_considered']} of {report['tokens']} tokens considered, mean gap "
          f"{report['mean_gap']:.4f}, max {report['max_gap']:.3f}")
    assert report["passed"] and report["tokens_considered"] > 50
    config, tensors = read_adapter_dir(f"{run_dir}/adapter-init")  # the next adapter: one (large) update later
    g = torch.Generator().manual_seed(0)
    moved = {k: (torch.randn(v.shape, generator=g) * 0.1 if "lora_B" in k else v) for k, v in tensors.items()}
    adapter1 = str(tmp_path / "adapter-1")
    write_adapter_dir(adapter1, config, moved)
    monkeypatch.setattr(runtime.VllmEngine, "use_adapter", lambda self, adapter_dir: None)  # the reload is skipped
    with pytest.raises(GateFailed) as err:
        fresh_step(run_dir, 1, adapter1)
    print(f"stale sampler: mean gap {err.value.report['mean_gap']:.3f}")
    assert err.value.gate == "rollout-parity" and err.value.report["mean_gap"] > 0.1
    d = diagnose(run_dir, 1, "rollout-parity", err.value.report, adapter1, first["base"],
                 f"{run_dir}/step-0001/rollouts.arrow")
    assert d["verdict"].startswith("sampler engine adapter weights"), d["verdict"]
    runtime.clear()

