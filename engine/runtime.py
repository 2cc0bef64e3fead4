"""Long-lived engines of this process (the CPU worker): trainer model + adapter, sampler, tokenizer.

Stages are plain functions on artifact paths; they get their engines from here so models load once per process
and persist across tasks and steps. An engine switches adapters by the content digest of the adapter artifact,
so a stage always runs with exactly the adapter it was given (a stale adapter is impossible by construction).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import model as M


def set_threads(n: int | None) -> None:
    n = n or os.cpu_count() or 1
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@dataclass
class Engine:
    """One model (base + adapter) with the adapter it currently holds."""

    model: object
    toks: M.Tokens
    scale: float
    adapter_digest: str | None = None
    live: dict = field(default_factory=dict)  # replay digest -> per-turn tensors with autograd graph

    def use_adapter(self, adapter_dir: str | Path) -> None:
        from artifacts import dir_digest, read_adapter_dir

        digest = dir_digest(adapter_dir)
        if digest != self.adapter_digest:
            _, tensors = read_adapter_dir(adapter_dir)
            M.load_adapter_state(self.model, tensors)
            self.adapter_digest = digest
            self.live.clear()


_ENGINES: dict[tuple, Engine] = {}
_TOKENIZERS: dict[str, object] = {}


def tokenizer(tok_dir: str | Path):
    from engine.tokenizer import load_tokenizer

    key = str(Path(tok_dir).resolve())
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(tok_dir)
    return _TOKENIZERS[key]


def _build(model_dir: str | Path, tok_dir: str | Path, cfg) -> Engine:
    tok = tokenizer(tok_dir)
    base = M.load_base(model_dir, cfg.model.dtype)
    torch.manual_seed(cfg.seed)  # adapter init (overwritten by use_adapter anyway)
    model = M.attach_adapter(base, cfg.adapter)
    model.eval()
    return Engine(model=model, toks=M.Tokens.of(tok), scale=M.embed_scale(model))


def trainer(cfg, base_dir: str | Path, tok_dir: str | Path) -> Engine:
    """The policy the latent loop and replay run on: the base with FP32-master adapter weights."""
    key = ("trainer", str(Path(base_dir).resolve()), cfg.adapter.model_dump_json(), cfg.model.dtype)
    if key not in _ENGINES:
        _ENGINES[key] = _build(base_dir, tok_dir, cfg)
    return _ENGINES[key]


@dataclass
class VllmEngine:
    """The vLLM sampler (``engine.vllm_sampler.VllmSampler``) behind the Engine interface the stages use."""

    vllm: object
    toks: M.Tokens

    @property
    def adapter_digest(self) -> str | None:
        return self.vllm.adapter_digest

    def use_adapter(self, adapter_dir: str | Path) -> None:
        """Every rollout round: a new LoRARequest id per adapter version (exactly one active)."""
        self.vllm.use_adapter(adapter_dir)


def sampler(cfg, export_dir: str | Path, tok_dir: str | Path):
    """The sampler engine: the HF engine on its own copy of the base (the export stage's checkpoint), or vLLM
    loaded from that checkpoint (``sampler.kind: vllm``; its cache lives in the run directory <run>/export/..)."""
    key = ("sampler", cfg.sampler.kind, str(Path(export_dir).resolve()), cfg.adapter.model_dump_json(),
           cfg.model.dtype, cfg.sampler.model_dump_json())
    if key not in _ENGINES:
        if cfg.sampler.kind == "vllm":
            from engine.vllm_sampler import from_run_config

            run_dir = Path(export_dir).resolve().parents[1]  # <run>/export/<base hash>
            s = cfg.sampler
            _ENGINES[key] = VllmEngine(
                from_run_config(cfg, export_dir, tok_dir, run_dir, prefix_caching=s.prefix_caching,
                                mtp_tokens=s.mtp_tokens, attention_backend=s.attention_backend),
                M.Tokens.of(tokenizer(tok_dir)))
        else:
            _ENGINES[key] = _build(export_dir, tok_dir, cfg)
    return _ENGINES[key]


def clear() -> None:
    """Drop every engine of this process (tests; a worker restart)."""
    for engine in _ENGINES.values():
        if isinstance(engine, VllmEngine):
            engine.vllm.close()
    _ENGINES.clear()
    _TOKENIZERS.clear()
