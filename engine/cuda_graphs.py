"""Decoding on a static cache with CUDA graphs: the latent loop and the hf sampler of the hybrid (GDN + attention).

Why: a one-token forward of the 27B hybrid at batch 4 keeps the GPU busy ~15 ms, but eager PyTorch + PEFT launches
thousands of small kernels from Python (~215 ms/step measured on an H200). A CUDA graph replays the launches.

What is static:
    StaticHybridCache   attention K/V buffers (B, kv_heads, max_len, head_dim) written at a cursor that lives on the
                        device; GDN conv / recurrent states updated in place (copy_, never re-bound); a (B, max_len)
                        bool mask whose column at the cursor is switched on per step. It duck-types the transformers
                        cache interface of both 5.17 (has_previous_state, layers[i].conv_states) and 5.24
                        (get_conv_state, is_recording_past), so the stock Qwen3_5 modules run on it unchanged.
    fixed buffers       input embeddings / token ids, position ids, eps, outputs: one address for the object's life.
    FrozenAdapter       PEFT LoRA/DoRA layers with the DoRA scale m/||W + s·BA|| computed once per adapter version
                        (PEFT recomputes it -- and casts/dequantizes the whole weight -- on every forward). Same
                        arithmetic as PEFT's forward, bit for bit (tests/test_cuda_graphs.py checks it).
    gqa_attention       (attention="gqa", the default) short queries attend over the static K/V grouped by KV head,
                        in fp32, instead of transformers' sdpa path that copies K/V per query head (repeat_kv)
                        whenever a mask is passed; attention="hf" keeps the model's own function.

Measured on one H200 (bench/recipe_27b.py, 27B shape, BF16 + DoRA r16, batch 4, 3.9k-position cache): a latent step
takes 555 ms eager on transformers' DynamicCache with PEFT's forward, 153 ms eager on this static path, 44.6 ms as a
graph replay (48.2 ms with attention="hf"); ~9.7k kernels per step, of which the dense GEMMs take ~13 ms (HBM
floor 10.8 ms) and the rest are small kernels (LoRA/DoRA FP32 path, casts, norms, GDN fallback ops).

Schedule of one call: prefill eagerly (a left-padded batch, or rows restored from engine.prefix_cache); the first
decode step runs eagerly (warm-up: lazy allocations, cuBLAS handles, Triton autotuning), the second is captured
into a torch.cuda.CUDAGraph and replayed, every later step is one replay. The graph is kept for later calls with the
same batch size, capacity and constants (sigma, scale / temperature); buffers are reset in place.

Bitwise contract: `graphed=False` runs the identical step function eagerly (same kernels, same buffers), so thoughts,
tokens and log-probs of the graphed and the eager static path are equal bit for bit (GPU test). Relative to the
dynamic-cache paths in engine.model / engine.prefix_cache the results are close, not bitwise (attention runs over
the static max_len with a mask). Random draws: the eps blocks of the latent loop are drawn from the caller's
generator exactly like engine.latent.latent_loop (one (B, d) block per thought, in order, on gen.device); the
sampler draws one multinomial over all rows per step like engine.answers.sample_answers. Sampling stays outside the
graph, so any generator (CPU or CUDA) works.

Nothing here touches CUDA at import time; on CPU both classes run their eager static path (tests, laptops).
"""

from __future__ import annotations

import time

import torch

from engine import adapter_kernels as AK
from engine import attention_kernels as AT
from engine.answers import sampling_loop
from engine.latent import thought_step
from engine.model import Tokens, _parts, cache_kw, left_pad
from engine.adapter_grad import adapter_layers, adapter_params, dora_weight_norm, single_adapter_layers
from engine.prefix_cache import ATTN, LINEAR, layer_kinds
from engine.rng import draw_normal


# ----------------------------------------------------------------------------------------------------------------
# grouped-query attention over the static cache without repeat_kv


GQA_MAX_QUERY = 64  # longer queries (a padded prefill) go to the model's own attention function


def gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
    """Attention for short queries on a long static cache: the query heads grouped by their KV head instead of
    materializing repeat_kv copies of K and V (B x heads x max_len x head_dim, twice per layer and step, which is
    what transformers' sdpa path does whenever a mask is passed). Scores, softmax and P @ V in fp32 (the bf16 K/V
    values are exact in fp32): at least as precise as SDPA's fp32 accumulation, unlike eager bf16 scores. With
    model.attention_kernels: auto (opt-in; default torch), two Triton kernels do the same arithmetic reading the BF16
    K/V in place where they qualified (engine/attention_kernels.py).
    query (B, H, q, hd), key/value (B, kvh, L, hd), mask (B, 1, q, L) bool (True = attend) or additive.
    Returns ((B, q, H, hd) in the query dtype, None) like the sdpa/eager interfaces."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return AT.attention(query, key, value, attention_mask, scaling), None


class _AttentionOverride:
    """Routes the model's attention implementation to gqa_attention for short queries while active."""

    def __init__(self, impl: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

        self.table = ALL_ATTENTION_FUNCTIONS
        self.impl = impl
        self.orig = ALL_ATTENTION_FUNCTIONS.get_interface(impl, mq.eager_attention_forward)

        def attention(module, query, *args, **kwargs):
            fn = gqa_attention if query.shape[2] <= GQA_MAX_QUERY else self.orig
            return fn(module, query, *args, **kwargs)

        self.fn = attention
        self._saved = None

    def __enter__(self):
        local = self.table._local_mapping
        self._saved = (self.impl in local, local.get(self.impl))
        self.table[self.impl] = self.fn
        return self

    def __exit__(self, *exc):
        had, old = self._saved
        if had:
            self.table[self.impl] = old
        else:
            del self.table[self.impl]
        return False


# ----------------------------------------------------------------------------------------------------------------
# the static cache


class _LinearSlot:
    """One GDN layer's states, in the attribute layout of transformers' LinearAttentionLayer."""

    def __init__(self, kernel: int):
        self.conv_states: dict[int, torch.Tensor | None] = {0: None}
        self.recurrent_states: dict[int, torch.Tensor | None] = {0: None}
        self.conv_kernel_size = {0: kernel}
        self.record_past = False


class _AttnSlot:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys = keys
        self.values = values


class StaticHybridCache:
    """Fixed-address cache for B rows and up to max_len positions.

    The write position is the device scalar `cursor`; `_idx` (set by the driver before each forward) holds the
    positions the current forward writes. GDN states are allocated on their first write (dtype as the kernels
    produce them: conv in the model dtype, recurrent in fp32) and from then on updated with copy_.
    """

    is_compileable = True
    gdn_steps_in_place = True  # engine.gdn_step may update this cache's GDN states in place in one-token steps

    def __init__(self, config, batch: int, max_len: int, dtype: torch.dtype, device):
        self.config = config
        self.kinds = layer_kinds(config)
        self.B, self.max_len = int(batch), int(max_len)
        self.dtype, self.device = dtype, torch.device(device)
        k = config.linear_conv_kernel_dim
        kvh, hd = config.num_key_value_heads, config.head_dim
        self.layers: list = []
        for kind in self.kinds:
            if kind == LINEAR:
                self.layers.append(_LinearSlot(k))
            else:
                shape = (self.B, kvh, self.max_len, hd)
                self.layers.append(_AttnSlot(torch.zeros(shape, dtype=dtype, device=self.device),
                                             torch.zeros(shape, dtype=dtype, device=self.device)))
        self.mask2d = torch.zeros(self.B, self.max_len, dtype=torch.bool, device=self.device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cols = torch.arange(self.max_len, device=self.device)
        self.filled = False  # False during the prefill forward, True for every later forward
        self.length = 0  # host mirror of the cursor (bookkeeping only; never read by the model here)
        self._idx: torch.Tensor | None = None

    # -- driver side ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero every buffer in place (addresses kept for captured graphs)."""
        for kind, slot in zip(self.kinds, self.layers):
            if kind == LINEAR:
                for t in (slot.conv_states[0], slot.recurrent_states[0]):
                    if t is not None:
                        t.zero_()
            else:
                slot.keys.zero_()
                slot.values.zero_()
        self.mask2d.zero_()
        self.cursor.zero_()
        self.filled = False
        self.length = 0

    def load_rows(self, row_states) -> torch.Tensor:
        """Copy per-row states (engine.prefix_cache.RowStates) in, left-padded to the longest row like
        prefix_cache.stack_rows. Returns next position ids (B, 1). The cursor is set to the longest length."""
        rows = row_states.rows
        if len(rows) != self.B:
            raise ValueError(f"{len(rows)} rows for a cache of batch {self.B}")
        L = max(r.length for r in rows)
        if L > self.max_len:
            raise ValueError(f"rows of {L} tokens exceed the static cache ({self.max_len})")
        self.reset()
        for i, (kind, slot) in enumerate(zip(self.kinds, self.layers)):
            if kind == LINEAR:
                conv = torch.cat([r.layers[i][0] for r in rows]).to(self.device)
                rec = torch.cat([r.layers[i][1] for r in rows]).to(self.device)
                if slot.conv_states[0] is None:
                    slot.conv_states[0] = torch.zeros_like(conv)
                    slot.recurrent_states[0] = torch.zeros_like(rec)
                slot.conv_states[0].copy_(conv)
                slot.recurrent_states[0].copy_(rec)
            else:
                for j, r in enumerate(rows):
                    slot.keys[j, :, L - r.length:L] = r.layers[i][0][0]
                    slot.values[j, :, L - r.length:L] = r.layers[i][1][0]
        for j, r in enumerate(rows):
            self.mask2d[j, L - r.length:L] = True
        self.cursor.fill_(L)
        self.length = L
        self.filled = True
        return torch.tensor([[r.length] for r in rows], dtype=torch.long, device=self.device)

    # -- the transformers cache interface (5.17 to 5.25) ----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.layers)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """5.25: how many per-token recurrent states a GDN forward returns beside the last (speculative decoding's
        past recording, never active here)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """5.25: a GDN layer's single-token conv step counts a position in its layer. Positions here are the
        driver's (`cursor` on the device, `length` on the host), advanced once per forward, not per layer."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.filled

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.layers[layer_idx].conv_states[0] if self.filled else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.layers[layer_idx].recurrent_states[0] if self.filled else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None,
                          state_idx: int = 0, **kwargs) -> torch.Tensor:
        slot = self.layers[layer_idx]
        k = slot.conv_kernel_size[0]
        if slot.conv_states[0] is None:
            slot.conv_states[0] = torch.zeros((*conv_states.shape[:-1], k), dtype=conv_states.dtype,
                                              device=conv_states.device)
        if not self.filled:  # prefill: the input is the whole left context
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([slot.conv_states[0], conv_states], dim=-1)
        slot.conv_states[0].copy_(full[..., -k:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        slot = self.layers[layer_idx]
        if slot.recurrent_states[0] is None:
            slot.recurrent_states[0] = torch.zeros_like(recurrent_states)
        slot.recurrent_states[0].copy_(recurrent_states)
        return slot.recurrent_states[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        slot = self.layers[layer_idx]
        slot.keys.index_copy_(2, self._idx, key_states)
        slot.values.index_copy_(2, self._idx, value_states)
        return slot.keys, slot.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len


# ----------------------------------------------------------------------------------------------------------------
# PEFT adapter layers with a frozen DoRA scale


class FrozenAdapter:
    """Inference forwards for PEFT LoRA/DoRA Linear layers (plain and bitsandbytes 4-bit) that reuse the DoRA scale.

    PEFT's DoRA forward computes mag_norm_scale = m / ||W + s·BA||_row on every call (casting -- or, for NF4,
    dequantizing -- the whole base weight). Here it is computed once per adapter version with PEFT's own functions
    and kept in fixed tensors (updated in place by `sync()`, so captured graphs see new values). The forward is
    PEFT's expression for expression: FP32 LoRA term, combined in FP32, rounded once.

    Use as a context manager around inference (installs / removes instance-level forwards); call `sync()` after the
    adapter weights may have changed (it returns "same", "values" or "layout": a new layout means captured graphs
    are stale). Eval mode and no autocast are required, like the sampler paths.
    """

    def __init__(self, model):
        self.model = model
        self.layers = single_adapter_layers(model)
        self.ms: dict[str, torch.Tensor] = {}
        # sibling projections (one input: q/k/v, gate/up, the GDN input projections): one step_h over their stacked
        # A matrices serves all of them in single-token steps (same bits as one step_h each, fewer launches)
        self.siblings: dict[str, tuple[str, int]] = {}  # name -> (group, rank offset)
        self.groups: dict[str, list[str]] = {}  # group -> its projections' names, in stacking order
        self.stacked_a: dict[str, torch.Tensor] = {}  # group -> stacked A (FP32), refreshed by sync()
        self._h: dict[str, tuple] = {}  # group -> (input, its version, partials) of the last step_h
        self._key = None
        self._installed = False
        self._depth = 0
        self._group_siblings()
        self.sync()

    SIBLINGS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"},
                {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"})

    def _group_siblings(self) -> None:
        groups: dict[tuple, list[str]] = {}
        for name, (mod, a) in self.layers.items():
            parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            kind = next((i for i, g in enumerate(self.SIBLINGS) if leaf in g), None)
            A = mod.lora_A[a].weight
            if kind is not None:
                groups.setdefault((parent, kind, A.shape[1], A.dtype, A.device), []).append(name)
        for (parent, kind, *_), names in groups.items():
            if len(names) < 2:
                continue
            self.groups[f"{parent}#{kind}"] = names
            off = 0
            for n in names:
                self.siblings[n] = (f"{parent}#{kind}", off)
                mod, a = self.layers[n]
                off += mod.lora_A[a].weight.shape[0]

    def _state_key(self):
        return tuple((p.data_ptr(), p._version) for p in adapter_params(self.layers))

    @torch.no_grad()
    def _scale(self, mod, a) -> torch.Tensor:
        """PEFT's mag_norm_scale for x in the LoRA dtype (DoraLinearLayer.forward, no autocast)."""
        return (mod.lora_magnitude_vector[a].weight / dora_weight_norm(mod, a)).view(1, -1)

    @torch.no_grad()
    def sync(self) -> str:
        key = self._state_key()
        if key == self._key:
            return "same"
        layout = self._key is None or [k[0] for k in key] != [k[0] for k in self._key]
        for name, (mod, a) in self.layers.items():
            if a not in getattr(mod, "lora_magnitude_vector", {}):
                continue
            ms = self._scale(mod, a)
            if layout or name not in self.ms:
                self.ms[name] = ms
            else:
                self.ms[name].copy_(ms)
        for gid, names in self.groups.items():
            st = torch.cat([self.layers[n][0].lora_A[self.layers[n][1]].weight for n in names], 0)
            if layout or gid not in self.stacked_a:
                self.stacked_a[gid] = st
            else:
                self.stacked_a[gid].copy_(st)
        self._h.clear()
        self._key = self._state_key()
        return "layout" if layout else "values"

    def _partials(self, name: str, x: torch.Tensor):
        """(partials, rank offset) of step_h for x: computed once per input for the sibling group (one launch over
        the stacked A), reused by the other siblings; (None, 0) for a projection without siblings."""
        sib = self.siblings.get(name)
        if sib is None:
            return None, 0
        gid, off = sib
        hit = self._h.get(gid)
        if hit is None or hit[0] is not x or hit[1] != x._version:
            hit = self._h[gid] = (x, x._version, AK.step_h(x, self.stacked_a[gid]))
        return hit[2], off

    def _forward(self, name: str):
        mod, a = self.layers[name]
        base = mod.get_base_layer()
        A, B = mod.lora_A[a], mod.lora_B[a]
        scaling = mod.scaling[a]
        bnb4 = type(mod).__name__ == "Linear4bit"
        dora = name in self.ms

        def forward(x, *args, **kwargs):
            if torch.is_autocast_enabled():
                raise RuntimeError("FrozenAdapter: run inference without autocast (PEFT's arithmetic differs there)")
            result = base(x, *args, **kwargs)
            if bnb4:
                result = result.clone()
            # PEFT's arithmetic (engine/adapter_kernels.py): on a few rows (a latent step, a decoded token) the whole
            # term in two kernels where qualified; else the FP32 GEMMs and one fused epilogue, or its expressions
            if AK.step_enabled(result):
                part, off = self._partials(name, x)
                return AK.step_fused(result, x, A.weight, B.weight, self.ms.get(name), base.bias if dora else None,
                                     scaling, dora, bnb4, part=part, part_off=off)
            return AK.step_torch(result, x, A.weight, B.weight, self.ms.get(name), base.bias if dora else None,
                                 scaling, dora, bnb4)

        return forward

    def install(self) -> None:
        if self._installed:
            return
        for name, (mod, _) in self.layers.items():
            mod.forward = self._forward(name)
        self._installed = True

    def remove(self) -> None:
        if not self._installed:
            return
        for mod, _ in self.layers.values():
            if "forward" in mod.__dict__:
                del mod.forward
        self._h.clear()
        self._installed = False

    def __enter__(self):  # re-entrant: nested `with` blocks keep the forwards until the outermost exits
        if self._depth == 0:
            self.install()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.remove()
        return False


# ----------------------------------------------------------------------------------------------------------------
# the shared static decoder


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _StaticDecoder:
    """Static cache + fixed buffers + one captured step for one model. Subclasses define `_step` and the loop."""

    def __init__(self, model, capacity: int = 0, graphed: bool | None = None, freeze_adapter: bool = True,
                 profile: bool = False, attention: str = "gqa", capacity_step: int = 1024):
        self.model = model
        self.text, self.head, self.emb = _parts(model)
        self.dtype, self.dev = self.emb.weight.dtype, self.emb.weight.device
        self.d = self.emb.weight.shape[1]
        if graphed is None:
            graphed = self.dev.type == "cuda"
        if graphed and self.dev.type != "cuda":
            raise ValueError("graphed=True needs the model on a CUDA device; use graphed=False on CPU")
        self.graphed = bool(graphed)
        self.capacity = int(capacity)
        if capacity_step < 1:
            raise ValueError(f"capacity_step must be >= 1, got {capacity_step}")
        # a new cache length means a new cache and a new capture: a length grown by a turn's answer and tool result
        # stays inside the rounded capacity (the recipe's 4 turns: one capture instead of one per turn)
        self.capacity_step = int(capacity_step)
        self.attn_impl = getattr(self.text.config, "_attn_implementation", "sdpa") or "sdpa"
        if attention not in ("gqa", "hf"):
            raise ValueError("attention must be 'gqa' (grouped, no repeat_kv copies) or 'hf' (the model's own)")
        self.attention = attention
        self.frozen = FrozenAdapter(model) if freeze_adapter and adapter_layers(model) else None
        self.cache: StaticHybridCache | None = None
        self.graph = None
        self._graph_key = None
        self._stream = None
        self.profile = profile
        self.times: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    # -- buffers ----------------------------------------------------------------------------------------------------
    def _ensure(self, B: int, need: int) -> None:
        if self.cache is None or self.cache.B != B or self.cache.max_len < need:
            self.cache = None
            self.graph = None
            step = self.capacity_step
            cap = max(-(-need // step) * step, self.capacity)
            self.cache = StaticHybridCache(self.text.config, B, cap, self.dtype, self.dev)
            self._ar = torch.arange(self.cache.max_len, device=self.dev)
            self.pos = torch.zeros(B, 1, dtype=torch.long, device=self.dev)
            self._alloc(B)
        else:
            self.cache.reset()

    def _alloc(self, B: int) -> None:
        raise NotImplementedError

    # -- forward on the static cache --------------------------------------------------------------------------------
    def _masks(self, idx: torch.Tensor, lin_mask):
        c = self.cache
        m4 = c.mask2d[:, None, None, :] & (c.cols[None, :] <= idx[:, None])[None, None]  # (B, 1, n, max_len)
        if lin_mask is not None:  # padded prefill: pad query rows see nothing; let them see everything (finite)
            m4 = m4 | ~m4.any(-1, keepdim=True)
        if self.attn_impl == "eager":
            m4 = torch.zeros(m4.shape, dtype=self.dtype, device=self.dev).masked_fill_(~m4, torch.finfo(self.dtype).min)
        return {ATTN: m4, LINEAR: lin_mask}

    def _fwd(self, x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Feed x (B, n, d) at the cursor with positions pos (B, n); returns the last position's hidden (B, d).

        valid (B, n) bool: padding of a left-padded prefill (None: all valid). Advances the device cursor; the host
        mirror is advanced by the callers (outside captured regions)."""
        c = self.cache
        n = x.shape[1]
        idx = c.cursor + self._ar[:n]
        c._idx = idx
        if valid is None:
            c.mask2d.index_fill_(1, idx, True)
            lin = None
        else:
            c.mask2d[:, :n] = valid  # prefill starts at cursor 0
            lin = None if bool(valid.all()) else valid.long()
        masks = self._masks(idx, lin)
        if self.attention == "gqa":
            with _AttentionOverride(self.attn_impl):
                out = self.text(inputs_embeds=x, attention_mask=masks, position_ids=pos, use_cache=True,
                                **cache_kw(c))
        else:
            out = self.text(inputs_embeds=x, attention_mask=masks, position_ids=pos, use_cache=True, **cache_kw(c))
        c.cursor.add_(n)
        return out.last_hidden_state[:, -1]

    def _prefill_padded(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Left-padded batch prefill (engine.model.left_pad layout) on an empty cache; sets self.pos."""
        c = self.cache
        c.filled = False
        h = self._fwd(x, pos.to(self.dev), valid=mask.to(self.dev).bool())
        c.filled = True
        c.length = x.shape[1]
        self.pos.copy_(pos[:, -1:].to(self.dev) + 1)
        return h

    def _chunk(self, x: torch.Tensor) -> torch.Tensor:
        """Feed a chunk of n valid tokens on the filled cache (eager); advances self.pos."""
        n = x.shape[1]
        h = self._fwd(x, self.pos + self._ar[:n][None])
        self.pos.add_(n)
        self.cache.length += n
        return h

    # -- one decode step: eager, or warm-up / capture / replay ------------------------------------------------------
    def _step(self) -> None:
        raise NotImplementedError

    def _timed(self, key: str, fn) -> None:
        # always counted (cheap); timed when profiling, and always for the rare, costly warm-up and capture steps
        self.counts[key] = self.counts.get(key, 0) + 1
        if not self.profile and key not in ("warmup", "capture"):
            fn()
            return
        _sync(self.dev)
        t = time.perf_counter()
        fn()
        _sync(self.dev)
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t

    def _run_step(self, key) -> None:
        """One decode step. Graphed mode: warm-up (eager, on the capture stream) when no graph exists yet, capture at
        the next step, then replay."""
        if not self.graphed:
            self._timed("eager", self._step)
        elif self.graph is not None and self._graph_key == key:
            self._timed("replay", self.graph.replay)
        elif self._stream is not None and self._warm_key == key:
            def capture():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=self._stream):
                    self._step()
                self.graph, self._graph_key = g, key
            self._timed("capture", capture)
            self._timed("replay", self.graph.replay)
        else:
            self.graph = None
            self._stream = torch.cuda.Stream(device=self.dev)
            self._stream.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(self._stream):
                self._timed("warmup", self._step)
            torch.cuda.current_stream(self.dev).wait_stream(self._stream)
            self._warm_key = key
        self.cache.length += 1

    def _adapter_sync(self) -> None:
        if self.frozen is not None and self.frozen.sync() == "layout":
            self.graph = None

    def adapter_frozen(self):
        """A `with` block for eager work on this decoder's model outside its loop (engine.runtime runs the
        prefix-cached per-row prefill in it): the FrozenAdapter forwards, synced to the adapter's current values.
        PEFT's own DoRA forward recomputes m/||W + s·BA|| -- dequantizing and casting the whole base weight -- on
        every forward, i.e. once per prefilled row and chunk; here it is computed once per adapter version. Bit for
        bit PEFT's forward (tests/test_cuda_graphs.py)."""
        self._adapter_sync()
        return self._adapter()

    def stats(self) -> dict:
        return {"times_s": dict(self.times), "counts": dict(self.counts)}

    def reset_stats(self) -> None:
        self.times.clear()
        self.counts.clear()


# ----------------------------------------------------------------------------------------------------------------
# the latent loop


class GraphedLatentLoop(_StaticDecoder):
    """engine.latent.latent_loop / engine.prefix_cache.latent_loop_cached on a static cache with CUDA-graph replay.

        loop = GraphedLatentLoop(trainer_model, capacity=max_prefix + K + 1)
        z, logq = loop.run(prefixes, K, sigma, scale, toks, gen)           # left-padded prefill of prefix ⊕ <think>
        z, logq = loop.run_rows(row_states, K, sigma, scale, toks, gen)    # rows from prefix_cache.prefill_rows

    Returns thoughts (B, K, d) fp32 and log-densities (B, K) fp32 on the model's device.
    """

    def _alloc(self, B: int) -> None:
        self.x = torch.zeros(B, 1, self.d, dtype=self.dtype, device=self.dev)
        self.eps = torch.zeros(B, self.d, dtype=torch.float32, device=self.dev)
        self.z = torch.zeros(B, self.d, dtype=torch.float32, device=self.dev)
        self.lq = torch.zeros(B, dtype=torch.float32, device=self.dev)

    def _sample(self, h: torch.Tensor) -> None:
        """z = mu(h) + sigma * eps, its log-density; the next input is z in the model dtype."""
        z, lq = thought_step(h, self.eps, self._sigma, self._scale)
        self.z.copy_(z)
        self.lq.copy_(lq)
        self.x.copy_(z[:, None].to(self.dtype))

    def _step(self) -> None:
        h = self._fwd(self.x, self.pos)
        self.pos.add_(1)
        self._sample(h)

    def _draw(self, gen: torch.Generator, K: int, B: int) -> list[torch.Tensor]:
        # same generator use as latent_loop: one (B, d) block per thought, in order
        return [draw_normal(gen, B, self.d) for _ in range(K)]

    def _setup(self, sigma: float, scale: float):
        self._sigma, self._scale = float(sigma), float(scale)
        self._adapter_sync()
        return ("latent", self.cache.B, self.cache.max_len, self._sigma, self._scale, self.attn_impl, self.attention)

    @torch.no_grad()
    def run(self, prefixes: list[list[int]], K: int, sigma: float, scale: float, toks: Tokens,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(prefixes)
        if K == 0:
            return torch.zeros(B, 0, self.d, device=self.dev), torch.zeros(B, 0, device=self.dev)
        eps = self._draw(gen, K, B)
        with self._adapter():
            seqs = [self.emb(torch.tensor(p + [toks.think], device=self.dev)) for p in prefixes]
            x, mask, pos = left_pad(seqs)
            self._ensure(B, x.shape[1] + K)
            key = self._setup(sigma, scale)
            h = self._prefill_padded(x, mask, pos)
            self.eps.copy_(eps[0])
            self._sample(h)
            zs, lqs = [self.z.clone()], [self.lq.clone()]
            for k in range(1, K):
                self.eps.copy_(eps[k])
                self._run_step(key)
                zs.append(self.z.clone())
                lqs.append(self.lq.clone())
        return torch.stack(zs, 1), torch.stack(lqs, 1)

    @torch.no_grad()
    def run_rows(self, row_states, K: int, sigma: float, scale: float, toks: Tokens,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """After prefix_cache.prefill_rows: <think> and z_1..z_{K-1} are decode steps (all graphable)."""
        B = len(row_states.rows)
        if K == 0:
            return torch.zeros(B, 0, self.d, device=self.dev), torch.zeros(B, 0, device=self.dev)
        eps = self._draw(gen, K, B)
        with self._adapter():
            self._ensure(B, max(row_states.lengths) + K)
            key = self._setup(sigma, scale)
            self.pos.copy_(self.cache.load_rows(row_states))
            self.x.copy_(self.emb(torch.full((B, 1), toks.think, dtype=torch.long, device=self.dev)))
            zs, lqs = [], []
            for k in range(K):
                self.eps.copy_(eps[k])
                self._run_step(key)
                zs.append(self.z.clone())
                lqs.append(self.lq.clone())
        return torch.stack(zs, 1), torch.stack(lqs, 1)

    def _adapter(self):
        return self.frozen if self.frozen is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------------------------------------------
# the hf sampler


class GraphedDecoder(_StaticDecoder):
    """engine.answers.sample_answers / engine.prefix_cache.sample_answers_cached on a static cache with CUDA graphs.

        dec = GraphedDecoder(sampler_model, capacity=max_prefix + K + 2 + max_new)
        ids, lps = dec.sample(prompts, max_new, temperature, toks, gen, limits)             # prompt embeddings
        ids, lps = dec.sample_rows(row_states, thoughts, max_new, temperature, toks, gen, limits)

    The rows of a group decode as one batch. A row stops after <|im_end|> (kept), after max_new tokens or after
    limits[i] tokens; every row draws from the generator at every step while any row is live (like sample_answers),
    so a row's tokens do not depend on the others' limits. Returns token ids and post-temperature log-probs.
    """

    def _alloc(self, B: int) -> None:
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=self.dev)
        V = self.head.weight.shape[0]
        self.logp = torch.zeros(B, V, dtype=torch.float32, device=self.dev)

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(h).float() / self._temp, -1)

    def _step(self) -> None:
        h = self._fwd(self.emb(self.ids), self.pos)
        self.pos.add_(1)
        self.logp.copy_(self._logp(h))

    @torch.no_grad()
    def sample(self, prompts: list[torch.Tensor], max_new: int, temperature: float, toks: Tokens,
               gen: torch.Generator, limits: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        B = len(prompts)
        with self._adapter():
            x, mask, pos = left_pad([p.to(self.dev) for p in prompts])
            self._ensure(B, x.shape[1] + max_new)
            key = self._setup(temperature)
            self.logp.copy_(self._logp(self._prefill_padded(x, mask, pos)))
            return self._loop(key, max_new, toks, gen, limits)

    @torch.no_grad()
    def sample_rows(self, row_states, thoughts: torch.Tensor, max_new: int, temperature: float, toks: Tokens,
                    gen: torch.Generator, limits: list[int] | None = None
                    ) -> tuple[list[list[int]], list[list[float]]]:
        """After prefix_cache.prefill_rows: <think> ⊕ z_1..z_K ⊕ </think> is fed as one chunk (eager), then tokens."""
        with self._adapter():
            key = self._start_rows(row_states, thoughts, max_new, temperature, toks)
            return self._loop(key, max_new, toks, gen, limits)

    @torch.no_grad()
    def forced_rows(self, row_states, thoughts: torch.Tensor, answer: list[int], temperature: float,
                    toks: Tokens) -> torch.Tensor:
        """sample_rows teacher-forced (the failure diagnostic): the same prefill, chunk and decode steps -- warm-up,
        capture, replay when graphed -- with the answer's tokens fed instead of sampled ones, every row the same
        answer. Returns the (B, L, V) post-temperature log-softmax before each answer token (FP32)."""
        out = []
        with self._adapter():
            key = self._start_rows(row_states, thoughts, len(answer), temperature, toks)
            for i, tok in enumerate(answer):
                out.append(self.logp.clone())
                if i == len(answer) - 1:
                    break
                self.ids.fill_(int(tok))
                self._run_step(key)
        return torch.stack(out, 1)

    def _start_rows(self, row_states, thoughts: torch.Tensor, max_new: int, temperature: float, toks: Tokens):
        """Rows restored into the static cache, <think> ⊕ z_1..z_K ⊕ </think> fed as one eager chunk: self.logp
        holds the first answer token's distribution. Returns the graph key."""
        B = len(row_states.rows)
        K = thoughts.shape[1]
        self._ensure(B, max(row_states.lengths) + K + 2 + max_new)
        key = self._setup(temperature)
        self.pos.copy_(self.cache.load_rows(row_states))
        x = torch.cat([self.emb(torch.full((B, 1), toks.think, dtype=torch.long, device=self.dev)),
                       thoughts.to(device=self.dev, dtype=self.dtype),
                       self.emb(torch.full((B, 1), toks.answer_open, dtype=torch.long, device=self.dev))], 1)
        self.logp.copy_(self._logp(self._chunk(x)))
        return key

    def _setup(self, temperature: float):
        self._temp = float(temperature)
        self._adapter_sync()
        return ("decode", self.cache.B, self.cache.max_len, self._temp, self.attn_impl, self.attention)

    def _adapter(self):
        return self.frozen if self.frozen is not None else _Null()

    def _loop(self, key, max_new: int, toks: Tokens, gen: torch.Generator, limits):
        def feed(nxt: torch.Tensor) -> None:
            self.ids.copy_(nxt.to(self.dev)[:, None])
            self._run_step(key)

        return sampling_loop(lambda: self.logp, feed, self.cache.B, max_new, toks, gen, limits)
