"""Long-lived engines of this process (the CPU worker): trainer model + adapter, sampler, tokenizer.

Stages are plain functions on artifact paths; they get their engines from here so models load once per process
and persist across tasks and steps. An engine switches adapters by the content digest of the adapter artifact,
so a stage always runs with exactly the adapter it was given (a stale adapter is impossible by construction).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import model as M
from engine import answers as AN
from engine import latent as LT
from engine.rng import RowRandom, generator_for


def set_threads(n: int | None) -> None:
    """torch threads: `n`, else all cores; a pool worker keeps the share its pool gave it (engine/pool.py)."""
    n = int(os.environ.get("LGRPO_WORKER_THREADS") or 0) or n or os.cpu_count() or 1
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@dataclass
class Engine:
    """One model (base + adapter) with the adapter it currently holds, and its generation fast path.

    prefix_cache: per-row model states keyed by token prefix (engine.prefix_cache), valid for the adapter it was
    filled with: switching adapters clears it (``use_weights``). An engine whose model holds exactly the same weights
    and arithmetic as another (the hf sampler on an unquantized base: the export is the trainer's base in the same
    dtype) shares that engine's cache. graphs: generate on the static-cache loops latent_graph / decoder_graph
    (CUDA-graph replay on a GPU; on the CPU the same static path runs eagerly), built on first use.
    """

    model: object
    toks: M.Tokens
    scale: float
    adapter_digest: str | None = None
    live: dict = field(default_factory=dict)  # replay digest -> per-turn tensors with autograd graph
    # (optimizer-state path, its sha256, the AdamW that wrote it): the next optimize reuses the optimizer instead of
    # reading and verifying the state back (stages/optimize.py; ~900 MB at the 27B shape)
    kept_optimizer: tuple | None = None
    prefix_cache: object | None = None
    graphs: bool = False
    same_arithmetic_as_trainer: bool = False  # a sampler on the trainer's unquantized base: may share its cache
    _latent_graph: object | None = None
    _decoder_graph: object | None = None
    _frozen: object | None = None  # the eager paths' FrozenAdapter (False: the model has no adapter layers)

    @property
    def device(self) -> torch.device:
        return M._parts(self.model)[2].weight.device

    def use_adapter(self, adapter_dir: str | Path) -> None:
        from artifacts import read_adapter_dir
        from artifacts.store import content_digest

        # which adapter this is: remembered while its files keep their stat signature (a 27B adapter is ~450 MB,
        # asked for by every generate turn, replay and optimize); a real load below verifies what it reads
        digest = content_digest(adapter_dir)
        if digest != self.adapter_digest:
            _, tensors = read_adapter_dir(adapter_dir)
            M.load_adapter_state(self.model, tensors)
            self.adapter_digest = digest
            self.live.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.use_weights(digest)  # a cache filled under another adapter is dropped

    def frozen_adapter(self):
        """A `with` block for the eager (not graphed) inference paths: engine.cuda_graphs.FrozenAdapter's forwards on
        the adapter layers, synced to the adapter's current values. Bit for bit PEFT's forward (tests/test_cuda_graphs.py)
        without PEFT's per-call bookkeeping (three submodule calls, the active-adapter loop, the dropout module, input
        casts) and, for DoRA, with m/||W + s·BA|| once per adapter version instead of once per forward. A decoded
        token runs every adapted projection on a handful of rows, where that bookkeeping weighs: on the tiny model
        (CPU) PEFT's LoRA forward, base product included, was ~38 % of a decode step under cProfile, and this path
        cut the answers phase by ~6 % (6 alternating pairs, same bits)."""
        from contextlib import nullcontext

        if self._frozen is None:
            from engine.adapter_grad import single_adapter_layers
            from engine.cuda_graphs import FrozenAdapter

            self._frozen = FrozenAdapter(self.model) if single_adapter_layers(self.model) else False
        if self._frozen is False:
            return nullcontext()
        self._frozen.sync()
        return self._frozen

    def latent_graph(self):
        if self._latent_graph is None:
            from engine.cuda_graphs import GraphedLatentLoop

            self._latent_graph = GraphedLatentLoop(self.model)  # graphed on CUDA, the eager static path on CPU
        return self._latent_graph

    def decoder_graph(self):
        if self._decoder_graph is None:
            from engine.cuda_graphs import GraphedDecoder

            self._decoder_graph = GraphedDecoder(self.model)
        return self._decoder_graph

    def graph_stats(self, role: str) -> dict | None:
        """CUDA-graph captures so far of the latent ("latent") or answer ("answers") loop and the seconds its
        warm-up and capture steps took (a new batch size or a longer cache re-captures); None when not graphed."""
        g = self._latent_graph if role == "latent" else self._decoder_graph
        if g is None or not g.graphed:
            return None
        return {"captures": g.counts.get("capture", 0),
                "setup_s": round(g.times.get("warmup", 0.0) + g.times.get("capture", 0.0), 4)}

    # -- the trainer role: latent thoughts --------------------------------------------------------------------------
    def thoughts(self, prefixes: list[list[int]], boundaries, K: int, sigma: float, seed: int, cache,
                 times: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K latent thoughts and their log-densities per row, on this engine's fastest path: CUDA-graph replay on a
        static cache after a prefix-cached per-row prefill (GPU), the prefix-cached loop (CPU), or the plain batched
        loop (generation.prefix_cache off). Same generator use on every path (one (B, d) block per thought, row
        order, drawn from a CPU generator seeded with `seed`). times: the graphed path adds its prefill seconds under
        "latent_prefill_s". cache: the prefix cache to prefill through (None: none) -- the trainer's own, or for the hf
        sampler sampling thoughts the one its answers use, answer_cache(trainer)."""
        from engine import prefix_cache as PC

        gen = generator_for(seed)  # a list: one generator per row (engine/rng.py)
        with torch.no_grad():
            if self.graphs:
                loop = self.latent_graph()
                with loop.adapter_frozen():  # the DoRA scale once per adapter version, not once per row and chunk
                    rows = _prefill_timed(self.model, prefixes, cache, boundaries, times, "latent_prefill_s")
                return loop.run_rows(rows, K, sigma, self.scale, self.toks, gen)
            with self.frozen_adapter():
                if cache is not None:
                    return PC.latent_loop_cached(self.model, prefixes, K, sigma, self.scale, self.toks, gen, cache,
                                                 boundaries)
                return LT.latent_loop(self.model, prefixes, K, sigma, self.scale, self.toks, gen)

    # -- the trainer role: replay scores ---------------------------------------------------------------------------
    def score(self, turns, idx: list[int], temperature: float, sigma: float, tier: str = "keep", rc=None,
              graph: str = "keep"):
        """Replay scores of turns `idx` under the adapter this engine holds: per-turn answer log-probs [(L,)] and
        thought log-densities (n, K), in the replay tier's memory mode (engine.replay.score_microbatch: keep the
        autograd graph, checkpoint, score now and re-forward later for the two-pass tier, or a one-pass
        micro-batch's `graph`)."""
        from engine.replay import score_microbatch

        return score_microbatch(self, turns, idx, temperature, sigma, tier, rc, graph)

    # -- the sampler role: answers and teacher-forced scores --------------------------------------------------------
    def answer_cache(self, trainer: "Engine"):
        """The prefix cache this sampler prefills through. It computes exactly what the trainer computes for a token
        prefix (same weights, dtype and kernels) when the trainer's base is not NF4 and both hold the same adapter;
        then the trainer's cache serves both (the group's prompt and earlier turns are computed once per round). A
        sampler holding another adapter (a stale one) never reads the trainer's states: it keeps its own cache."""
        if self.same_arithmetic_as_trainer and self.adapter_digest == trainer.adapter_digest:
            return trainer.prefix_cache
        return self.prefix_cache

    def answers(self, prefixes: list[list[int]], boundaries, z: torch.Tensor, max_new: int, temperature: float,
                seed: int, limits: list[int], trainer: "Engine", times: dict | None = None):
        """Answers from prefix ⊕ <think> ⊕ z ⊕ </think>, the rows decoded as one batch: CUDA-graphed decode after a
        prefix-cached prefill (GPU), prefix-cached (CPU), or plain prompt embeddings. Returns (token ids, sampler
        log-probs) per row. times: the graphed path adds its prefill seconds under "answers_prefill_s"."""
        from engine import prefix_cache as PC

        gen = generator_for(seed)
        cache = self.answer_cache(trainer)
        with torch.no_grad():
            if self.graphs:
                dec = self.decoder_graph()
                with dec.adapter_frozen():
                    rows = _prefill_timed(self.model, prefixes, cache, boundaries, times, "answers_prefill_s")
                out = dec.sample_rows(rows, z, max_new, temperature, self.toks, gen, limits)
                if times is not None and isinstance(gen, RowRandom):
                    # per decoded token the host draws q while the GPU computes the step, then waits for the step:
                    # draw >> wait means the draws, not the GPU, set the pace (answers_s minus both: the rest)
                    for k in ("draw_s", "wait_s"):
                        times[f"answers_{k}"] = round(times.get(f"answers_{k}", 0.0) + gen.times[k], 4)
                return out
            with self.frozen_adapter():
                if cache is not None:
                    return PC.sample_answers_cached(self.model, prefixes, z, max_new, temperature, self.toks, gen,
                                                    cache, limits, boundaries)
                prompts = [AN.prompt_embeddings(self.model, p, z[i], self.toks) for i, p in enumerate(prefixes)]
                return AN.sample_answers(self.model, prompts, max_new, temperature, self.toks, gen, limits=limits)

    def teacher_forced(self, prefixes, thoughts, answers, temperature: float, trainer: "Engine") -> list:
        """Per turn the (L,) post-temperature log-probs of the given answer tokens after prefix ⊕ thoughts."""
        from engine import diagnose as D

        return D.teacher_forced(self.model, prefixes, thoughts, answers, temperature, self.toks)

    def diagnostic_paths(self, cases: list[dict], temperature: float, trainer: "Engine", fresh, adapter_dir) -> dict:
        """The failure diagnostic's isolated paths of this sampler (engine.diagnose.hf_paths): per case {path:
        log-probs}, the graph-vs-eager record, the adapter layers vs the trainer's, the adapter tensors vs disk."""
        from engine import diagnose as D

        return D.hf_paths(self, cases, temperature, trainer, fresh, adapter_dir)


def _prefill_timed(model, prefixes, cache, boundaries, times: dict | None, key: str):
    """engine.prefix_cache.prefill_rows, its device seconds added to times[key] (the step's "prefill" phase)."""
    import time

    from engine import prefix_cache as PC

    dev = M._parts(model)[2].weight.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    rows = PC.prefill_rows(model, prefixes, cache, boundaries)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if times is not None:
        times[key] = round(times.get(key, 0.0) + time.perf_counter() - t, 4)
    return rows


_ENGINES: dict[tuple, Engine] = {}
_TOKENIZERS: dict[str, object] = {}


def tokenizer(tok_dir: str | Path):
    from engine.tokenizer import load_tokenizer

    key = str(Path(tok_dir).resolve())
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(tok_dir)
    return _TOKENIZERS[key]


def _new_prefix_cache(cfg):
    from engine.prefix_cache import PrefixCache

    return PrefixCache(cfg.generation.prefix_cache_mb * 2**20) if cfg.generation.prefix_cache else None


def check_device(cfg) -> None:
    """Fail early, saying what to change, when the configured device or quantization cannot run here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device: cuda, but this torch ({torch.__version__}) sees no CUDA GPU: run on a GPU "
                           "machine or set device: cpu (and model.quantization: none)")
    if cfg.model.quantization == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("model.quantization: nf4 needs bitsandbytes (pip install bitsandbytes) on the GPU "
                           "machine, or set model.quantization: none")


def build(cfg, model_dir: str | Path, tok_dir: str | Path, *, quantization: str = "none", adapter_dir=None,
          via_peft: bool = False, dtype: str | None = None, compute_dtype: torch.dtype | None = None) -> Engine:
    """The one engine builder: the run's trainer and sampler, the fresh engines of the probe and the failure
    diagnostic, and the gradient check's engines.

    Base: `model_dir` in `dtype` (default model.dtype) on cfg.device; NF4 through bitsandbytes when quantization is
    nf4; a random NF4 base's in-memory export is the trainer's dequantized weights. The project's GDN and adapter-
    epilogue choice is installed, attention cores in FP32 when model.attention_fp32. compute_dtype: the base's
    weights, rounded to `dtype`, then held and computed in this dtype (separates rounding from arithmetic).
    Adapter: via_peft loads `adapter_dir` through PEFT's own from_pretrained (an independent load: the probe's and
    the diagnostic's reference); otherwise cfg.adapter is attached with FP32 masters and loaded from `adapter_dir`
    when given (the run's engines switch adapters with Engine.use_adapter)."""
    check_device(cfg)
    tok = tokenizer(tok_dir)
    dtype = dtype or cfg.model.dtype
    if quantization == "nf4":
        from engine.nf4 import load_base_nf4

        base = load_base_nf4(model_dir, device=cfg.device)
    else:
        m = M.random_base_manifest(model_dir)
        if m is not None and m.get("dequantized_from"):
            base = _dequantized_copy(cfg, model_dir, m)
        else:
            base = M.load_base(model_dir, dtype, cfg.device)
    if compute_dtype is not None:
        base.to(compute_dtype)
    from engine import adapter_kernels, attention_kernels, gdn, gdn_step, nf4_kernels, norm_kernels

    gdn.install(cfg.model.gdn_kernels, base.config, cfg.device)  # before the first forward, whatever transformers routes
    gdn_step.install(cfg.model.gdn_kernels, base.config, cfg.device)  # the static decoder's one-token GDN step
    adapter_kernels.install(cfg.model.adapter_kernels, cfg.device)  # before any CUDA graph is captured
    adapter_kernels.install_step(cfg.model.adapter_step_kernels, cfg.device)
    norm_kernels.install(cfg.model.norm_kernels, cfg.device)  # process-wide: every engine computes the same norms
    attention_kernels.install(cfg.model.attention_kernels, cfg.device)  # before any CUDA graph is captured
    if quantization == "nf4":
        nf4_kernels.install(cfg.model.nf4_kernels, cfg.device)
    if cfg.model.attention_fp32:
        M.use_fp32_attention(base)  # trainer and hf sampler alike: same arithmetic, shared prefix cache, bitwise probe
    if via_peft:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, str(adapter_dir))
    else:
        torch.manual_seed(cfg.seed)  # adapter init (overwritten by the loaded adapter anyway)
        model = M.attach_adapter(base, cfg.adapter)
        if adapter_dir is not None:
            from artifacts import read_adapter_dir

            M.load_adapter_state(model, read_adapter_dir(adapter_dir)[1])
    model.eval()
    return Engine(model=model, toks=M.Tokens.of(tok), scale=M.embed_scale(model),
                  graphs=cfg.device == "cuda" and cfg.generation.cuda_graphs)


def _dequantized_copy(cfg, export_dir, manifest: dict):
    """The sampler's BF16 base for an in-memory export (a random NF4 base has no checkpoint to write 54 GB of): the
    trainer's dequantized NF4 weights copied into a BF16 model on the device, then checked bit for bit."""
    from engine import nf4

    tr = trainer(cfg, manifest["dequantized_from"], manifest["dequantized_from"])
    base = M.load_base(export_dir, "bfloat16", cfg.device, init=False)
    nf4.load_state_into(base, tr.model)
    check = nf4.verify_export(tr.model, base)
    if not check["equal"]:
        raise RuntimeError(f"the in-memory BF16 export differs from the trainer's dequantized NF4 weights: "
                           f"mismatched {check['mismatched']}, missing {check['missing']}, extra {check['extra']}")
    return base


def trainer(cfg, base_dir: str | Path, tok_dir: str | Path) -> Engine:
    """The policy the latent loop and replay run on: the base (NF4 when configured) with FP32-master adapter
    weights, on `cfg.device`."""
    key = ("trainer", str(Path(base_dir).resolve()), cfg.adapter.model_dump_json(), cfg.model.dtype,
           cfg.model.quantization, cfg.model.attention_fp32, cfg.device, cfg.generation.model_dump_json())
    if key not in _ENGINES:
        _ENGINES[key] = build(cfg, base_dir, tok_dir, quantization=cfg.model.quantization)
        _ENGINES[key].prefix_cache = _new_prefix_cache(cfg)
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

    def answer_cache(self, trainer: Engine):
        return None  # vLLM's own KV cache is inside the engine

    def graph_stats(self, role: str) -> dict | None:
        return None  # vLLM captures its own graphs

    def _prompts(self, prefixes, thoughts, trainer: Engine) -> list[torch.Tensor]:
        """Prompt embeddings from the trainer's table: the export's values."""
        with torch.no_grad():
            return [AN.prompt_embeddings(trainer.model, p, thoughts[i], trainer.toks) for i, p in enumerate(prefixes)]

    def answers(self, prefixes: list[list[int]], boundaries, z: torch.Tensor, max_new: int, temperature: float,
                seed: int, limits: list[int], trainer: Engine, times: dict | None = None):
        return self.vllm.sample(self._prompts(prefixes, z, trainer), max_new, temperature, limits=limits,
                                seed=seed if isinstance(seed, (list, tuple)) else seed % 2**31)

    def teacher_forced(self, prefixes, thoughts, answers, temperature: float, trainer: Engine) -> list:
        return self.vllm.teacher_forced(self._prompts(prefixes, thoughts, trainer), answers, temperature)

    def diagnostic_paths(self, cases: list[dict], temperature: float, trainer: Engine, fresh, adapter_dir) -> dict:
        """As Engine.diagnostic_paths, for what vLLM exposes (engine.diagnose.vllm_paths); `fresh` is not used."""
        from engine import diagnose as D

        return D.vllm_paths(self, cases, temperature, trainer, adapter_dir)


SAMPLER_ON_TRAINER = "sampler-on-trainer.json"  # the export of sampler.weights: trainer (stages/export.py)


def sampler_on_trainer(export_dir: str | Path) -> str | None:
    """The trainer base an export names when the hf sampler runs on the trainer's own model, else None."""
    note = Path(export_dir) / SAMPLER_ON_TRAINER
    if not note.is_file():
        return None
    import json

    return json.loads(note.read_text())["base"]


def sampler(cfg, export_dir: str | Path, tok_dir: str | Path):
    """The sampler engine: the HF engine on its own copy of the base (the export stage's checkpoint), or vLLM
    loaded from that checkpoint (``sampler.kind: vllm``; its cache lives in the run directory <run>/export/..), or,
    with ``sampler.weights: trainer``, the trainer engine itself (its base, adapter and prefix cache)."""
    base = sampler_on_trainer(export_dir)
    if (base is not None) != (cfg.sampler.weights == "trainer"):
        raise ValueError(f"export {export_dir} was made for sampler.weights="
                         f"{'trainer' if base is not None else 'export'}, the run says {cfg.sampler.weights}: rerun "
                         f"the step from its export (lgrpo rerun --run-dir RUN --step N --stage export)")
    if base is not None:
        return trainer(cfg, base, tok_dir)
    key = ("sampler", cfg.sampler.kind, str(Path(export_dir).resolve()), cfg.adapter.model_dump_json(),
           cfg.model.dtype, cfg.model.attention_fp32, cfg.sampler.model_dump_json(), cfg.device,
           cfg.generation.model_dump_json())
    if key not in _ENGINES:
        if cfg.sampler.kind == "vllm":
            from artifacts.checkpoint import resolve
            from engine.vllm_sampler import from_run_config

            tok_dir = resolve(tok_dir)  # vLLM reads the tokenizer files themselves: a checkpoint used in place
            run_dir = Path(export_dir).resolve().parents[1]  # <run>/export/<base hash>
            s = cfg.sampler
            _ENGINES[key] = VllmEngine(
                from_run_config(cfg, export_dir, tok_dir, run_dir, prefix_caching=s.prefix_caching,
                                mtp_tokens=s.mtp_tokens, attention_backend=s.attention_backend),
                M.Tokens.of(tokenizer(tok_dir)))
        else:
            _ENGINES[key] = build(cfg, export_dir, tok_dir)
            _ENGINES[key].prefix_cache = _new_prefix_cache(cfg)
            _ENGINES[key].same_arithmetic_as_trainer = cfg.model.quantization == "none"
    return _ENGINES[key]


def latent_engine(cfg, trainer: Engine, sampler) -> Engine:
    """The engine whose model samples the thoughts (`latent.engine`). The hf sampler qualifies only while it holds the
    trainer's adapter: its base is the trainer's (unquantized) or the BF16 export of the trainer's dequantized NF4
    weights, checked bit for bit at export. Thoughts and their recorded log-densities then come from the sampler's
    arithmetic (cuBLAS BF16 products where the trainer runs bitsandbytes' 4-bit kernels), replay re-scores them on the
    trainer as for any sampler, and one prefix cache serves the latent loop and the answers."""
    choice = cfg.latent.engine
    if sampler is trainer:  # sampler.weights: trainer -- one model does both
        return trainer
    if choice == "auto":
        choice = "sampler" if cfg.model.quantization == "nf4" and isinstance(sampler, Engine) else "trainer"
    if choice == "trainer":
        return trainer
    if not isinstance(sampler, Engine):
        raise ValueError(f"latent.engine=sampler needs the hf sampler (sampler.kind: hf), not {type(sampler).__name__}")
    if sampler.adapter_digest != trainer.adapter_digest:
        raise RuntimeError(f"latent.engine=sampler: the sampler holds adapter {sampler.adapter_digest}, the trainer "
                           f"{trainer.adapter_digest}; load the same adapter into both before sampling thoughts")
    return sampler


def clear() -> None:
    """Drop every engine of this process (tests; a worker restart)."""
    for engine in _ENGINES.values():
        if isinstance(engine, VllmEngine):
            engine.vllm.close()
    _ENGINES.clear()
    _TOKENIZERS.clear()


def _tensor_bytes(tensors, seen: set, device: torch.device | None = None) -> int:
    """Bytes of the storages among `tensors` on `device` (None: any CUDA device), each storage counted once across
    calls sharing `seen`."""
    n = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.is_cuda if device is None else _same_device(t.device, device)):
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                n += st.nbytes()
    return n


def _static_tensors(dec) -> list:
    """The buffers a static decoder (engine.cuda_graphs) holds: its cache's attention K/V and GDN states, mask."""
    c = getattr(dec, "cache", None)
    if c is None:
        return []
    out = [c.mask2d, c.cursor, c.cols]
    for slot in c.layers:
        out += [getattr(slot, "keys", None), getattr(slot, "values", None)]
        out += [v for d in (getattr(slot, "conv_states", {}), getattr(slot, "recurrent_states", {})) for v in d.values()]
    return out


def memory_census() -> dict:
    """What this process's engines hold on the GPU, in GB: per engine its weights (parameters and buffers, the
    adapter included), its static decoders' caches and its prefix cache; the CUDA allocator's total and the share no
    engine accounts for (autograd graphs, optimizer state, transient work, the allocator's own rounding)."""
    GB = 2**30
    if not torch.cuda.is_available():
        return {}
    seen: set = set()
    engines = []
    for key, e in _ENGINES.items():
        if not isinstance(e, Engine):
            continue
        weights = _tensor_bytes([*e.model.parameters(), *e.model.buffers()], seen)
        static = _tensor_bytes([t for d in (e._latent_graph, e._decoder_graph) if d is not None
                                for t in _static_tensors(d)], seen)
        pc = e.prefix_cache.stored_bytes if e.prefix_cache is not None else 0
        engines.append({"role": key[0], "weights_gb": round(weights / GB, 2), "static_decoders_gb": round(static / GB, 2),
                        "prefix_cache_gb": round(pc / GB, 2), "live_graphs": len(e.live)})
    allocated = torch.cuda.memory_allocated()
    held = sum(x["weights_gb"] + x["static_decoders_gb"] + x["prefix_cache_gb"] for x in engines)
    return {"allocated_gb": round(allocated / GB, 2), "reserved_gb": round(torch.cuda.memory_reserved() / GB, 2),
            "engines": engines, "unaccounted_gb": round(allocated / GB - held, 2)}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def other_models_bytes(engine: Engine) -> int:
    """Bytes of parameters and buffers that the other hf engines' models (an hf sampler's own copy of the base: the
    in-memory or on-disk BF16 export) hold on `engine`'s device, storages `engine`'s model shares not counted. The
    replay stage names them when its preflight refuses: with sampler.weights: export they are resident beside the
    trainer (54 GB at the 27B shape)."""
    weights = lambda e: [*e.model.parameters(), *e.model.buffers()]  # noqa: E731
    seen: set = set()
    _tensor_bytes(weights(engine), seen, engine.device)  # the engine's own storages
    return sum(_tensor_bytes(weights(e), seen, engine.device) for e in _ENGINES.values() if isinstance(e, Engine))


def release_prefix_caches() -> None:
    """Empty every engine's prefix cache. Replay calls it: a fresh step's turns are all generated by then and the
    adapter changes after it, so no stored state can be hit again (the next step's prompts are new tasks under a new
    adapter), and the preflight plans with that memory instead."""
    for e in _ENGINES.values():
        if isinstance(e, Engine) and e.prefix_cache is not None:
            e.prefix_cache.clear()


def release_generation_memory() -> dict:
    """Free what only generation uses -- every engine's prefix cache, static decoders (their caches and captured
    graphs) and leftover replay graphs -- and return the allocator's unused blocks to the device. Nothing computed
    depends on them (a cold cache gives the same results bit for bit); the next generation rebuilds them. For
    end-of-run work that needs room for another engine (verify-checkpoint). Returns the census before and after."""
    import gc

    before = memory_census()
    release_prefix_caches()
    for e in _ENGINES.values():
        if not isinstance(e, Engine):
            continue
        e._latent_graph = e._decoder_graph = None
        e.live.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"before": before, "after": memory_census()}
