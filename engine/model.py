"""The model: the hybrid base (built, loaded, NF4 elsewhere), the adapter with FP32 masters, and what every run of
it shares (batching, tokens, the embedding scale). What runs the model lives beside it:
engine/latent.py (the latent loop), engine/answers.py (the hf sampler's answers), engine/scoring.py (replay scoring).

Shapes: B rows, P prefix tokens, K thoughts, L answer tokens, d hidden size.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.chat import ANSWER_OPEN, IM_END, PAD, THINK

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _gdn_default() -> None:
    from engine import gdn

    gdn.install_default()  # transformers would route GDN to fla whenever fla imports; the project chooses (engine/gdn.py)


_gdn_default()


# ----------------------------------------------------------------------------------------------------------------
# building and loading


def tiny_config(arch: dict, vocab_size: int, pad_id: int, eos_id: int):
    from transformers import Qwen3_5TextConfig

    arch = dict(arch)
    arch.setdefault("vocab_size", vocab_size)
    if arch["vocab_size"] != vocab_size:
        raise ValueError(f"model.arch.vocab_size={arch['vocab_size']} but the tokenizer has {vocab_size} tokens; drop the key")
    cfg = Qwen3_5TextConfig(pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, **arch)
    for name in ("linear_key_head_dim", "linear_value_head_dim"):
        if getattr(cfg, name) not in (64, 128):
            raise ValueError(f"model.arch.{name}={getattr(cfg, name)}: Gated DeltaNet kernels (vLLM CPU included) need 64 or 128")
    return cfg


def build_random_model(arch: dict, vocab_size: int, pad_id: int, eos_id: int, seed: int, dtype: str = "float32"):
    from transformers import Qwen3_5ForCausalLM

    cfg = tiny_config(arch, vocab_size, pad_id, eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(cfg)
    return model.to(DTYPES[dtype])


def _preorder(module):
    """``module.modules()``'s order without its memo: ``named_modules`` keeps every module it yielded in a set until
    the walk ends, so a decoder layer's BF16 Linear modules, replaced by NF4 ones in build_random_on's after_layer,
    stayed alive to the end of the build (the whole BF16 model's linear weights beside the NF4 ones: a 66 GB peak at
    the 27B shape against 18 GB; a second engine built beside the first ran out of memory on an 80 GB GPU:
    bench/results/h100-build-memory-27b-nf4-2026-12-07.json). Here a module is held only while the walk is inside it;
    a module reached twice is yielded once, as modules() does."""
    seen = set()

    def walk(mod):
        if id(mod) in seen:
            return
        seen.add(id(mod))  # an id, not the module: the walk never holds what it has left
        yield mod
        for child in list(mod._modules.values()):
            if child is not None:
                yield from walk(child)

    return walk(module)


RANDOM_BASE = "random_base.json"  # a base that is a recipe, not weights: arch + seed, built where it runs


def build_random_on(arch: dict, vocab_size: int, pad_id: int, eos_id: int, seed: int, dtype: torch.dtype,
                    device, std: float = 0.02, init: bool = True, after_layer=None):
    """Qwen3_5ForCausalLM with random weights built directly on `device`: meta build, each module's own tensors
    materialized (to_empty) just before its in-place init from one generator on that device (a 27B model in < 1 s
    on a GPU, never on the CPU). Deterministic in (arch, seed, device type). init=False leaves the weights unset for
    the caller to fill (e.g. from a dequantized NF4 base). after_layer(layer) runs once a decoder layer is complete
    (all its weights set), before the next one is materialized: the NF4 build quantizes there, so the whole BF16
    model never exists on the device at once (peak: the quantized model plus one BF16 layer; the walk is _preorder,
    which lets a replaced layer go: bench/build_memory.py measures it)."""
    from transformers import Qwen3_5ForCausalLM

    cfg = tiny_config(arch, vocab_size, pad_id, eos_id)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    device = torch.device(device)
    model = model.to(dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    last_of = {}  # id(last module of a decoder layer in modules() order) -> the layer
    for layer in model.model.layers:
        *_, last = layer.modules()
        last_of[id(last)] = layer
    done = set()
    with torch.no_grad():
        for mod in _preorder(model):
            mod.to_empty(device=device, recurse=False)
            name = type(mod).__name__
            if not init:
                pass
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d)):
                mod.weight.normal_(0, std, generator=g)
                done.add(id(mod.weight))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
                    done.add(id(mod.bias))
            elif name == "Qwen3_5RMSNorm":
                mod.weight.zero_()  # (1 + w) scaling
                done.add(id(mod.weight))
            elif name == "Qwen3_5RMSNormGated":
                mod.weight.fill_(1)
                done.add(id(mod.weight))
            elif name == "Qwen3_5GatedDeltaNet":
                mod.dt_bias.fill_(1)
                a = torch.empty(mod.A_log.shape, device=device, dtype=torch.float32).uniform_(0.01, 16, generator=g)
                mod.A_log.copy_(a.log())
                done.update({id(mod.dt_bias), id(mod.A_log)})
            if id(mod) in last_of:
                layer = last_of[id(mod)]
                missed = [n for n, p in layer.named_parameters() if id(p) not in done]
                if missed and init:
                    raise RuntimeError(f"uninitialized parameters: {missed[:5]}")
                done.difference_update(id(p) for p in layer.parameters())  # checked: ids of freed tensors get reused
                if after_layer is not None:
                    after_layer(layer)
    missed = [n for n, p in model.named_parameters() if id(p) not in done and not n.startswith("model.layers.")]
    if missed and init:
        raise RuntimeError(f"uninitialized parameters: {missed[:5]}")
    rot = model.model.rotary_emb  # non-persistent buffers (inv_freq) are garbage after to_empty
    model.model.rotary_emb = type(rot)(config=cfg).to(device)
    return model.eval()


def random_base_manifest(path: str | Path) -> dict | None:
    """The recipe of a `model.source: random` base directory, or None for a checkpoint."""
    import json

    f = Path(path) / RANDOM_BASE
    return json.loads(f.read_text()) if f.exists() else None


def load_base(path: str | Path, dtype: str, device: str | torch.device = "cpu", init: bool = True,
              after_layer=None):
    """A base from a checkpoint directory, or built on `device` from a random-base recipe (random_base.json);
    after_layer: see build_random_on (random bases only)."""
    from transformers import Qwen3_5ForCausalLM

    m = random_base_manifest(path)
    if m is not None:
        return build_random_on(m["arch"], m["vocab_size"], m["pad_id"], m["eos_id"], m["seed"], DTYPES[dtype],
                               device, m["std"], init=init, after_layer=after_layer)
    from artifacts.checkpoint import resolve

    # a run's reference to a checkpoint used in place (checked unchanged first), or a checkpoint directory; a
    # published Qwen3_5ForConditionalGeneration snapshot loads its text model (model.language_model.* keys, vision
    # and MTP weights left out: transformers maps and ignores them)
    return Qwen3_5ForCausalLM.from_pretrained(str(resolve(path)), dtype=DTYPES[dtype]).to(device)


def mtp_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The multi-token-prediction head's tensors (`mtp.*`) of a checkpoint, as stored; {} when it has none."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.startswith("mtp."):
                    out[k] = st.get_tensor(k)
    return out


FP32_ATTENTION = "lgrpo_sdpa_fp32"  # an attention implementation registered with transformers by use_fp32_attention


def _sdpa_fp32(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention on FP32 copies of q, k, v (BF16 values are exact in FP32): scores, softmax and
    P·V in FP32, the output rounded once to the model dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, *args,
                                          **kwargs)
    return out.to(query.dtype), weights


def use_fp32_attention(model) -> None:
    """`model.attention_fp32`: every attention core of `model` computes in FP32 (`_sdpa_fp32`), in every layout --
    the latent loop's prefill and one-token steps, the static-cache decoder (whose short-query path is FP32 already),
    replay, activation-checkpoint recomputation.

    Why: with BF16 attention (SDPA in the model dtype), the latent loop (one query over a cache) and replay (the whole
    turn at once) round the attention output differently in a few elements; the residual stream carries that into
    mu, and log q = -|z - mu|^2 / (2 sigma^2) turns ulp-sized differences of mu into nats (the final norm and mu
    themselves are already computed in FP32 from the same BF16 residual: computing them in FP32 does not help)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP32_ATTENTION, _sdpa_fp32)
    AttentionMaskInterface.register(FP32_ATTENTION, sdpa_mask)
    text, _, _ = _parts(model)
    text.config._attn_implementation = FP32_ATTENTION


def attach_adapter(model, adapter_cfg):
    """Wrap `model` with a PEFT LoRA/DoRA adapter whose weights are FP32 masters; the base is frozen."""
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(
        r=adapter_cfg.rank,
        lora_alpha=adapter_cfg.alpha,
        lora_dropout=adapter_cfg.dropout,
        target_modules=list(adapter_cfg.targets),
        use_dora=adapter_cfg.type == "dora",
        bias="none",
        modules_to_save=[final_norm_name(model)] if getattr(adapter_cfg, "train_final_norm", False) else None,
    )
    peft_model = get_peft_model(model, lcfg)
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # FP32 masters
    return peft_model


def final_norm_name(model) -> str:
    """The module name of the model's final RMSNorm (`model.norm` in a Qwen3_5ForCausalLM), as PEFT's
    modules_to_save matches it: a suffix of exactly one module's name (no GDN layer's gated `norm` ends with it)."""
    text, _, _ = _parts(model)
    names = [n for n, m in model.named_modules() if m is text.norm]
    if len(names) != 1:
        raise ValueError(f"the final norm is {len(names)} modules of this model (expected 1): cannot train it")
    matching = [n for n, _ in model.named_modules() if n.endswith(names[0])]
    if matching != names:
        raise ValueError(f"the final norm's name {names[0]!r} is also the end of {matching}: cannot train it alone")
    return names[0]


def is_trained_module_param(name: str) -> bool:
    """A parameter PEFT trains in full (modules_to_save: the final norm with adapter.train_final_norm), by the name
    model.named_parameters() gives it."""
    return ".modules_to_save." in name


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's weights under PEFT's saved names, copied to the CPU (the tensors get_peft_model_state_dict gives,
    in its order; read from the parameters directly once they are known: every step saves one)."""
    params = _adapter_parameters(peft_model)
    if params is None:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(peft_model)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    return {k: p.detach().to("cpu", copy=True).contiguous() for k, p in params.items()}


def _adapter_parameters(peft_model) -> dict[str, torch.nn.Parameter] | None:
    """The adapter's parameters by their key in a saved adapter state (PEFT's names), found once per model through
    the storage PEFT's state dict shares with them; None when some key is not one parameter (then PEFT loads)."""
    cached = getattr(peft_model, "_lgrpo_adapter_parameters", False)
    if cached is not False:
        return cached
    from peft import get_peft_model_state_dict

    by_ptr = {(p.data_ptr(), tuple(p.shape), p.dtype): p for p in peft_model.parameters()}
    out: dict[str, torch.nn.Parameter] | None = {}
    for k, v in get_peft_model_state_dict(peft_model).items():
        p = by_ptr.get((v.data_ptr(), tuple(v.shape), v.dtype))
        if p is None:
            out = None
            break
        out[k] = p
    peft_model._lgrpo_adapter_parameters = out
    return out


def load_adapter_state(peft_model, tensors: dict[str, torch.Tensor]) -> None:
    """Load a saved adapter state into the model's adapter parameters. Every step loads the new adapter into the
    sampler: when the saved keys are exactly the model's adapter parameters with their shapes and dtypes, each is
    copied in place (the copy PEFT's `set_peft_model_state_dict` makes through `load_state_dict`, without its ~20 ms
    of key matching on the tiny model); anything else goes through PEFT."""
    from peft import set_peft_model_state_dict

    params = _adapter_parameters(peft_model)
    if params is not None and set(params) == set(tensors) and all(
            tuple(t.shape) == tuple(params[k].shape) and t.dtype == params[k].dtype for k, t in tensors.items()):
        with torch.no_grad():
            for k, t in tensors.items():
                params[k].copy_(t)
        return
    res = set_peft_model_state_dict(peft_model, tensors)
    missing = [k for k in res.missing_keys if "lora_" in k or "magnitude" in k]
    if missing:
        raise ValueError(f"adapter state is missing {len(missing)} tensors (e.g. {missing[0]}): rank/targets differ from the config")


def adapter_config_dict(peft_model) -> dict:
    d = peft_model.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


# ----------------------------------------------------------------------------------------------------------------
# batching helpers


@lru_cache(maxsize=1)
def _cache_arg() -> str:
    """The text model's cache argument: `cache` (transformers 5.2x) or `past_key_values` (5.17, the GPU machine's).

    Passing the wrong name is silently ignored by those versions (the model then decodes from an empty cache)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    return "cache" if "cache" in inspect.signature(Qwen3_5TextModel.forward).parameters else "past_key_values"


def cache_kw(cache) -> dict:
    """``**cache_kw(c)`` passes an incremental cache to the text model under the installed version's name."""
    return {_cache_arg(): cache}


def _parts(model):
    """(text model, lm_head, embedding) of a plain or PEFT-wrapped Qwen3_5ForCausalLM."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    return m.model, m.lm_head, m.model.embed_tokens


def left_pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """seqs: list of (L_i, d) -> embeds (B, L, d), attention mask (B, L), position ids (B, L); left padded."""
    B, L = len(seqs), max(s.shape[0] for s in seqs)
    d = seqs[0].shape[1]
    x = seqs[0].new_zeros(B, L, d)
    mask = torch.zeros(B, L, dtype=torch.long, device=x.device)
    for i, s in enumerate(seqs):
        x[i, L - s.shape[0]:] = s
        mask[i, L - s.shape[0]:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return x, mask, pos


@dataclass
class Tokens:
    """Ids of the chat-format special tokens."""

    pad: int
    eos: int  # <|im_end|>: end of a model answer
    think: int
    answer_open: int

    @classmethod
    def of(cls, tok) -> "Tokens":
        """The ids in `tok`: the project's tokenizers have <|pad|>; a checkpoint's (Qwen) pads with its pad token
        (<|endoftext|>)."""
        from engine.chat import EOS, _token_id

        pad = _token_id(tok, PAD)
        if pad is None:
            pad = tok.pad_token_id if tok.pad_token_id is not None else _token_id(tok, EOS)
        ids = {"pad": pad, **{k: _token_id(tok, t) for k, t in
                              (("eos", IM_END), ("think", THINK), ("answer_open", ANSWER_OPEN))}}
        missing = [k for k, v in ids.items() if v is None]
        if missing:
            raise ValueError(f"the tokenizer has no single token for {missing} ({PAD} or a pad token, {IM_END}, "
                             f"{THINK}, {ANSWER_OPEN}): the chat format needs them")
        return cls(**ids)


def embed_scale(model) -> float:
    """RMS of the embedding table: the scale latent thoughts are mapped to (mu = g(h))."""
    _, _, emb = _parts(model)
    return float(emb.weight.detach().float().pow(2).mean().sqrt())
