"""The vLLM sampler (`sampler.kind: vllm`): answers from prompt embeddings in an in-process vLLM engine.

Per model turn the sampler gets, for every active row, the prompt embeddings embed(c_t ⊕ <think>) ⊕ z_1..z_K ⊕
embed(</think>) and returns the answer ids and the processed (post-temperature) log-probs of the sampled tokens,
with the semantics of :func:`engine.model.sample_answers`: a row stops after <|im_end|> (kept as its last token),
after `max_new` tokens or after its `limits[i]` tokens.

Adapters: :meth:`VllmSampler.use_adapter` is called at the start of every rollout round with the current adapter
directory; the engine switches by the directory's content digest, so exactly one adapter is active and a stale one
cannot be served.
- LoRA: a new ``LoRARequest`` id per adapter digest (the previous one is removed from the engine); every request of a
  batch carries the same request, so base-model and LoRA requests are never mixed in one batch (on CPU that mix gives
  wrong tokens, an upstream bug).
- DoRA: vLLM rejects DoRA adapters (and a merged BF16 weight would round the adapter's ~1e-4 contribution away).
  The sampler instead adds the adapter to vLLM's own linear layers with PEFT's arithmetic: vLLM computes the BF16 base
  output, a forward hook computes the LoRA term in FP32 from the FP32 masters and combines base output, LoRA term and
  magnitude in FP32, rounding once — the trainer's formula, for single and packed layers alike (``DenseAdapter``).
  ``adapter_path="dense"`` uses the same path for plain LoRA.

Engine settings (seed-learned, see ``engine_kwargs``): no torch.compile (compilation mode 0) with CUDA graphs for
decode only (FULL_DECODE_ONLY) on GPU, a pinned attention backend, MTP speculation available but off by default, and
MTP together with prefix caching on a hybrid model rejected before any model loads.

Process environment: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine core: ~3 s start instead of ~40 s), the
vLLM cache root inside the run directory, no usage stats, and on CPU no OpenMP thread binding. vLLM's CPU worker
replaces ``torch.set_num_threads`` by a no-op, sets torch to 1 thread and reseeds the global RNGs; the sampler
restores all three after the engine starts, because the trainer shares this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GPU_ATTENTION_BACKEND = "FLASH_ATTN"  # pinned: FlashInfer's JIT build needs CUDA headers (seed 000, Blackwell bring-up)
CPU_ATTENTION_BACKEND = "CPU_ATTN"  # the only one vLLM's CPU platform accepts
CPU_KV_CACHE_BYTES = 256 * 2**20  # explicit: vLLM's CPU default reserves 92 % of the NUMA node and refuses to start
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values


class EngineSettingsError(ValueError):
    """An engine configuration that must not run; raised before any model loads."""


# ----------------------------------------------------------------------------------------------------------------
# engine settings (importable without vLLM)


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
            "log-probs show it (a deterministic 1-2 nat gap on single tokens, the rollout parity gate fails), and in "
            "RL they enter the gradient. Turn one of them off: MTP (num_speculative_tokens: 0, the default) or "
            "prefix caching (enable_prefix_caching: false).")


def engine_kwargs(*, model: str, tokenizer: str | None, device: str, seed: int, max_model_len: int,
                  dtype: str = "bfloat16", adapter: str | None = "lora", max_lora_rank: int = 16,
                  prefix_caching: bool = False, mtp_tokens: int = 0, attention_backend: str | None = None,
                  kv_cache_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                  max_num_seqs: int | None = None, hybrid: bool = True) -> dict:
    """The keyword arguments of ``vllm.LLM`` for a trainer engine.

    adapter: "lora" (served through LoRARequest), "dense" (LoRA/DoRA added by ``DenseAdapter``; vLLM's LoRA off)
    or None (base only).
    """
    if dtype != "bfloat16":
        raise EngineSettingsError(f"the vLLM sampler runs in bfloat16 (got {dtype}): vLLM's Gated DeltaNet kernels "
                                  "(CPU included) need bf16")
    check_mtp_prefix_caching(mtp_tokens, prefix_caching, hybrid)
    kw: dict = dict(
        model=model, tokenizer=tokenizer or model, dtype=dtype, seed=seed, max_model_len=max_model_len,
        enable_prompt_embeds=True,            # answers are sampled from prompt embeddings (thoughts are vectors)
        logprobs_mode="processed_logprobs",   # log-probs after temperature: what the trainer's replay computes
        generation_config="vllm",             # never inherit sampling defaults (top_k, ...) from the checkpoint
        enable_prefix_caching=bool(prefix_caching),  # explicit: vLLM's default turns it on for hybrid models
        attention_backend=attention_backend or (GPU_ATTENTION_BACKEND if device == "cuda" else CPU_ATTENTION_BACKEND),
    )
    if device == "cuda":
        # no torch.compile (a compiled graph computed a different adapter contribution on the Qwen3.5 hybrid);
        # prefill eager, decode in full CUDA graphs (bitwise equal to eager)
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
    """The per-request sampling seed: a row's tokens depend on (rank seed, call seed, row) only, not on the batch."""
    h = hashlib.sha256(f"{engine_seed}:{call_seed}:{row}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ----------------------------------------------------------------------------------------------------------------
# the dense adapter path (DoRA always; LoRA with adapter_path="dense")

# PEFT module name -> (vLLM packed module, its members in packed order)
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
    """PEFT state dict -> {module name (e.g. model.layers.0.linear_attn.in_proj_qkv): {A, B[, m]}} in FP32."""
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
    """m / ||W + s·BA||_row, (1, out) FP32, with PEFT's arithmetic (DoraLinearLayer.get_lora_weight/get_weight_norm)."""
    eye = torch.eye(A.shape[1], dtype=A.dtype, device=A.device)
    lora_weight = torch.nn.functional.linear(torch.nn.functional.linear(eye, A), B).T
    w = weight.to(lora_weight.dtype) + scaling * lora_weight
    norm = torch.linalg.norm(w, dim=1).to(w.dtype)
    return (magnitude / norm).view(1, -1)


def lora_combine(base: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
                 mag_scale: torch.Tensor | None) -> torch.Tensor:
    """PEFT's LoRA/DoRA Linear forward given the base output: FP32 LoRA term, combined in FP32, rounded once.

    base: the base layer's output (model dtype); x: the layer input (model dtype). Returns base.dtype.
    """
    xf = x.to(A.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xf, A), B)
    if mag_scale is None:
        out = base + lora * scaling
    else:
        out = base + ((mag_scale - 1) * base + mag_scale * lora * scaling)
    return out.to(base.dtype)


def lora_combine_rounding_twice(base, x, A, B, scaling, mag_scale):
    """The bug of seed 001 §3, kept for the tests: base + LoRA rounded to bf16 first, magnitude applied after."""
    xf = x.to(A.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(xf, A), B)
    y = (base + lora * scaling).to(base.dtype)
    return (mag_scale * y).to(base.dtype)


@dataclass
class _Slice:
    name: str       # PEFT module name
    start: int      # first output row in the vLLM layer
    size: int
    A: torch.Tensor
    B: torch.Tensor
    mag_scale: torch.Tensor | None


class DenseAdapter:
    """Adds one LoRA/DoRA adapter to a vLLM model's linear layers through forward hooks (PEFT arithmetic).

    The slices of a packed vLLM layer (qkv_proj, gate_up_proj, in_proj_qkvz, in_proj_ba) follow the packed order, with
    sizes from the base checkpoint; where vLLM keeps the layer's weight, the slice is checked against the checkpoint.
    Tensors are updated in place on every adapter switch (CUDA graphs replay the same buffers).
    """

    def __init__(self, model: torch.nn.Module, base_weights: dict[str, torch.Tensor]):
        self.model = model
        self.base = base_weights  # HF name (model.layers.0.mlp.up_proj) -> weight (out, in), model dtype
        self.modules = dict(model.named_modules())
        self.slices: dict[str, list[_Slice]] = {}
        self.hooks = []

    def _locate(self, name: str) -> tuple[str, int, int]:
        """PEFT module name -> (vLLM module name, first output row, rows)."""
        parent, leaf = name.rsplit(".", 1)
        w = self.base[f"{name}.weight"]
        if leaf in PACKED:
            packed, members = PACKED[leaf]
            start = 0
            for mbr in members:
                if mbr == leaf:
                    break
                start += self.base[f"{parent}.{mbr}.weight"].shape[0]
            vname = f"{parent}.{packed}"
        else:
            vname, start = name, 0
        if vname not in self.modules:
            raise KeyError(f"adapter module {name}: vLLM model has no module {vname}")
        return vname, start, w.shape[0]

    def load(self, mods: dict[str, dict[str, torch.Tensor]], scaling: float, device: torch.device) -> None:
        new: dict[str, list[_Slice]] = {}
        for name, d in sorted(mods.items()):
            vname, start, size = self._locate(name)
            layer = self.modules[vname]
            vw = getattr(layer, "weight", None)
            if vw is not None and vw.dim() == 2 and vw.shape[0] >= start + size and vw.numel():
                if not torch.equal(vw[start:start + size].cpu(), self.base[f"{name}.weight"].to(vw.dtype)):
                    raise RuntimeError(f"{vname}[{start}:{start + size}] differs from the checkpoint's {name}: "
                                       "vLLM's packed layout is not the one assumed here")
            A, B = d["A"].to(device), d["B"].to(device)
            ms = None
            if "m" in d:
                ms = dora_scale(self.base[f"{name}.weight"].to(device), A, B, d["m"].to(device), scaling)
            new.setdefault(vname, []).append(_Slice(name, start, size, A, B, ms))
        same_layout = {k: [(s.name, s.start, s.size, s.mag_scale is None) for s in v] for k, v in new.items()} == \
                      {k: [(s.name, s.start, s.size, s.mag_scale is None) for s in v] for k, v in self.slices.items()}
        if same_layout:  # in place, so that captured CUDA graphs see the new values
            for k, v in new.items():
                for old, s in zip(self.slices[k], v):
                    old.A.copy_(s.A)
                    old.B.copy_(s.B)
                    if s.mag_scale is not None:
                        old.mag_scale.copy_(s.mag_scale)
        else:
            self.remove()
            self.slices = new
            for vname in new:
                self.hooks.append(self.modules[vname].register_forward_hook(self._hook(vname)))
        self.scaling = scaling

    def _hook(self, vname: str):
        def hook(module, args, output):
            x = args[0]
            out = output[0] if isinstance(output, tuple) else output
            for s in self.slices[vname]:
                base = out[..., s.start:s.start + s.size]
                out[..., s.start:s.start + s.size] = lora_combine(base, x, s.A, s.B, self.scaling, s.mag_scale)
            return output
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.slices = {}


def _read_base_weights(model_dir: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                hf = k.replace("model.language_model.", "model.")
                if hf in names:
                    out[hf] = st.get_tensor(k)
    missing = names - set(out)
    if missing:
        raise KeyError(f"base checkpoint {model_dir} lacks {sorted(missing)[:3]}...")
    return out


# ----------------------------------------------------------------------------------------------------------------
# the sampler


class VllmSampler:
    """An in-process vLLM engine that writes answers from prompt embeddings.

    export_dir: the export stage's BF16 checkpoint (values identical to the trainer's base); tok_dir: its tokenizer
    (default: export_dir). seed: this rank's seed (each rank must pass its own). cache_root: vLLM's cache root, inside
    the run directory. adapter_type: "lora" | "dora" | None (fixed for the engine's life); adapter_path: "request"
    (LoRA through LoRARequest, the default) or "dense" (PEFT arithmetic through hooks; DoRA always uses it).
    """

    def __init__(self, export_dir: str | Path, tok_dir: str | Path | None = None, *, seed: int = 0,
                 max_model_len: int = 1024, max_lora_rank: int = 16, adapter_type: str | None = "lora",
                 adapter_path: str = "request", cache_root: str | Path | None = None, device: str | None = None,
                 dtype: str = "bfloat16", prefix_caching: bool = False, mtp_tokens: int = 0,
                 attention_backend: str | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, max_num_seqs: int | None = None):
        if adapter_type not in ("lora", "dora", None):
            raise ValueError(f"adapter_type must be lora, dora or None, got {adapter_type!r}")
        if adapter_path not in ("request", "dense"):
            raise ValueError(f"adapter_path must be request or dense, got {adapter_path!r}")
        self.export_dir = Path(export_dir)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.adapter_type = adapter_type
        self.dense = adapter_type == "dora" or (adapter_type == "lora" and adapter_path == "dense")
        self.hybrid = model_is_hybrid(self.export_dir)
        mode = None if adapter_type is None else ("dense" if self.dense else "lora")
        kwargs = engine_kwargs(
            model=str(self.export_dir), tokenizer=str(tok_dir or self.export_dir), device=self.device,
            seed=self.seed, max_model_len=self.max_model_len, dtype=dtype, adapter=mode, max_lora_rank=max_lora_rank,
            prefix_caching=prefix_caching, mtp_tokens=mtp_tokens, attention_backend=attention_backend,
            kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            hybrid=self.hybrid)  # raises on a rejected combination before vLLM is imported
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"  # join this rank's group (as TRL colocate)
        self.engine_kwargs = kwargs
        prepare_environment(cache_root, self.device)
        cfg = json.loads((self.export_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        self.eos = int(cfg["eos_token_id"] if not isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"][0])

        t0 = time.perf_counter()
        from vllm import LLM  # after prepare_environment

        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        rng = (torch.random.get_rng_state(), random.getstate(), _numpy_state())
        try:
            self.llm = LLM(**kwargs)
        finally:
            # vLLM's CPU worker makes torch.set_num_threads a no-op, drops torch to 1 thread and reseeds the global
            # RNGs; the trainer shares this process
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            torch.random.set_rng_state(rng[0])
            random.setstate(rng[1])
            _numpy_state(rng[2])
        self.start_s = time.perf_counter() - t0
        self.adapter_digest: str | None = None
        self.lora_request = None
        self._next_lora_id = 1
        self._dense: DenseAdapter | None = None

    # -- adapters ------------------------------------------------------------------------------------------------

    def model(self) -> torch.nn.Module:
        """The vLLM model object (in-process engine only)."""
        return self.llm.apply_model(lambda m: m)[0]

    def use_adapter(self, adapter_dir: str | Path | None) -> bool:
        """Serve `adapter_dir` (a PEFT adapter directory) from now on; None serves the base. Returns True on a switch.

        Switches by the directory's content digest: the same content is a no-op, new content always reloads.
        """
        from artifacts import dir_digest, read_adapter_dir

        digest = None if adapter_dir is None else dir_digest(adapter_dir)
        if digest == self.adapter_digest and (digest is not None or self.lora_request is None):
            return False
        if adapter_dir is None:
            self._drop_lora()
            if self._dense is not None:
                self._dense.remove()
            self.adapter_digest = None
            return True
        config, tensors = read_adapter_dir(adapter_dir)
        is_dora = bool(config.get("use_dora"))
        if (is_dora and self.adapter_type != "dora") or (not is_dora and self.adapter_type != "lora"):
            raise ValueError(f"{adapter_dir}: a {'DoRA' if is_dora else 'LoRA'} adapter, but this engine was built for "
                             f"adapter_type={self.adapter_type!r}")
        if self.dense:
            mods = adapter_modules(tensors)
            r, alpha = int(config["r"]), float(config["lora_alpha"])
            scaling = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
            model = self.model()
            if self._dense is None:
                names = set()
                for name in mods:
                    parent, leaf = name.rsplit(".", 1)
                    names |= {f"{parent}.{m}.weight" for m in PACKED.get(leaf, (None, (leaf,)))[1]}
                self._dense = DenseAdapter(model, _read_base_weights(self.export_dir, names))
            device = next(model.parameters()).device
            self._dense.load(mods, scaling, device)
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
               limits: list[int] | None = None, seed: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """Answers from prompt embeddings [(L_i, d)]: token ids and processed (post-temperature) log-probs.

        A row stops after <|im_end|> (kept as its last token), after `max_new` tokens, after `limits[i]` tokens, or
        where the engine's max_model_len ends. Row i samples with seed row_seed(engine seed, seed, i), so its tokens do
        not depend on the other rows. All rows of a call carry the same adapter request (never base + LoRA mixed).
        """
        from vllm import SamplingParams

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
                raise ValueError(f"row {i}: prompt of {e.shape[0]} positions leaves no room in max_model_len="
                                 f"{self.max_model_len}")
            prompts.append({"prompt_embeds": e})
            params.append(SamplingParams(
                n=1, temperature=float(temperature), top_p=1.0, top_k=0, min_p=0.0, max_tokens=min(caps[i], room),
                logprobs=0, seed=row_seed(self.seed, seed, i), stop_token_ids=[self.eos], ignore_eos=True,
                detokenize=False, skip_special_tokens=False))
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        for i, o in zip(live, outs):
            c = o.outputs[0]
            ids[i] = [int(t) for t in c.token_ids]
            lps[i] = [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]
        return ids, lps

    def close(self) -> None:
        """Free the engine (tests; a worker restart)."""
        if self._dense is not None:
            self._dense.remove()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        import gc

        gc.collect()


def _numpy_state(state=None):
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if state is None:
        return np.random.get_state()
    np.random.set_state(state)
    return None
