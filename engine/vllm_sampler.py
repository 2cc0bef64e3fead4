"""The vLLM sampler (`sampler.kind: vllm`): answers from prompt embeddings in an in-process vLLM engine.

Per model turn the sampler gets, for every active row, the prompt embeddings embed(c_t ⊕ <think>) ⊕ z_1..z_K ⊕
embed(</think>) and returns the answer ids and the processed (post-temperature) log-probs of the sampled tokens,
with the semantics of :func:`engine.answers.sample_answers`: a row stops after <|im_end|> (kept as its last token),
after `max_new` tokens or after its `limits[i]` tokens. Row i samples with its own seed (rank seed, call seed, i), so
its tokens do not depend on the other rows or on the batch.

Adapters: :meth:`VllmSampler.use_adapter` is called at the start of every rollout round with the current adapter
directory; the engine switches by the directory's content digest, so exactly one adapter is active and new content
always reloads.
- LoRA (``adapter_path="request"``, the default): a new ``LoRARequest`` id per adapter digest, the previous one
  removed from the engine; all requests of a call carry the same request, so base-model and LoRA requests are never
  mixed in one batch (on CPU that mix gives wrong tokens, an upstream bug).
- DoRA (always) and LoRA with ``adapter_path="dense"``: vLLM rejects DoRA adapters, and a merged BF16 weight would
  round the adapter's ~1e-4 relative contribution away (the "rounded twice" bug of merged adapters in another form). The sampler
  adds the adapter to vLLM's own linear layers with PEFT's arithmetic instead: vLLM computes the BF16 base output, a
  forward hook computes the LoRA term in FP32 from the FP32 masters and combines base output, LoRA term and magnitude
  in FP32, rounding once — the trainer's formula, for single and packed layers alike (:class:`DenseAdapter`).

Teacher-forced scoring for the probe: :meth:`VllmSampler.teacher_forced` (full-vocabulary post-temperature log-probs).
Run config -> sampler: :func:`from_run_config` (per-rank seed, cache root inside the run directory).

Engine settings (seed-learned, :func:`engine_kwargs`): on GPU no torch.compile (compilation mode 0) with CUDA graphs
for decode only (FULL_DECODE_ONLY) and FlashAttention pinned; MTP speculation available but off by default; MTP
together with prefix caching on a hybrid model rejected before any model loads (:func:`check_mtp_prefix_caching`).

Process environment (:func:`prepare_environment`, before vLLM is imported): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(engine core in this process), vLLM's cache root inside the run directory, no usage stats, and on CPU no OpenMP
thread binding. vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op, drops torch to 1 thread and reseeds
the global RNGs; the sampler restores all three after the engine starts, because the trainer shares this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

GPU_ATTENTION_BACKEND = "FLASH_ATTN"  # pinned: vLLM picked FlashInfer, whose JIT build needed CUDA headers (seed 000)
CPU_ATTENTION_BACKEND = "CPU_ATTN"  # the only one vLLM's CPU platform accepts
CPU_KV_CACHE_BYTES = 256 * 2**20  # explicit: vLLM's CPU default reserves 92 % of the NUMA node and refuses to start
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for max_lora_rank


class EngineSettingsError(ValueError):
    """An engine configuration that must not run; raised before any model loads."""


# ----------------------------------------------------------------------------------------------------------------
# engine settings (no vLLM import)


def model_is_hybrid(model_dir: str | Path) -> bool:
    """True when the checkpoint's config has recurrent (Gated DeltaNet / Mamba) layers next to attention."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    kinds = set(cfg.get("layer_types") or [])
    return bool(kinds - {"full_attention", "sliding_attention", "attention"})


def check_mtp_prefix_caching(mtp_tokens: int, prefix_caching: bool, hybrid: bool) -> None:
    """Reject MTP speculation together with prefix caching on a hybrid model (before any model loads)."""
    if mtp_tokens > 0 and prefix_caching and hybrid:
        raise EngineSettingsError(
            "MTP speculation together with prefix caching is rejected on a hybrid (Gated DeltaNet + attention) model: "
            "vLLM caches the recurrent GDN states at block boundaries (mamba_cache_mode 'align', experimental), and "
            "speculative decoding verifies draft tokens and rolls rejected ones back, so a later turn that reuses a "
            "cached prefix can start from a recurrent state that does not match its tokens. Only the sampling "
            "log-probs show it (a deterministic 1-2 nat gap on single tokens; the rollout parity gate fails), and in "
            "RL they enter the gradient. Turn one of them off: MTP (num_speculative_tokens 0, the default) or "
            "prefix caching (enable_prefix_caching false, the default).")


def engine_kwargs(*, model: str, tokenizer: str | None, device: str, seed: int, max_model_len: int,
                  dtype: str = "bfloat16", adapter: str | None = "lora", max_lora_rank: int = 16,
                  prefix_caching: bool = False, mtp_tokens: int = 0, attention_backend: str | None = None,
                  kv_cache_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                  max_num_seqs: int | None = None, hybrid: bool = True) -> dict:
    """The keyword arguments of ``vllm.LLM`` for a trainer engine.

    adapter: "lora" (served through LoRARequest), "dense" (added by :class:`DenseAdapter`; vLLM's LoRA stays off)
    or None (base only). Raises :class:`EngineSettingsError` for a combination that must not run.
    """
    if dtype != "bfloat16":
        raise EngineSettingsError(f"the vLLM sampler runs in bfloat16, got {dtype}: vLLM's Gated DeltaNet kernels "
                                  "(CPU included) need bf16")
    check_mtp_prefix_caching(mtp_tokens, prefix_caching, hybrid)
    kw: dict = dict(
        model=model, tokenizer=tokenizer or model, dtype=dtype, seed=seed, max_model_len=max_model_len,
        enable_prompt_embeds=True,            # answers come from prompt embeddings (thoughts are vectors)
        logprobs_mode="processed_logprobs",   # log-probs after temperature: what the trainer's replay computes
        generation_config="vllm",             # never inherit sampling defaults (top_k, ...) from the checkpoint
        enable_prefix_caching=bool(prefix_caching),  # explicit: vLLM turns it on by default, hybrid models included
        max_logprobs=-1,                      # the teacher-forced probe reads full-vocabulary log-probs
        attention_backend=attention_backend or (GPU_ATTENTION_BACKEND if device == "cuda" else CPU_ATTENTION_BACKEND),
    )
    if device == "cuda":
        # no torch.compile: vLLM's compiled graph computed a different adapter contribution on the Qwen3.5 hybrid;
        # prefill runs eagerly, decode in full CUDA graphs (bitwise equal to eager)
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        if gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        kw["compilation_config"] = {"mode": 0}
        kw["enforce_eager"] = True  # no graphs on CPU
        kw["kv_cache_memory_bytes"] = int(kv_cache_bytes or CPU_KV_CACHE_BYTES)
    if adapter == "lora":
        rank = next((r for r in LORA_RANKS if r >= max_lora_rank), None)
        if rank is None:
            raise EngineSettingsError(f"adapter rank {max_lora_rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
        kw.update(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=1)
    if mtp_tokens > 0:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": int(mtp_tokens)}
    if max_num_seqs is not None:
        kw["max_num_seqs"] = int(max_num_seqs)
    return kw


def prepare_environment(cache_root: str | Path | None, device: str) -> None:
    """Process environment vLLM reads at import: in-process engine core, cache root, no usage stats, threads."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: ~3 s start instead of ~40 s
    if cache_root is not None:
        root = Path(cache_root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        os.environ["VLLM_CACHE_ROOT"] = str(root)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if device != "cuda":
        # the engine shares the process with the trainer: do not pin this process's OpenMP threads to cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def row_seed(engine_seed: int, call_seed: int, row: int) -> int:
    """The per-request sampling seed of row `row`: a function of (rank seed, call seed, row) only."""
    h = hashlib.sha256(f"{engine_seed}:{call_seed}:{row}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _field(obj, name: str, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def sampler_settings(cfg, export_dir: str | Path, tok_dir: str | Path, run_dir: str | Path, rank: int = 0) -> dict:
    """VllmSampler keyword arguments for a run config (``configs.schema.RunConfig``) on worker `rank`.

    seed: derived from (run seed, "vllm", rank), so every rank samples its own random streams; cache root:
    <run_dir>/cache/vllm; max_model_len: the longest turn the gym allows (question allowance 256 + token budget +
    thoughts + 2), capped by the checkpoint's max_position_embeddings.
    """
    from artifacts import RunDir

    cfg_json = json.loads((Path(export_dir) / "config.json").read_text())
    cfg_json = cfg_json.get("text_config", cfg_json)
    need = 256 + cfg.gym.token_budget + cfg.latent.max_latent_steps + 2
    max_pos = int(cfg_json.get("max_position_embeddings") or need)
    h = hashlib.sha256(f"{cfg.seed}:vllm:{rank}".encode()).digest()
    return dict(export_dir=str(export_dir), tok_dir=str(tok_dir), adapter=cfg.adapter,
                seed=int.from_bytes(h[:4], "little") >> 1, max_model_len=min(need, max_pos),
                cache_root=str(RunDir(run_dir).vllm_cache()), threads=cfg.threads or 1)


# ----------------------------------------------------------------------------------------------------------------
# the dense adapter path (DoRA always; LoRA with adapter_path="dense")

# HF module name -> (vLLM packed module, its members in packed order)
PACKED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "in_proj_qkv": ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")),
    "in_proj_z": ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")),
    "in_proj_b": ("in_proj_ba", ("in_proj_b", "in_proj_a")),
    "in_proj_a": ("in_proj_ba", ("in_proj_b", "in_proj_a")),
}
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<mod>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_magnitude_vector)$")


def adapter_modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT state dict -> {HF module name: {"A", "B"[, "m"]}} in FP32."""
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        m = _PEFT_KEY.match(k)
        if not m:
            raise ValueError(f"adapter tensor {k!r} is not a PEFT LoRA/DoRA Linear weight")
        kind = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_magnitude_vector": "m"}[m["kind"]]
        mods.setdefault(m["mod"], {})[kind] = v.detach().float().contiguous()
    for name, d in mods.items():
        if "A" not in d or "B" not in d:
            raise ValueError(f"adapter module {name} lacks lora_A or lora_B")
    return mods


def dora_scale(weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, magnitude: torch.Tensor,
               scaling: float) -> torch.Tensor:
    """m / ||W + s·BA||_row as (1, out) FP32, with PEFT's arithmetic (DoraLinearLayer.get_lora_weight/_weight_norm)."""
    eye = torch.eye(A.shape[1], dtype=A.dtype, device=A.device)
    lora_weight = torch.nn.functional.linear(torch.nn.functional.linear(eye, A), B).T
    w = weight.to(lora_weight.dtype) + scaling * lora_weight
    norm = torch.linalg.norm(w, dim=1).to(w.dtype)
    return (magnitude / norm).view(1, -1)


def lora_combine(base: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
                 mag_scale: torch.Tensor | None) -> torch.Tensor:
    """PEFT's LoRA/DoRA Linear forward given the base output: FP32 LoRA term, combined in FP32, rounded once.

    base: the base layer's output (model dtype); x: the layer's input (model dtype). Same op order as PEFT 0.21
    (lora.Linear.forward, DoraLinearVariant.forward, DoraLinearLayer.forward in eval mode).
    """
    xf = x.to(A.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xf, A), B)
    if mag_scale is None:
        out = base + lora * scaling
    else:
        out = base + ((mag_scale - 1) * base + mag_scale * lora * scaling)
    return out.to(base.dtype)


def lora_combine_rounding_twice(base, x, A, B, scaling, mag_scale):
    """The bug of seed 001 §3, kept for the tests: base + LoRA term rounded to BF16, magnitude applied after."""
    xf = x.to(A.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xf, A), B)
    y = (base + lora * scaling).to(base.dtype)
    return (mag_scale * y).to(base.dtype)


@dataclass
class _Slice:
    name: str        # HF module name, e.g. model.layers.0.linear_attn.in_proj_qkv
    start: int       # first output row in the vLLM layer
    size: int
    A: torch.Tensor  # (r, in) FP32
    B: torch.Tensor  # (out, r) FP32
    mag_scale: torch.Tensor | None  # (1, out) FP32 for DoRA: m / ||W + s·BA||_row


class _Checkpoint:
    """Lazy access to the export checkpoint's tensors by HF name (memory-mapped; nothing loads up front)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self._open = safe_open
        self.where: dict[str, tuple[str, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    hf = k.replace("model.language_model.", "model.")
                    self.where[hf] = (str(f), k)
                    self.shapes[hf] = tuple(st.get_slice(k).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        f, k = self.where[name]
        with self._open(f, framework="pt") as st:
            return st.get_tensor(k)


class DenseAdapter:
    """One LoRA/DoRA adapter added to a vLLM model's linear layers through forward hooks, with PEFT's arithmetic.

    Installed right after the weights load (before vLLM warms up or captures CUDA graphs) with zero LoRA weights and
    unit magnitude scales, which leave every output bit-identical to the base; :meth:`load` copies each adapter
    version into the same buffers in place, so captured graphs replay the current adapter. Slices of a packed vLLM
    layer (qkv_proj, gate_up_proj, in_proj_qkvz, in_proj_ba) follow the packed order with sizes from the checkpoint;
    the first slice of every kind is checked against the checkpoint where vLLM keeps the weight.
    """

    def __init__(self, ckpt: _Checkpoint, targets: list[str], rank: int, scaling: float, dora: bool):
        self.ckpt, self.rank, self.scaling, self.dora = ckpt, int(rank), float(scaling), bool(dora)
        leafs = set(targets)
        self.names = sorted(n[: -len(".weight")] for n, shp in ckpt.shapes.items()
                            if n.endswith(".weight") and n.startswith("model.layers.") and len(shp) == 2
                            and n[: -len(".weight")].rsplit(".", 1)[1] in leafs)
        if not self.names:
            raise ValueError(f"no Linear module of the checkpoint matches the adapter targets {sorted(leafs)}")
        self.slices: dict[str, list[_Slice]] = {}
        self.hooks: list = []
        self.modules: dict[str, torch.nn.Module] = {}

    def locate(self, name: str) -> tuple[str, int, int]:
        """HF module name -> (vLLM module name, first output row, rows)."""
        parent, leaf = name.rsplit(".", 1)
        size = self.ckpt.shapes[f"{name}.weight"][0]
        if leaf not in PACKED:
            return name, 0, size
        packed, members = PACKED[leaf]
        start = 0
        for mbr in members:
            if mbr == leaf:
                break
            start += self.ckpt.shapes[f"{parent}.{mbr}.weight"][0]
        return f"{parent}.{packed}", start, size

    def install(self, model: torch.nn.Module) -> None:
        self.modules = dict(model.named_modules())
        device = next(model.parameters()).device
        checked = set()
        for name in self.names:
            vname, start, size = self.locate(name)
            if vname not in self.modules:
                raise KeyError(f"adapter module {name}: the vLLM model has no module {vname}")
            vw = getattr(self.modules[vname], "weight", None)
            kind = (vname.rsplit(".", 1)[1], start)
            if kind not in checked and vw is not None and vw.dim() == 2 and vw.numel():
                if not torch.equal(vw[start:start + size].cpu(), self.ckpt.tensor(f"{name}.weight").to(vw.dtype)):
                    raise RuntimeError(f"{vname}[{start}:{start + size}] differs from the checkpoint's {name}: vLLM's "
                                       "packed layout is not the one assumed here")
                checked.add(kind)
            in_f = self.ckpt.shapes[f"{name}.weight"][1]
            A = torch.zeros(self.rank, in_f, dtype=torch.float32, device=device)
            B = torch.zeros(size, self.rank, dtype=torch.float32, device=device)
            ms = torch.ones(1, size, dtype=torch.float32, device=device) if self.dora else None
            self.slices.setdefault(vname, []).append(_Slice(name, start, size, A, B, ms))
        for vname in self.slices:
            self.hooks.append(self.modules[vname].register_forward_hook(self._hook(self.slices[vname])))

    def _hook(self, slices: list[_Slice]):
        def hook(module, args, output):
            x = args[0]
            out = output[0] if isinstance(output, tuple) else output
            for s in slices:
                base = out[..., s.start:s.start + s.size]
                out[..., s.start:s.start + s.size] = lora_combine(base, x, s.A, s.B, self.scaling, s.mag_scale)
            return output
        return hook

    def base_weight(self, vname: str, s: _Slice) -> torch.Tensor:
        vw = getattr(self.modules[vname], "weight", None)
        if vw is not None and vw.dim() == 2 and vw.numel():
            return vw[s.start:s.start + s.size]
        return self.ckpt.tensor(f"{s.name}.weight").to(s.A.device)  # vLLM repacked it (oneDNN): read the checkpoint

    def load(self, mods: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """Copy an adapter (:func:`adapter_modules` output) into the buffers; None restores the base exactly."""
        if mods is not None:
            extra, missing = sorted(set(mods) - set(self.names)), sorted(set(self.names) - set(mods))
            if extra or missing:
                raise ValueError(f"adapter modules differ from the engine's targets: extra {extra[:3]}, missing "
                                 f"{missing[:3]} (targets are fixed when the engine starts)")
        for vname, slices in self.slices.items():
            for s in slices:
                if mods is None:
                    s.A.zero_()
                    s.B.zero_()
                    if s.mag_scale is not None:
                        s.mag_scale.fill_(1.0)
                    continue
                d = mods[s.name]
                if tuple(d["A"].shape) != tuple(s.A.shape) or tuple(d["B"].shape) != tuple(s.B.shape):
                    raise ValueError(f"{s.name}: adapter shapes {tuple(d['A'].shape)}/{tuple(d['B'].shape)} differ "
                                     f"from the engine's {tuple(s.A.shape)}/{tuple(s.B.shape)} (the rank is fixed)")
                if self.dora != ("m" in d):
                    raise ValueError(f"{s.name}: a {'DoRA' if self.dora else 'LoRA'} engine got a "
                                     f"{'LoRA' if self.dora else 'DoRA'} adapter")
                s.A.copy_(d["A"])
                s.B.copy_(d["B"])
                if s.mag_scale is not None:
                    s.mag_scale.copy_(dora_scale(self.base_weight(vname, s), s.A, s.B, d["m"].to(s.A.device),
                                                 self.scaling))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


@contextmanager
def _after_model_load(callback):
    """Run `callback(model)` in vLLM's worker right after the weights load, before warm-up and CUDA graph capture.

    For the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0 with the uniproc or external_launcher executor).
    """
    from vllm.v1.worker import gpu_worker  # CPUWorker inherits Worker.load_model

    orig = gpu_worker.Worker.load_model
    calls: list[bool] = []

    def load_model(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        callback(self.model_runner.get_model())
        calls.append(True)

    gpu_worker.Worker.load_model = load_model
    try:
        yield calls
    finally:
        gpu_worker.Worker.load_model = orig


# ----------------------------------------------------------------------------------------------------------------
# the sampler


class VllmSampler:
    """An in-process vLLM engine that writes answers from prompt embeddings.

    export_dir: the export stage's BF16 checkpoint (values identical to the trainer's base); tok_dir: its tokenizer
    (default export_dir). adapter: the run's adapter config (``configs.schema.AdapterConfig`` or a dict with type,
    rank, alpha, targets), fixed for the engine's life; None serves the base only. adapter_path: "request" (LoRA via
    LoRARequest, default) or "dense" (PEFT arithmetic through hooks; DoRA always takes it). seed: this rank's seed —
    every rank must pass its own. cache_root: vLLM's cache root, inside the run directory. threads: torch threads
    while sampling on CPU (default 1, vLLM's own choice: multi-threaded CPU ops spin-wait); the caller's thread count
    is restored after every call.
    """

    def __init__(self, export_dir: str | Path, tok_dir: str | Path | None = None, *, adapter=None,
                 adapter_path: str = "request", seed: int = 0, max_model_len: int = 1024,
                 cache_root: str | Path | None = None, device: str | None = None, dtype: str = "bfloat16",
                 prefix_caching: bool = False, mtp_tokens: int = 0, attention_backend: str | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                 max_num_seqs: int | None = None, threads: int | None = 1,
                 distributed_executor_backend: str | None = None):
        if adapter_path not in ("request", "dense"):
            raise ValueError(f"adapter_path must be request or dense, got {adapter_path!r}")
        self.export_dir = Path(export_dir)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.threads = threads
        self.adapter_type = _field(adapter, "type")
        if self.adapter_type not in ("lora", "dora", None):
            raise ValueError(f"adapter type must be lora or dora, got {self.adapter_type!r}")
        self.dense = self.adapter_type == "dora" or (self.adapter_type == "lora" and adapter_path == "dense")
        rank = int(_field(adapter, "rank", 16))
        self.scaling = float(_field(adapter, "alpha", 2 * rank)) / rank
        self.hybrid = model_is_hybrid(self.export_dir)
        mode = None if self.adapter_type is None else ("dense" if self.dense else "lora")
        kwargs = engine_kwargs(
            model=str(self.export_dir), tokenizer=str(tok_dir or self.export_dir), device=self.device,
            seed=self.seed, max_model_len=self.max_model_len, dtype=dtype, adapter=mode, max_lora_rank=rank,
            prefix_caching=prefix_caching, mtp_tokens=mtp_tokens, attention_backend=attention_backend,
            kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            hybrid=self.hybrid)  # raises on a rejected combination before vLLM is imported or a model loads
        if distributed_executor_backend is not None:
            # "external_launcher": join the process group this rank already runs in (TRL's colocate mode)
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        self.engine_kwargs = kwargs
        cfg = json.loads((self.export_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        eos = cfg["eos_token_id"]
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self._dense: DenseAdapter | None = None
        if self.dense:
            self._dense = DenseAdapter(_Checkpoint(self.export_dir), list(_field(adapter, "targets")), rank,
                                       self.scaling, dora=self.adapter_type == "dora")

        prepare_environment(cache_root, self.device)
        t0 = time.perf_counter()
        from vllm import LLM  # after prepare_environment

        self.import_s = time.perf_counter() - t0
        set_threads, threads_before = torch.set_num_threads, torch.get_num_threads()
        rng = (torch.random.get_rng_state(), random.getstate(), _numpy_rng())
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        t0 = time.perf_counter()
        try:
            if self._dense is not None:
                with _after_model_load(self._dense.install) as calls:
                    self.llm = LLM(**kwargs)
                if not calls:
                    raise RuntimeError("the dense adapter was not installed: vLLM's engine is not in this process")
            else:
                self.llm = LLM(**kwargs)
        finally:
            # vLLM's CPU worker makes torch.set_num_threads a no-op, drops torch to 1 thread and reseeds the global
            # RNGs; the trainer shares this process
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads_before)
            torch.random.set_rng_state(rng[0])
            random.setstate(rng[1])
            _numpy_rng(rng[2])
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        self.start_s = time.perf_counter() - t0
        self.adapter_digest: str | None = None
        self.lora_request = None
        self._next_lora_id = 1

    # -- adapters ------------------------------------------------------------------------------------------------

    def model(self) -> torch.nn.Module:
        """The vLLM model object (in-process engine)."""
        return self.llm.apply_model(lambda m: m)[0]

    def use_adapter(self, adapter_dir: str | Path | None) -> bool:
        """Serve `adapter_dir` (a PEFT adapter directory) from now on; None serves the base. True when it switched.

        Switches by the directory's content digest: the same content is a no-op, new content always reloads.
        """
        from artifacts import read_adapter_dir
        from artifacts.store import content_digest

        digest = None if adapter_dir is None else content_digest(adapter_dir)  # as Engine.use_adapter
        if digest == self.adapter_digest:
            return False
        if adapter_dir is None:
            self._drop_lora()
            if self._dense is not None:
                self._dense.load(None)
            self.adapter_digest = None
            return True
        if self.adapter_type is None:
            raise ValueError(f"{adapter_dir}: this engine was built without an adapter (adapter=None)")
        config, tensors = read_adapter_dir(adapter_dir)
        is_dora = bool(config.get("use_dora"))
        if is_dora != (self.adapter_type == "dora"):
            raise ValueError(f"{adapter_dir}: a {'DoRA' if is_dora else 'LoRA'} adapter, but this engine was built for "
                             f"{self.adapter_type}")
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        scaling = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
        if self.dense:
            if scaling != self.scaling:
                raise ValueError(f"{adapter_dir}: scaling {scaling} differs from the engine's {self.scaling} "
                                 "(rank and alpha are fixed when the engine starts)")
            self._dense.load(adapter_modules(tensors))
        else:
            from vllm.lora.request import LoRARequest

            self._drop_lora()
            req = LoRARequest(lora_name=f"adapter-{digest[:16]}", lora_int_id=self._next_lora_id,
                              lora_path=str(Path(adapter_dir).resolve()))
            self._next_lora_id += 1
            if not self.llm.llm_engine.add_lora(req):  # load now: errors surface at the start of the round
                raise RuntimeError(f"vLLM did not load the adapter {adapter_dir}")
            self.lora_request = req
        self.adapter_digest = digest
        return True

    def _drop_lora(self) -> None:
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None

    # -- sampling ------------------------------------------------------------------------------------------------

    def sample(self, prompt_embeds: list[torch.Tensor], max_new: int, temperature: float,
               limits: list[int] | None = None, seed: int | list[int] = 0) -> tuple[list[list[int]], list[list[float]]]:
        """Answers from prompt embeddings [(L_i, d)]: token ids and processed (post-temperature) log-probs.

        A row stops after <|im_end|> (kept as its last token), after `max_new` tokens, after `limits[i]` tokens, or
        where max_model_len ends. Row i samples with seed row_seed(engine seed, seed, i), or, with a seed per row (a
        list: stages/generate.py's placement-independent row seeds), row_seed(0, seed[i], 0) whatever the rank. All rows of a call carry the
        same adapter request: base-model and LoRA requests are never mixed in one batch.
        """
        from vllm import SamplingParams

        if not 0.01 <= float(temperature) <= 2.0:
            raise ValueError(f"temperature {temperature}: vLLM samples at temperatures in [0.01, 2] (it rejects larger "
                             "ones and silently raises smaller ones to 0.01, which would break log-prob parity)")
        B = len(prompt_embeds)
        caps = [max_new if limits is None else max(0, min(max_new, int(limits[i]))) for i in range(B)]
        ids: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        live = [i for i in range(B) if caps[i] > 0]
        if not live:
            return ids, lps
        prompts, params = [], []
        for i in live:
            e = prompt_embeds[i].detach().to("cpu", torch.bfloat16)
            room = self.max_model_len - e.shape[0]
            if room < 1:
                raise ValueError(f"row {i}: a prompt of {e.shape[0]} positions leaves no room in max_model_len="
                                 f"{self.max_model_len}")
            prompts.append({"prompt_embeds": e})
            params.append(SamplingParams(
                n=1, temperature=float(temperature), top_p=1.0, top_k=0, min_p=0.0, max_tokens=min(caps[i], room),
                logprobs=0, seed=(row_seed(0, int(seed[i]), 0) if isinstance(seed, (list, tuple)) else
                                  row_seed(self.seed, seed, i)), stop_token_ids=[self.eos], ignore_eos=True,
                detokenize=False, skip_special_tokens=False))
        before = torch.get_num_threads()
        if self.device != "cuda" and self.threads:
            torch.set_num_threads(self.threads)
        try:
            outs = self._generate(prompts, params)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        for i, o in zip(live, outs):
            c = o.outputs[0]
            ids[i] = [int(t) for t in c.token_ids]
            lps[i] = [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]
        return ids, lps

    def teacher_forced(self, prompt_embeds: list[torch.Tensor], answers: list[list[int]],
                       temperature: float) -> list[torch.Tensor]:
        """Post-temperature log-softmax over the vocabulary at every answer position, teacher-forced: [(L_i, V)] fp32.

        The probe's scoring with the current adapter: position j of answer i is one request whose prompt embeddings
        are prompt_i ⊕ embed(a_1..a_{j-1}) (the checkpoint's embedding rows), sampling one token at `temperature`
        with the full vocabulary's processed log-probs. L_i prefills per answer: meant for a few probe prompts.
        """
        from vllm import SamplingParams

        if not 0.01 <= float(temperature) <= 2.0:
            raise ValueError(f"temperature {temperature}: vLLM samples at temperatures in [0.01, 2]")
        emb = self._embedding()
        reqs, where = [], []
        for i, (p, a) in enumerate(zip(prompt_embeds, answers)):
            p = p.detach().to("cpu", torch.bfloat16)
            for j in range(len(a)):
                e = torch.cat([p, emb[torch.tensor(a[:j], dtype=torch.long)]], 0) if j else p
                if e.shape[0] >= self.max_model_len:
                    raise ValueError(f"answer {i}: position {j} exceeds max_model_len={self.max_model_len}")
                reqs.append({"prompt_embeds": e})
                where.append((i, j))
        out = [torch.full((len(a), emb.shape[0]), float("-inf")) for a in answers]
        if not reqs:
            return out
        # no seed: only the processed log-probs are used, and a seeded request that vLLM prefills in chunks makes its
        # CPU worker rewind the request's generator, which CPU generators cannot do ("does not use offset")
        params = SamplingParams(n=1, temperature=float(temperature), top_p=1.0, top_k=0, min_p=0.0, max_tokens=1,
                                logprobs=-1, flat_logprobs=True, ignore_eos=True, detokenize=False)
        before = torch.get_num_threads()
        if self.device != "cuda" and self.threads:
            torch.set_num_threads(self.threads)
        try:
            res = self._generate(reqs, [params] * len(reqs))
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        for (i, j), o in zip(where, res):
            lp = o.outputs[0].logprobs
            lo, hi = lp.start_indices[0], lp.end_indices[0]
            out[i][j, torch.tensor(lp.token_ids[lo:hi], dtype=torch.long)] = torch.tensor(lp.logprobs[lo:hi])
        return out

    PREFILL_TOKENS_PER_CALL = 2048  # below vLLM's per-step token budget (4096): every prompt prefills in one piece

    def _generate(self, prompts: list[dict], params: list) -> list:
        """``llm.generate`` in groups whose prompts fit one scheduler step together, so no request is prefilled in
        chunks (vLLM 0.32's CPU worker then rewinds seeded generators, which CPU generators reject); per-request seeds
        make the results independent of the grouping."""
        outs, start = [], 0
        while start < len(prompts):
            end, total = start, 0
            while end < len(prompts) and (end == start or
                                          total + prompts[end]["prompt_embeds"].shape[0] <= self.PREFILL_TOKENS_PER_CALL):
                total += prompts[end]["prompt_embeds"].shape[0]
                end += 1
            outs += self.llm.generate(prompts[start:end], params[start:end], use_tqdm=False,
                                      lora_request=self.lora_request)
            start = end
        return outs

    def _embedding(self) -> torch.Tensor:
        if getattr(self, "_emb", None) is None:
            ckpt = self._dense.ckpt if self._dense is not None else _Checkpoint(self.export_dir)
            self._emb = ckpt.tensor("model.embed_tokens.weight").to(torch.bfloat16)
        return self._emb

    def close(self) -> None:
        """Stop the engine (tests; a worker restart)."""
        if self._dense is not None:
            self._dense.remove()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # idempotent
        import gc

        gc.collect()


def from_run_config(cfg, export_dir: str | Path, tok_dir: str | Path, run_dir: str | Path, rank: int = 0,
                    **overrides) -> VllmSampler:
    """The run's vLLM sampler on worker `rank` (see :func:`sampler_settings`); `overrides` win."""
    kw = {**sampler_settings(cfg, export_dir, tok_dir, run_dir, rank), **overrides}
    export = kw.pop("export_dir")
    return VllmSampler(export, kw.pop("tok_dir"), **kw)


def _numpy_rng(state=None):
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if state is None:
        return np.random.get_state()
    np.random.set_state(state)
    return None
