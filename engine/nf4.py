"""NF4 base for the trainer (bitsandbytes Linear4bit), FP32 LoRA/DoRA masters, and the BF16 copy for the sampler.

    model = load_base_nf4(path)                      # or quantize_nf4_(bf16_model) on a model already on the GPU
    model = engine.model.attach_adapter(model, cfg.adapter)   # PEFT wraps the Linear4bit layers; FP32 masters
    state = dequantized_bf16_state(model)            # HF names -> BF16 tensors: what the sampler loads
    write_bf16_export(model, out_dir)                # sharded safetensors + config.json (stages/export.py)
    report = verify_export(model, out_dir)           # every tensor equal to the trainer's dequantized weight, bitwise

"The trainer's dequantized weights" are `bitsandbytes.functional.dequantize_4bit(W, quant_state)` of each
Linear4bit: what PEFT's DoRA reads (peft.utils.integrations.dequantize_module_weight), what bitsandbytes' backward
multiplies with and what its dequantize+linear forward path uses. The sampler's BF16 copy holds exactly these values,
so both engines start from identical weights (the forward arithmetic still differs: bitsandbytes fuses
dequantization into its small-batch kernel; the rollout-parity gate measures that).

Quantized: the decoder layers' Linear modules named in `QUANTIZED` (all projections of GDN, attention and MLP --
QLoRA style); embeddings, lm_head, norms, conv1d and the GDN gate parameters stay BF16. Quantization needs a CUDA
device (bitsandbytes' NF4 kernels); importing this module does not touch CUDA or bitsandbytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
             "out_proj", "gate_proj", "up_proj", "down_proj")


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_linear4bit(mod) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(mod, bnb.nn.Linear4bit)


@torch.no_grad()
def quantize_nf4_(model, names=QUANTIZED, compute_dtype=torch.bfloat16, double_quant: bool = True,
                  blocksize: int = 64) -> int:
    """Replace the decoder layers' Linear modules named in `names` by bitsandbytes NF4 Linear4bit, in place, on
    the weights' CUDA device. Call before attaching the adapter. Returns the number of replaced layers."""
    base = _base(model)
    if any(hasattr(m, "lora_A") for m in base.modules()):
        raise ValueError("quantize the base before attaching the LoRA/DoRA adapter")
    return _quantize_modules_(base.model.layers, names, compute_dtype, double_quant, blocksize)


@torch.no_grad()
def _quantize_modules_(root, names=QUANTIZED, compute_dtype=torch.bfloat16, double_quant: bool = True,
                       blocksize: int = 64) -> int:
    """quantize_nf4_ on the Linear children (named in `names`) of `root`'s modules."""
    import bitsandbytes as bnb

    n = 0
    for parent in root.modules():
        for cname, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or cname not in names:
                continue
            w = child.weight.data
            if w.device.type != "cuda":
                raise ValueError(f"NF4 quantization needs the weights on a CUDA device, {cname} is on {w.device}")
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
            q.weight = bnb.nn.Params4bit(w.to(compute_dtype), requires_grad=False, blocksize=blocksize,
                                         compress_statistics=double_quant, quant_type="nf4",
                                         quant_storage=torch.uint8, module=q).to(w.device)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            q.train(child.training)
            setattr(parent, cname, q)
            del child, w
            n += 1
    return n


def load_base_nf4(path: str | Path, device: str = "cuda", names=QUANTIZED, double_quant: bool = True):
    """A BF16 checkpoint loaded onto `device` and quantized to NF4 there (the trainer's base)."""
    from transformers import Qwen3_5ForCausalLM

    from engine.model import load_base, random_base_manifest

    if random_base_manifest(path) is not None:
        # a random-base recipe: each decoder layer built in BF16 on the device and quantized as soon as it is complete
        # (the same values as quantizing the whole BF16 model; the 54 GB BF16 27B never exists at once)
        return load_base(path, "bfloat16", device,
                         after_layer=lambda layer: _quantize_modules_(layer, names, double_quant=double_quant))
    else:
        from artifacts.checkpoint import resolve

        model = Qwen3_5ForCausalLM.from_pretrained(str(resolve(path)), dtype=torch.bfloat16, device_map={"": device})
    quantize_nf4_(model, names=names, double_quant=double_quant)
    return model


def _dequantize(mod) -> torch.Tensor:
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state)


def _hf_name(module_name: str) -> str | None:
    """PEFT module name -> HF name of the base weight's module; None for adapter parts (LoRA/DoRA tensors, and the
    trained copy of a modules_to_save module: adapter.train_final_norm). The base copy a ModulesToSaveWrapper keeps
    (`original_module`) is the base's tensor under the wrapped module's name."""
    parts = module_name.split(".")
    if any(p.startswith("lora_") or p == "modules_to_save" for p in parts):
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def iter_bf16_state(model, dtype=torch.bfloat16):
    """(HF name, tensor) of the base, one at a time: Linear4bit layers dequantized (the trainer's values, a fresh
    tensor each), every other parameter and persistent buffer as held (cast to `dtype` if floating). Adapter tensors
    are skipped (the sampler loads the adapter separately); a tensor tied under two names appears once."""
    base = _base(model)
    persistent = set(base.state_dict().keys())
    seen: set[int] = set()
    with torch.no_grad():
        for mname, mod in base.named_modules():
            hf = _hf_name(mname)
            if hf is None:
                continue
            prefix = f"{hf}." if hf else ""
            if _is_linear4bit(mod):
                yield f"{prefix}weight", _dequantize(mod).to(dtype)
                if mod.bias is not None:
                    yield f"{prefix}bias", mod.bias.detach().to(dtype)
                continue
            if hasattr(mod, "lora_A"):  # a PEFT wrapper: its weights live in base_layer
                continue
            items = list(mod.named_parameters(recurse=False))
            items += [(b, t) for b, t in mod.named_buffers(recurse=False)
                      if (f"{mname}.{b}" if mname else b) in persistent]
            for pname, t in items:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                t = t.detach()
                yield f"{prefix}{pname}", (t.to(dtype) if t.is_floating_point() else t)


def dequantized_bf16_state(model, dtype=torch.bfloat16, device=None) -> dict[str, torch.Tensor]:
    """iter_bf16_state as a dict (the whole BF16 copy in memory: 54 GB for the 27B; prefer streaming there)."""
    return {k: (v if device is None else v.to(device)).contiguous() for k, v in iter_bf16_state(model, dtype)}


def write_bf16_export(model, out_dir: str | Path, shard_bytes: int = 5 * 2**30) -> dict:
    """Write the sampler's BF16 checkpoint, streaming (one shard in host memory at a time): sharded safetensors +
    index + config.json, loadable with Qwen3_5ForCausalLM.from_pretrained. Returns {"tensors", "bytes", "files"}."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, int] = {}
    cur: dict[str, torch.Tensor] = {}
    size = total = 0
    tmp_names: list[str] = []

    def flush():
        nonlocal cur, size
        if cur:
            name = f"shard-{len(tmp_names):05d}.tmp"
            save_file(cur, str(out / name), metadata={"format": "pt"})
            tmp_names.append(name)
            for k in cur:
                weight_map[k] = len(tmp_names) - 1
            cur, size = {}, 0

    for k, v in iter_bf16_state(model):
        nb = v.numel() * v.element_size()
        if cur and size + nb > shard_bytes:
            flush()
        cur[k] = v.detach().cpu().contiguous()
        size += nb
        total += nb
    flush()
    n = len(tmp_names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, final):
        (out / tmp).replace(out / name)
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in sorted(weight_map.items())}},
            indent=1))
    _base(model).config.save_pretrained(str(out))
    return {"tensors": len(weight_map), "bytes": total, "files": final}


def _read_export(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@torch.no_grad()
def verify_export(model, export) -> dict:
    """Check an export (a directory, a name -> tensor dict, or a BF16 model) against the trainer, streaming: every
    quantized weight equals dequantize_4bit of the trainer's Linear4bit bit for bit (values, dtype, shape), every
    other base tensor equals the trainer's. Returns {"equal", "tensors", "quantized", "mismatched", "missing",
    "extra"} (lists cut at 20)."""
    if isinstance(export, (str, Path)):
        exp = _read_export(Path(export))
    elif isinstance(export, dict):
        exp = export
    else:
        exp = dict(iter_bf16_state(export))  # a plain BF16 model: views, no copies
    quantized = {f"{_hf_name(n)}.weight" for n, m in _base(model).named_modules()
                 if _hf_name(n) is not None and _is_linear4bit(m)}
    mismatched, missing, names = [], [], set()
    for k, v in iter_bf16_state(model):
        names.add(k)
        if k not in exp:
            missing.append(k)
            continue
        e = exp[k]
        if e.dtype != v.dtype or e.shape != v.shape or not torch.equal(e.to(v.device), v):
            mismatched.append(k)
    extra = sorted(set(exp) - names)
    return {"equal": not mismatched and not missing and not extra, "tensors": len(names),
            "quantized": len(quantized & names), "mismatched": mismatched[:20], "missing": missing[:20],
            "extra": extra[:20]}


@torch.no_grad()
def load_state_into(model, state) -> int:
    """Copy an export into a plain (BF16) Qwen3_5ForCausalLM in place, checking names and shapes. `state`: a name ->
    tensor dict, or an NF4 trainer model (streamed: one dequantized tensor at a time, no 54 GB intermediate).
    Returns the number of tensors copied."""
    base = _base(model)
    persistent = set(base.state_dict().keys())
    own = dict(base.named_parameters())
    own.update({k: v for k, v in base.named_buffers() if k in persistent})
    items = state.items() if isinstance(state, dict) else iter_bf16_state(state)
    done = set()
    for k, v in items:
        if k not in own:
            raise KeyError(f"model has no tensor {k}")
        if own[k].shape != v.shape:
            raise ValueError(f"{k}: shape {tuple(v.shape)} vs the model's {tuple(own[k].shape)}")
        own[k].copy_(v)
        done.add(k)
    missing = [k for k in own if k not in done and not _tied(model, k)]
    if missing:
        raise KeyError(f"export lacks {missing[:3]}")
    return len(done)


def _tied(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(_base(model).config, "tie_word_embeddings", False))
