"""Engine: latent loop determinism, sampler-vs-replay agreement, gradient through token weights, adapters."""

from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from engine import model as M
from engine import answers as AN
from engine import latent as LT
from engine import scoring as SC
from engine.chat import episode_text, first_prompt

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.tokenizer import load_tokenizer, train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    corpus = [episode_text(f'What is "alpha" plus "n{i}"?', ['<tool_call>{"name": "lookup", "arguments": {"key": "alpha"}}</tool_call>', "19"], ["17"]) for i in range(50)]
    train_tokenizer(corpus, 400, d)
    tok = load_tokenizer(d)
    cfg = load_config("tiny")
    toks = M.Tokens.of(tok)
    base = M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0)
    torch.manual_seed(0)
    model = M.attach_adapter(base, cfg.adapter)
    # give the adapter non-zero B so it changes the model (as after a few updates)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    prefixes = [tok(first_prompt(f'What is "alpha" plus "n{i}"?'))["input_ids"] for i in range(3)]
    return cfg, tok, toks, model, prefixes


def _scale_sigma(model, cfg):
    scale = M.embed_scale(model)
    return scale, cfg.latent.sigma * scale


def test_adapter_weights_are_fp32_masters_on_a_bf16_base(tiny):
    cfg = tiny[0]
    base = M.build_random_model(cfg.model.arch, 400, 0, 3, seed=0, dtype="bfloat16")
    model = M.attach_adapter(base, cfg.adapter)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)


def test_latent_loop_same_seed_is_bitwise(tiny):
    cfg, _, toks, model, prefixes = tiny
    scale, sigma = _scale_sigma(model, cfg)
    z1, q1 = LT.latent_loop(model, prefixes, 4, sigma, scale, toks, torch.Generator().manual_seed(7))
    z2, q2 = LT.latent_loop(model, prefixes, 4, sigma, scale, toks, torch.Generator().manual_seed(7))
    z3, _ = LT.latent_loop(model, prefixes, 4, sigma, scale, toks, torch.Generator().manual_seed(8))
    assert torch.equal(z1, z2) and torch.equal(q1, q2)
    assert not torch.equal(z1, z3)
    assert z1.shape == (3, 4, model.config.hidden_size) and q1.shape == (3, 4)


def _one_turn(tiny, seed: int, max_new: int):
    """One model turn for every prefix: thoughts, their densities, sampled answers and sampler log-probs."""
    cfg, _, toks, model, prefixes = tiny
    scale, sigma = _scale_sigma(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    z, q = LT.latent_loop(model, prefixes, 4, sigma, scale, toks, gen)
    prompts = [AN.prompt_embeddings(model, p, z[i], toks) for i, p in enumerate(prefixes)]
    ids, lps = AN.sample_answers(model, prompts, max_new, 1.0, toks, gen)
    return z, q, ids, lps


def test_replay_matches_generation(tiny):
    """Trainer re-scoring vs what generation reported, same weights, FP32: the gap is rounding only (< 1e-4)."""
    cfg, _, toks, model, prefixes = tiny
    scale, sigma = _scale_sigma(model, cfg)
    z, q, ids, lps = _one_turn(tiny, seed=0, max_new=10)
    with torch.no_grad():
        alp, q2 = SC.score_turns(model, prefixes, list(z), ids, 1.0, sigma, scale, toks)
    for a, b in zip(alp, lps):
        assert torch.allclose(a, torch.tensor(b), atol=1e-4, rtol=0)
    # log q sums d squared terms divided by sigma^2: relative agreement is what FP32 can give
    assert torch.allclose(q2, q, rtol=1e-5, atol=0)


def test_token_weight_backprop_equals_direct_gradient(tiny):
    """Σ w·logp with w = dL/dlogp (driver-side loss) gives the gradient of L itself (FP32, rtol 1e-5)."""
    from engine.loss import grpo_loss, token_weights
    from engine.replay import to_sequences

    cfg, _, toks, model, prefixes = tiny
    scale, sigma = _scale_sigma(model, cfg)
    z, _, ids, _ = _one_turn(tiny, seed=1, max_new=8)
    params = [p for p in model.parameters() if p.requires_grad]
    adv = torch.tensor([1.0, -0.5, 0.25])
    rows = [0, 1, 2]

    def seqs():
        a, qq = SC.score_turns(model, prefixes, list(z), ids, 1.0, sigma, scale, toks)
        return to_sequences(rows, [torch.cat([qq[i], a[i]]) for i in rows], 3)

    old = seqs()[0].detach() - 0.05  # an off-policy reuse step: ratios != 1, some clipped
    lp, mask = seqs()
    loss_fn = lambda x: grpo_loss(x, old, adv, mask, loss_type="dapo")[0]  # noqa: E731
    direct = torch.autograd.grad(loss_fn(lp), params)
    w = token_weights(lp.detach(), loss_fn)
    lp2, _ = seqs()
    via_w = torch.autograd.grad((w * lp2).sum(), params)
    num = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(direct, via_w)))
    den = torch.sqrt(sum((a ** 2).sum() for a in direct))
    assert den > 0
    assert num / den < 1e-5


def test_adapter_dir_roundtrip_with_peft(tiny, tmp_path):
    from peft import PeftModel

    from artifacts import write_adapter_dir

    cfg, tok, toks, model, prefixes = tiny
    write_adapter_dir(tmp_path / "adapter", M.adapter_config_dict(model), M.adapter_state(model))
    base = M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    x = torch.tensor([prefixes[0]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_load_adapter_state_in_place_equals_peft_load(tiny, kind):
    """The in-place copy of a saved adapter state gives the parameters PEFT's set_peft_model_state_dict gives, bit for
    bit (LoRA and DoRA); a state with a key too many or with another dtype goes through PEFT, a missing one raises."""
    from peft import set_peft_model_state_dict

    cfg, tok, toks, _, _ = tiny
    adapter = cfg.adapter.model_copy(update={"type": kind})

    def fresh():
        torch.manual_seed(1)
        return M.attach_adapter(M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0), adapter)

    src = fresh()
    with torch.no_grad():
        for n, p in src.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    state = M.adapter_state(src)
    from peft import get_peft_model_state_dict

    peft_state = get_peft_model_state_dict(src)  # the saved state is PEFT's, in PEFT's order
    assert list(state) == list(peft_state) and all(torch.equal(state[k], peft_state[k]) for k in state)
    fast, ref = fresh(), fresh()
    M.load_adapter_state(fast, state)
    assert M._adapter_parameters(fast) is not None  # the in-place path ran
    set_peft_model_state_dict(ref, state)
    a, b = dict(fast.named_parameters()), dict(ref.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], dict(fresh().named_parameters())[k]) for k in a if a[k].requires_grad)
    wider = {k: v.double() for k, v in state.items()}  # another dtype: PEFT's load casts, as before
    M.load_adapter_state(fast, wider)
    assert all(torch.equal(a[k], b[k]) for k in a)
    missing = dict(list(state.items())[1:])
    with pytest.raises(ValueError, match="missing"):
        M.load_adapter_state(fast, missing)


def test_answer_text_shows_ids_the_tokenizer_lacks_and_drops_the_closing_eos(tiny):
    from stages.generate import answer_text

    _, tok, toks, _, prefixes = tiny
    known = list(prefixes[0][:5])
    n = len(tok)
    assert answer_text(tok, known + [toks.eos], toks.eos) == tok.decode(known, skip_special_tokens=False)
    # a padded vocabulary (the 27B shape: 248,320 rows over a small tokenizer): unknown ids stay visible and distinct
    a = answer_text(tok, known[:2] + [n + 7] + known[2:] + [toks.eos], toks.eos)
    b = answer_text(tok, known[:2] + [n + 8] + known[2:], toks.eos)
    assert a == tok.decode(known[:2], skip_special_tokens=False) + f"<|id:{n + 7}|>" + \
        tok.decode(known[2:], skip_special_tokens=False)
    assert a != b and answer_text(tok, [n, n + 1], toks.eos) == f"<|id:{n}|><|id:{n + 1}|>"


def test_train_final_norm_trains_exactly_the_final_norm_in_full(tiny):
    """adapter.train_final_norm: the final RMSNorm's weight (and no other norm: every GDN layer has a gated `norm`)
    is trained in full beside the adapter, as an FP32 master starting at the base's value; it is part of the saved
    adapter state, and scaling it sharpens the output distribution (what a low-rank adapter under the norm cannot)."""
    cfg, tok, toks, _, prefixes = tiny

    def build(train: bool):
        torch.manual_seed(1)
        base = M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0, dtype="bfloat16")
        return base, M.attach_adapter(base, cfg.adapter.model_copy(update={"train_final_norm": train}))

    base, on = build(True)
    full = [(n, p) for n, p in on.named_parameters() if p.requires_grad and M.is_trained_module_param(n)]
    assert [n for n, _ in full] == ["base_model.model.model.norm.modules_to_save.default.weight"]
    (_, w), = full
    assert w.dtype == torch.float32 and w.shape == (cfg.model.arch["hidden_size"],)
    assert torch.equal(w, base.model.norm.original_module.weight.float())
    assert all("lora_" in n for n, p in on.named_parameters() if p.requires_grad and not M.is_trained_module_param(n))
    assert any("norm" in k and "lora" not in k for k in M.adapter_state(on))
    _, off = build(False)
    assert not any(M.is_trained_module_param(n) for n, _ in off.named_parameters())
    assert len(M.adapter_state(on)) == len(M.adapter_state(off)) + 1

    x = torch.tensor([prefixes[0]])
    with torch.no_grad():
        before = torch.log_softmax(on(input_ids=x).logits[0, -1].float(), -1)
        w.add_(0.5)  # (1 + w) scales the normalized hidden state: larger logits, lower entropy
        after = torch.log_softmax(on(input_ids=x).logits[0, -1].float(), -1)
    entropy = lambda lp: float(-(lp.exp() * lp).sum())
    assert entropy(after) < entropy(before)


def test_base_export_of_a_model_training_the_final_norm_has_the_plain_models_names(tiny):
    """The export (engine.nf4.iter_bf16_state, what the sampler's base copy and load_state_into read) of a model whose
    final norm PEFT wraps (modules_to_save) names the base's norm as the plain model does, with the base's value;
    the trained copy is an adapter tensor and stays out. (At 27B on the H200 the wrapper's `original_module` name
    broke the NF4 export: 'model has no tensor model.norm.original_module.weight'.)"""
    from engine import nf4

    cfg, tok, toks, _, _ = tiny
    torch.manual_seed(1)
    plain = M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0)
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    model = M.attach_adapter(M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0),
                             cfg.adapter.model_copy(update={"train_final_norm": True}))
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if M.is_trained_module_param(n)).add_(0.5)  # trained away
    got = dict(nf4.iter_bf16_state(model, dtype=torch.float32))
    assert set(got) == set(want) - {"lm_head.weight"}  # tied to the embeddings: once
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert nf4.load_state_into(plain, got) == len(got)


def test_final_norm_lr_has_its_own_adamw_group_and_the_state_reloads_in_parameter_order(tiny, tmp_path):
    """AdamW keeps the adapter at optimizer.lr and the final norm at optimizer.final_norm_lr; the state written in the
    parameters' order reloads onto the right parameter whatever the groups' order (bit for bit), and a config that
    trains the norm with the vLLM sampler is refused at load."""
    from artifacts import write_tensors
    from configs.schema import ConfigError
    from stages import optimize as O

    cfg = load_config("tiny", {"adapter.train_final_norm": True, "optimizer.final_norm_lr": 0.02,
                               "optimizer.lr": 0.002})
    _, tok, toks, _, prefixes = tiny
    torch.manual_seed(1)
    model = M.attach_adapter(M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, seed=0), cfg.adapter)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = params[-1:] + params[:-1]  # the norm first: state index != position in the groups
    assert M.is_trained_module_param(params[0][0])
    opt = O._optimizer(cfg, params, None)
    assert [(len(g["params"]), g["lr"]) for g in opt.param_groups] == [(len(params) - 1, 0.002), (1, 0.02)]
    x = torch.tensor([prefixes[0]])
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=x).logits.float().pow(2).mean().backward()
        opt.step()
    tensors, meta = O._optimizer_tensors(opt, params)
    write_tensors(tmp_path / "opt.safetensors", tensors, meta)
    again = O._optimizer(cfg, params, str(tmp_path / "opt.safetensors"))
    for _, p in params:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[p][k].cpu(), opt.state[p][k].cpu()), k
    assert [g["lr"] for g in again.param_groups] == [0.002, 0.02]
    with pytest.raises(ConfigError, match="vLLM's LoRA"):
        load_config("tiny", {"adapter.train_final_norm": True, "sampler.kind": "vllm", "model.dtype": "bfloat16"})
