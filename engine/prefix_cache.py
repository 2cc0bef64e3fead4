"""Prefix cache for a hybrid model (Gated DeltaNet + attention): per-row model states keyed by token prefix.

A GDN layer has no per-token cache that can be cut at an arbitrary position: its state after a prefix is one conv
state (the last `conv_kernel` inputs) and one recurrent state, valid at exactly that prefix's end. So an entry holds,
for one row (batch 1) at the end of a stored token prefix:

    GDN layers        conv state (1, C, k) and recurrent state (1, H, dk, dv)   at the prefix end
    attention layers  K/V (1, kv_heads, n, head_dim) of the tokens since the parent entry (the path to the root
                      concatenates to the full prefix; shared prompts are stored once)
    last_hidden       (d,) post-norm hidden state of the last prefix token (logits without recomputation)

Entries form a tree: an entry's parent is the entry it was continued from. Lookup returns the longest stored
prefix of a query; it never cuts inside an entry (there is no GDN state there).

Flow of one model turn (`latent_loop_cached`):
    prefill_rows   each row ALONE (batch 1, no padding: a pad would decay a non-zero recurrent state): restore the
                   longest stored prefix, run only the remaining tokens, store the state at the full prefix c_t.
                   Rows of a GRPO group share c_0, so in row order it is computed once.
    stack_rows     left-padded batch cache: K/V left-padded with zeros + attention mask, GDN states stacked (they
                   have no sequence dim), positions continuing per row.
    decode         <think> and the thoughts z_1..z_{K-1} on the stacked batch cache. They are never stored.

Numerics: a chunked prefill (prefix, then extension) and a one-shot prefill differ by rounding (fp32 ~1e-6). Bit
for bit, a result depends on the chunk layout and batch layout only: restoring an entry is an exact copy of the
computed state, so "warm cache" and "cold cache recomputing in the same layout (prefix, then extension)" agree
exactly. Pass each row's earlier turn-prefix lengths as `boundaries` to fix the chunk layout to
c_0 | turn-1 tokens | ... | turn-t tokens whatever the cache holds (warm, cold, evicted, no cache): then the
thoughts are bitwise identical in all cases.

Counters count prefix tokens only: <think>, the thoughts and sampled tokens are decode steps, always computed.

The cache is only valid for the weights it was filled with: call `use_weights(tag)` (clears on a new tag) or
`clear()` when the adapter changes. Tensors stay on the model's device; nothing here is CUDA-specific.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.answers import sampling_loop
from engine.latent import sample_thoughts
from engine.model import Tokens, _parts, cache_kw

LINEAR, ATTN = "linear_attention", "full_attention"


# ----------------------------------------------------------------------------------------------------------------
# per-row states


@dataclass
class RowState:
    """One row's model state at the end of a `length`-token prefix (batch dim 1).

    layers[i] = (conv (1, C, k), recurrent (1, H, dk, dv)) for a GDN layer, (keys, values) (1, kvh, length, hd)
    for an attention layer; last_hidden (d,) is the post-norm hidden state at the last prefix position.
    """

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor

    def clone(self) -> "RowState":
        return RowState(self.length, [(a.clone(), b.clone()) for a, b in self.layers], self.last_hidden.clone())


@dataclass
class RowStates:
    """Per-row states of a batch, as `prefill_rows` returns them."""

    rows: list[RowState]
    config: object  # the text config (layer types, conv kernel) to build caches from
    computed: list[int]  # tokens computed per row (0 = full hit)

    @property
    def last_hidden(self) -> torch.Tensor:
        """(B, d) post-norm hidden state of each row's last prefix token."""
        return torch.stack([r.last_hidden for r in self.rows])

    @property
    def lengths(self) -> list[int]:
        return [r.length for r in self.rows]


def layer_kinds(config) -> tuple[str, ...]:
    kinds = tuple(config.layer_types[: config.num_hidden_layers])
    bad = sorted(set(kinds) - {LINEAR, ATTN})
    if bad:
        raise ValueError(f"the prefix and static caches support {LINEAR} and {ATTN} layers only, not {bad}")
    return kinds


def _snapshot(cache, kinds: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The live tensors of a batch-1 DynamicCache (not copies)."""
    out = []
    for i, kind in enumerate(kinds):
        layer = cache.layers[i]
        if kind == LINEAR:
            out.append((layer.conv_states[0], layer.recurrent_states[0]))
        else:
            out.append((layer.keys, layer.values))
    return out


def _build_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding copies of `layers` (batched tensors), through the layers' own update methods."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    k = config.linear_conv_kernel_dim
    for i, (kind, (a, b)) in enumerate(zip(layer_kinds(config), layers)):
        layer = cache.layers[i]
        if kind == LINEAR:
            # first update = "prefill": lazily allocates zero buffers, copies into them, marks has_previous_state
            layer.update_conv_state(a, conv_kernel_size=k)
            layer.update_recurrent_state(b)
        else:
            layer.update(a, b)  # concatenated onto an empty tensor: a copy
    return cache


def stack_rows(row_states: RowStates) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Left-padded batch cache of the rows -> (DynamicCache, attention_mask (B, L) long, next_position_ids (B, 1)).

    Attention K/V are left-padded with zeros to the longest row (L) and masked; GDN conv/recurrent states are
    stacked; row i continues at position length_i. Decode with mask = cat([mask, ones(B, 1)]) per new token. The
    returned cache owns its tensors: decoding on it never touches the row states or the prefix cache.
    """
    rows = row_states.rows
    kinds = layer_kinds(row_states.config)
    B, L = len(rows), max(r.length for r in rows)
    dev = rows[0].last_hidden.device
    layers = []
    for i, kind in enumerate(kinds):
        a0, b0 = rows[0].layers[i]
        if kind == LINEAR:
            layers.append((torch.cat([r.layers[i][0] for r in rows]), torch.cat([r.layers[i][1] for r in rows])))
        else:
            keys = a0.new_zeros(B, a0.shape[1], L, a0.shape[3])
            vals = b0.new_zeros(B, b0.shape[1], L, b0.shape[3])
            for j, r in enumerate(rows):
                keys[j, :, L - r.length:] = r.layers[i][0][0]
                vals[j, :, L - r.length:] = r.layers[i][1][0]
            layers.append((keys, vals))
    mask = torch.zeros(B, L, dtype=torch.long, device=dev)
    for j, r in enumerate(rows):
        mask[j, L - r.length:] = 1
    pos = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=dev)
    return _build_cache(row_states.config, layers), mask, pos


# ----------------------------------------------------------------------------------------------------------------
# the store


class _Node:
    __slots__ = ("key", "parent", "seg", "end", "children", "layers", "last_hidden", "nbytes")

    def __init__(self, key: int, parent, seg: tuple, end: int, layers=None, last_hidden=None):
        self.key = key  # LRU key (not id(): a deep-copied cache keeps working)
        self.parent = parent
        self.seg = seg  # tokens since the parent entry
        self.end = end  # full prefix length
        self.children: dict[int, list[_Node]] = {}
        self.layers = layers  # GDN: (conv, rec) at `end`; attention: (K, V) of `seg` only
        self.last_hidden = last_hidden
        self.nbytes = 0 if layers is None else (
            sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in layers)
            + last_hidden.numel() * last_hidden.element_size())


class PrefixCache:
    """Per-row model states keyed by exact token prefixes; longest-prefix lookup; LRU eviction by tensor bytes.

    Counters (reset with `reset_counters`): input_tokens (prefix tokens asked for), computed_tokens (of those, run
    through the model), lookups, hits (lookups that found a non-empty stored prefix), evictions; stored_bytes is the
    exact byte count of all stored tensors. Entries are immutable: stored as clones, handed out as copies.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._root = _Node(0, None, (), 0)
        self._lru: OrderedDict[int, _Node] = OrderedDict()
        self._next_key = 1
        self._kinds: tuple[str, ...] | None = None
        self.weights_tag: str | None = None
        self.stored_bytes = 0
        self.reset_counters()

    # -- bookkeeping ------------------------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self.input_tokens = self.computed_tokens = 0
        self.lookups = self.hits = self.evictions = 0

    def counters(self) -> dict:
        return {"input_tokens": self.input_tokens, "computed_tokens": self.computed_tokens,
                "computed_share": self.computed_tokens / max(1, self.input_tokens), "lookups": self.lookups,
                "hits": self.hits, "evictions": self.evictions, "entries": len(self), "stored_bytes": self.stored_bytes}

    def clear(self) -> None:
        """Drop every entry (counters are kept). The stored tensors are released here, not by the garbage collector:
        nodes point to their parents and parents to their children, so an unlinked tree stays allocated until a
        cyclic collection -- replay's preflight, planned right after a clear, would count it as resident (measured:
        the 16-row fresh step's plan 24 GB above its peak, bench/results/h200-step-27b-g4-fresh-2026-12-02.json)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            for kids in node.children.values():
                stack.extend(kids)
            node.children, node.parent, node.layers, node.last_hidden = {}, None, None, None
        self._root = _Node(0, None, (), 0)
        self._lru.clear()
        self.stored_bytes = 0

    def use_weights(self, tag: str) -> None:
        """Entries are only valid for the weights they were computed with: clear when `tag` changes."""
        if tag != self.weights_tag:
            self.clear()
            self.weights_tag = tag

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, tokens) -> bool:
        q = tuple(int(t) for t in tokens)
        return len(q) > 0 and self._match(q).end == len(q)

    def stored_lengths(self) -> list[int]:
        return sorted(n.end for n in self._lru.values())

    # -- tree -------------------------------------------------------------------------------------------------------
    def _match(self, q: tuple, allowed: set[int] | None = None) -> _Node:
        """Deepest entry whose full prefix is a prefix of q (the root, end 0, if none); with `allowed`, only entries
        whose length is in it count."""
        best, stack = self._root, [self._root]
        while stack:
            node = stack.pop()
            if node.end > best.end and (allowed is None or node.end in allowed):
                best = node
            if node.end >= len(q):
                continue
            for child in node.children.get(q[node.end], ()):
                if q[node.end:child.end] == child.seg:
                    stack.append(child)
        return best

    def _touch(self, node: _Node) -> None:
        # child first, then its ancestors: a parent is always more recent than its children, so the LRU end of
        # the order is always a leaf and eviction never orphans an entry
        while node is not self._root:
            self._lru.move_to_end(node.key)
            node = node.parent

    def _materialize(self, node: _Node) -> RowState:
        """A fresh copy of the full state at `node` (K/V concatenated along the path from the root)."""
        path = []
        n = node
        while n is not self._root:
            path.append(n)
            n = n.parent
        path.reverse()
        layers = []
        for i, kind in enumerate(self._kinds):
            if kind == LINEAR:
                a, b = node.layers[i]
                layers.append((a.clone(), b.clone()))
            else:  # cat always allocates: the copy shares nothing with the entries
                layers.append((torch.cat([p.layers[i][0] for p in path], 2), torch.cat([p.layers[i][1] for p in path], 2)))
        return RowState(node.end, layers, node.last_hidden.clone())

    def _restore(self, q: tuple, allowed: set[int] | None = None) -> tuple[_Node, RowState | None]:
        node = self._match(q, allowed)
        self.lookups += 1
        if node is self._root:
            return node, None
        self.hits += 1
        self._touch(node)
        return node, self._materialize(node)

    def _insert(self, parent: _Node, q: tuple, state: RowState, kinds: tuple[str, ...]) -> _Node:
        """Store `state` (the state at the end of q, continued from `parent`'s state) as a child of `parent`."""
        if self._kinds is None:
            self._kinds = kinds
        elif kinds != self._kinds:
            raise ValueError("one PrefixCache serves one model architecture")
        if state.length != len(q) or parent.end >= len(q):
            raise ValueError("state length must equal the prefix length, beyond the parent's")
        while parent is not self._root and parent.key not in self._lru:  # evicted meanwhile: nearest live ancestor
            parent = parent.parent
        seg = q[parent.end:]
        for child in parent.children.get(seg[0], ()):
            if child.seg == seg:  # stored meanwhile: keep the first one
                self._touch(child)
                return child
        layers = []
        for kind, (a, b) in zip(kinds, state.layers):
            if kind == LINEAR:
                layers.append((a.detach().clone(), b.detach().clone()))
            else:
                layers.append((a[:, :, parent.end:].detach().clone(), b[:, :, parent.end:].detach().clone()))
        node = _Node(self._next_key, parent, seg, len(q), layers, state.last_hidden.detach().clone())
        self._next_key += 1
        parent.children.setdefault(seg[0], []).append(node)
        self._lru[node.key] = node
        self._touch(node)
        self.stored_bytes += node.nbytes
        self._evict()
        return node

    def _evict(self) -> None:
        while self.stored_bytes > self.max_bytes and self._lru:
            _, node = self._lru.popitem(last=False)
            assert not node.children, "LRU order put a parent before its child"
            siblings = node.parent.children[node.seg[0]]
            siblings.remove(node)
            if not siblings:
                del node.parent.children[node.seg[0]]
            self.stored_bytes -= node.nbytes
            self.evictions += 1

    # -- public -----------------------------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int]) -> tuple[int, RowState | None]:
        """(length of the longest stored prefix of `tokens`, a copy of its state) or (0, None)."""
        node, state = self._restore(tuple(int(t) for t in tokens))
        return node.end, state

    def put(self, tokens: Sequence[int], state: RowState, kinds: Sequence[str] | None = None) -> None:
        """Store the state at the end of `tokens`. K/V are shared with the longest stored prefix when its K/V equal
        the state's first positions bit for bit (the state was continued from it); otherwise stored in full."""
        q = tuple(int(t) for t in tokens)
        kinds = tuple(kinds) if kinds is not None else self._kinds
        if kinds is None:
            raise ValueError("first put: pass the layer kinds (layer_kinds(config))")
        parent = self._match(q)
        if parent.end == len(q):
            self._touch(parent)
            return
        if parent is not self._root:
            mine = self._materialize(parent)
            same = all(kind == LINEAR or (torch.equal(a[:, :, :parent.end], pa) and torch.equal(b[:, :, :parent.end], pb))
                       for kind, (a, b), (pa, pb) in zip(kinds, state.layers, mine.layers))
            if not same:
                parent = self._root
        self._insert(parent, q, state, kinds)


# ----------------------------------------------------------------------------------------------------------------
# model side


@torch.no_grad()
def prefill_rows(model, prefixes: list[list[int]], cache: PrefixCache | None,
                 boundaries: Sequence[Sequence[int]] | None = None) -> RowStates:
    """Per-row states at the end of each prefix, each row run ALONE (batch 1, no padding).

    With a cache: restore the longest stored prefix (a copy), run only the remaining tokens, store the state at the
    full prefix. A stored prefix equal to the whole query computes nothing: the entry keeps the last position's
    hidden state (no token is recomputed). Without a cache every row is computed from its first token.

    boundaries[i] (optional): prefix lengths of row i where the computation is cut into chunks (e.g. the lengths of
    its earlier turns' prefixes c_0..c_{t-1}); states at the cuts are stored too. With turn boundaries the chunk
    layout is always c_0 | new tokens of turn 1 | ... | new tokens of turn t, whatever the cache holds (warm, cold,
    evicted, cache=None), so the states -- and the thoughts decoded from them -- are the same bit for bit. With
    boundaries, a row restores only from a stored prefix whose length is one of them (or its full length).
    """
    from transformers import DynamicCache

    text, _, emb = _parts(model)
    dev = emb.weight.device
    kinds = layer_kinds(text.config)
    rows, computed = [], []
    for i, p in enumerate(prefixes):
        q = tuple(int(t) for t in p)
        if not q:
            raise ValueError("empty prefix")
        bounds = None if boundaries is None else {int(b) for b in boundaries[i]} | {len(q)}
        if cache is not None:
            node, state = cache._restore(q, bounds)
            start = node.end
        else:
            node, state, start = None, None, 0
        n_new = len(q) - start
        if cache is not None:
            cache.input_tokens += len(q)
            cache.computed_tokens += n_new
        computed.append(n_new)
        if n_new == 0:
            rows.append(state)
            continue
        kv = _build_cache(text.config, state.layers) if state is not None else DynamicCache(config=text.config)
        cuts = sorted(b for b in (bounds or ()) if start < b < len(q))
        for end in cuts + [len(q)]:
            ids = torch.tensor([q[start:end]], dtype=torch.long, device=dev)
            pos = torch.arange(start, end, device=dev)[None]
            h = text(input_ids=ids, position_ids=pos, **cache_kw(kv), use_cache=True).last_hidden_state[0, -1]
            st = RowState(end, _snapshot(kv, kinds), h)  # live tensors: _insert clones them
            if cache is not None:
                node = cache._insert(node, q[:end], st, kinds)
            start = end
        rows.append(st)
    return RowStates(rows, text.config, computed)


def _decode_step(text, x: torch.Tensor, kv, mask: torch.Tensor, pos: torch.Tensor):
    """Feed x (B, n, d) on the batch cache; returns (last hidden (B, d), mask, next positions)."""
    B, n = x.shape[:2]
    mask = torch.cat([mask, mask.new_ones(B, n)], 1)
    p = pos + torch.arange(n, device=pos.device)[None]
    h = text(inputs_embeds=x, attention_mask=mask, position_ids=p, **cache_kw(kv), use_cache=True).last_hidden_state[:, -1]
    return h, mask, p[:, -1:] + 1


@torch.no_grad()
def latent_loop_cached(model, prefixes: list[list[int]], K: int, sigma: float, scale: float, toks: Tokens,
                       gen: torch.Generator, cache: PrefixCache | None,
                       boundaries: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.latent.latent_loop` with the prefill through the prefix cache.

    Stores the pure-token prefix c_t; <think> and the thoughts are fed on the stacked batch cache and never stored.
    Same generator use as latent_loop (one (B, d) block per step, row order), so the eps draws are identical.
    Returns thoughts (B, K, d) and log-densities (B, K), fp32, on the model's device. `boundaries`: see prefill_rows.
    """
    text, _, emb = _parts(model)
    B = len(prefixes)
    d = emb.weight.shape[1]
    dtype, dev = emb.weight.dtype, emb.weight.device
    if K == 0:
        return torch.zeros(B, 0, d, device=dev), torch.zeros(B, 0, device=dev)
    rs = prefill_rows(model, prefixes, cache, boundaries)
    kv, mask, pos = stack_rows(rs)
    think = emb(torch.full((B, 1), toks.think, dtype=torch.long, device=dev))
    h, mask, pos = _decode_step(text, think, kv, mask, pos)

    def feed(z: torch.Tensor) -> torch.Tensor:
        nonlocal mask, pos
        h, mask, pos = _decode_step(text, z[:, None].to(dtype), kv, mask, pos)
        return h

    return sample_thoughts(h, K, sigma, scale, gen, feed)


@torch.no_grad()
def sample_answers_cached(model, prefixes: list[list[int]], thoughts: torch.Tensor, max_new: int, temperature: float,
                          toks: Tokens, gen: torch.Generator, cache: PrefixCache | None,
                          limits: list[int] | None = None, boundaries: Sequence[Sequence[int]] | None = None
                          ) -> tuple[list[list[int]], list[list[float]]]:
    """`engine.answers.sample_answers` on prompts embed(c_t ⊕ <think>) ⊕ z ⊕ embed(</think>), with c_t prefilled
    through the prefix cache and <think> ⊕ z ⊕ </think> fed as one chunk on the stacked batch cache (never stored).
    Same generator use, same stopping rules."""
    text, head, emb = _parts(model)
    B = len(prefixes)
    dtype, dev = emb.weight.dtype, emb.weight.device
    rs = prefill_rows(model, prefixes, cache, boundaries)
    kv, mask, pos = stack_rows(rs)
    x = torch.cat([emb(torch.full((B, 1), toks.think, dtype=torch.long, device=dev)),
                   thoughts.to(device=dev, dtype=dtype),
                   emb(torch.full((B, 1), toks.answer_open, dtype=torch.long, device=dev))], 1)
    h, mask, pos = _decode_step(text, x, kv, mask, pos)
    state = {"h": h, "mask": mask, "pos": pos}

    def next_logp() -> torch.Tensor:
        return torch.log_softmax(head(state["h"]).float() / temperature, -1)

    def feed(nxt: torch.Tensor) -> None:
        state["h"], state["mask"], state["pos"] = _decode_step(text, emb(nxt.to(dev)[:, None]), kv, state["mask"],
                                                               state["pos"])

    return sampling_loop(next_logp, feed, B, max_new, toks, gen, limits)
