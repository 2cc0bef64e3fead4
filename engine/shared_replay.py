"""Prefix-shared replay: score the turns of an episode (and of a GRPO group) over their shared prefixes once.

A turn's replay input is embed(c_t ⊕ <think>) ⊕ z_1..z_K ⊕ embed(</think> ⊕ a_1..a_{L-1}); thoughts of earlier turns
are not in later prefixes, so c_t is a token prefix of c_{t+1} (= c_t ⊕ answer ⊕ observation), and every row of a
group starts from the same prompt c_0. Scoring each turn alone forwards c_0 once per turn and row: at the recipe
shape (4 rows x 4 turns, a 3,072-token prompt, ~200 tokens per turn) ~55k tokens where ~7k are distinct.

Here the turns of a micro-batch form a forest of distinct prefixes (`forest`): a node is one distinct turn prefix,
its parent the same row's previous turn prefix when that is a prefix of it. Each node is forwarded once from its
parent's state (the new tokens only), and each turn's branch -- <think>, its thoughts, </think> and its answer --
from its node's state; forwards run in waves and share batches (`schedule`: equal-length prefixes unpadded whatever
their parents, with their states stacked and the K/V left-padded and masked; branches right-padded -- causal, so the
padding after a branch changes nothing before it). States carry gradients: the attention K/V and the
Gated DeltaNet conv and recurrent states live in a transformers DynamicCache whose linear-attention layers are
updated by assignment instead of in place (`functional_cache`), so autograd follows them from every branch back
into the shared prefix, and activation checkpointing per decoder layer threads each layer's state through the
checkpoint explicitly (engine.replay.checkpointed_layers).

Chunk layout: c_0 | turn-1 tokens | ... | turn-t tokens | branch, the layout generation's prefix cache computes
(engine.prefix_cache, `boundaries`), so replay and generation see the same chunking of the prefix. Results equal the
per-turn forward up to rounding (a chunked recurrence sums in another order): tests/test_shared_replay.py checks
values and gradients against the per-turn path in FP32 and the gradient-equivalence gate in BF16, and the same
micro-batch scores bit for bit the same twice (the two-pass replay-determinism gate)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.latent import gaussian_logq, thought_mean
from engine.model import Tokens, _parts, cache_kw

LINEAR = "linear_attention"
# fewest new tokens a node forwards: with one token transformers' GDN layer takes its decode path (the conv state and,
# in fla's kernel, the recurrent state updated in place), which would write into a state other branches share
MIN_CHUNK = 2


# ----------------------------------------------------------------------------------------------------------------
# caches whose states carry gradients


def _conv_update(layer, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **_):
    """LinearAttentionLayer.update_conv_state by assignment (transformers copies into a static buffer in place, which
    autograd cannot follow through a second update)."""
    k = conv_kernel_size or layer.conv_kernel_size.get(state_idx) or conv_states.shape[-1]
    if layer.has_previous_state[state_idx]:
        full = torch.cat([layer.conv_states[state_idx].to(conv_states.dtype), conv_states], -1)
    else:
        full = conv_states
        if full.shape[-1] < k:
            full = torch.nn.functional.pad(full, (k - full.shape[-1], 0))
    layer.conv_kernel_size[state_idx] = k
    layer.conv_states[state_idx] = full[..., -k:].contiguous()  # a copy: a view would keep all of `full` alive
    layer.is_conv_states_initialized[state_idx] = layer.has_previous_state[state_idx] = True
    layer.device, layer.dtype = full.device, full.dtype
    return full


def _recurrent_update(layer, recurrent_states: torch.Tensor, state_idx: int = 0, **_):
    layer.recurrent_states[state_idx] = recurrent_states
    layer.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states


_CLASSES: dict[type, type] = {}


def _functional_class(cls: type) -> type:
    """`cls` (a transformers linear-attention cache layer) with the conv and recurrent updates by assignment. A
    subclass rather than bound methods on the instance: those would form layer <-> method reference cycles that keep
    the layer's state tensors (GBs at the 27B width) alive until Python's cycle collector happens to run."""
    if cls.__dict__.get("_lgrpo_functional"):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Functional{cls.__name__}", (cls,), {
            "_lgrpo_functional": True, "update_conv_state": _conv_update, "update_recurrent_state": _recurrent_update})
    return _CLASSES[cls]


def is_linear(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def get_state(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's state: (conv, recurrent) of a GDN layer, (keys, values) of an attention layer; None if empty."""
    if is_linear(layer):
        if not layer.has_previous_state[0]:
            return None
        return layer.conv_states[0], layer.recurrent_states[0]
    if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
        return None
    return layer.keys, layer.values


def set_state(layer, state) -> None:
    """Put `state` (get_state's form, or None: empty) into a cache layer, by assignment (no copies)."""
    if is_linear(layer):
        if state is None:
            layer.conv_states[0] = layer.recurrent_states[0] = None
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = False
            layer.has_previous_state[0] = False
            return
        conv, rec = state
        layer.conv_states[0], layer.recurrent_states[0] = conv, rec
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
        layer.device, layer.dtype = conv.device, conv.dtype
        return
    if state is None:
        layer.keys = layer.values = None
        layer.is_initialized = False
        return
    layer.keys, layer.values = state
    layer.is_initialized = True
    layer.device = state[0].device


def functional_cache(config, states: list | None = None, repeat: int = 1):
    """A DynamicCache for `config` whose GDN layers update by assignment, optionally holding `states` (per layer,
    get_state's form; tensors are used as they are: several caches may share them) repeated to batch `repeat`
    (gradients of the rows sum into the shared state): broadcast views, except the GDN recurrent state, copied
    contiguous because fla's kernels address an initial state as contiguous memory (the attention K/V and the conv
    state are only read by a concatenation). Marked `_lgrpo_functional`, so checkpointed_layers threads its layers'
    states through each checkpoint."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        linear = is_linear(layer)
        if linear:
            layer.__class__ = _functional_class(type(layer))  # methods on a class: no layer <-> method cycle
        st = None if states is None else states[i]
        if st is not None and repeat > 1:
            a, b = (t.expand(repeat, *t.shape[1:]) for t in st)
            st = (a, b.contiguous() if linear else b)
        set_state(layer, st)
    cache._lgrpo_functional = True
    return cache


def stack_states(config, rows: list[list], starts: list[int]) -> list:
    """Per layer, the states of several rows stacked into one batch: GDN conv and recurrent states concatenated, the
    attention K/V left-padded with zeros to the longest prefix (starts: each row's prefix length; the caller masks the
    padding). Rows may repeat one state (gradients sum into it)."""
    kinds = list(config.layer_types)
    P = max(starts)
    out = []
    for i, kind in enumerate(kinds):
        parts = [r[i] for r in rows]
        if any(st is None for st in parts):
            raise ValueError("stack_states: a row without a state (rows from the empty state share one base)")
        if kind == LINEAR:
            out.append((torch.cat([st[0] for st in parts]), torch.cat([st[1] for st in parts]).contiguous()))
        else:
            pad = [torch.nn.functional.pad(st[0], (0, 0, P - n, 0)) for st, n in zip(parts, starts)]
            padv = [torch.nn.functional.pad(st[1], (0, 0, P - n, 0)) for st, n in zip(parts, starts)]
            out.append((torch.cat(pad), torch.cat(padv)))
    return out


def cache_states(cache) -> list:
    return [get_state(layer) for layer in cache.layers]


# ----------------------------------------------------------------------------------------------------------------
# the forest of distinct prefixes


@dataclass
class Node:
    """One distinct turn prefix: forwarded from `parent`'s state over prefix[start:end]."""

    prefix: tuple
    parent: int  # node index, -1: the empty state
    start: int
    turns: list[int] = field(default_factory=list)  # positions (in the micro-batch) of the turns that branch here

    @property
    def end(self) -> int:
        return len(self.prefix)


def forest(prefixes: list[list[int]], rows: list[int]) -> list[Node]:
    """Nodes in computation order (a parent before its children). Identical prefixes share one node (a group's
    prompt); a node's parent is the node of the same row's longest earlier turn prefix that is a proper prefix of it
    (rows' turns ordered by prefix length), else none (forwarded from the empty state)."""
    nodes: list[Node] = []
    index: dict[tuple, int] = {}
    order = sorted(range(len(prefixes)), key=lambda j: (len(prefixes[j]), j))
    last: dict[int, int] = {}  # row -> node of its latest (longest so far) turn prefix
    for j in order:
        p = tuple(int(t) for t in prefixes[j])
        if not p:
            raise ValueError("empty prefix")
        n = index.get(p)
        if n is None:
            parent = last.get(rows[j], -1)
            if parent >= 0 and p[:nodes[parent].end] != nodes[parent].prefix:
                parent = -1  # the row's earlier prefix is not a prefix of this one (edited history): start over
            while parent >= 0 and len(p) - nodes[parent].end < MIN_CHUNK:
                parent = nodes[parent].parent  # a one-token chunk would take transformers' in-place decode path
            nodes.append(Node(p, parent, nodes[parent].end if parent >= 0 else 0))
            n = index[p] = len(nodes) - 1
        nodes[n].turns.append(j)
        last[rows[j]] = n
    for nd in nodes:
        nd.turns.sort()
    return nodes


def branch_length(thoughts: torch.Tensor, answer: list[int]) -> int:
    return 1 + thoughts.shape[0] + len(answer)  # <think>, z_1..z_K, </think>, a_1..a_{L-1}


@dataclass
class Batch:
    """One forward of T positions: `items` -- ("node", i): node i's new tokens, unpadded (its state is kept);
    ("turn", j): turn j's branch, right-padded to T -- each from its base node's state (`bases`, per item; -1: the
    empty state), positions continuing from that node's end."""

    T: int
    items: list[tuple[str, int]]
    bases: list[int]


# a forward's fixed cost in tokens' worth of work (launches, NF4 dequantisation of every weight): branches join a longer
# batch when the padding that costs is at most this; a guess until measured on the GPU (bench/shared_replay_profile.py)
JOIN_PADDING_TOKENS = 256


def schedule(nodes: list[Node], branch_lengths: list[int], join_padding: int = JOIN_PADDING_TOKENS) -> list[Batch]:
    """The forwards of a prefix-shared scoring, in waves: a wave runs everything whose base state the previous wave
    made (roots first, from the empty state).

    In a wave, nodes of equal new length go in one batch (no padding, so their states are exact), whatever their
    parents, and the wave's branches join the batch of its longest nodes when they fit in that length (right-padded:
    only the positions before the padding are read) and the padding is at most `join_padding` tokens, else form a
    batch of their own. So a group whose rows' answers and tool results have equal lengths takes one forward for the
    prompt, then per wave one for the rows' next prefixes and, unless they fit beside them, one for their current
    branches: at the recipe shape 8 forwards (4 branches of 81 tokens beside prefixes of 192 would pad 444 tokens);
    turns + 1 where the branches join (tests/test_shared_replay.py)."""
    out: list[Batch] = []
    kids: dict[int, list[int]] = {}
    for i, nd in enumerate(nodes):
        kids.setdefault(nd.parent, []).append(i)
    wave = [-1]  # the bases whose states the next wave may use
    while wave:
        made: list[int] = []
        by_len: dict[int, list[int]] = {}
        for base in wave:
            for c in kids.get(base, []):
                by_len.setdefault(nodes[c].end - nodes[c].start, []).append(c)
        groups = [Batch(T, [("node", c) for c in cs], [nodes[c].parent for c in cs])
                  for T, cs in sorted(by_len.items(), reverse=True)]
        turns = [(j, base) for base in wave if base >= 0 for j in nodes[base].turns]
        if turns:
            Tb = max(MIN_CHUNK, *(branch_lengths[j] for j, _ in turns))
            if groups and groups[0].T >= Tb and len(turns) * (groups[0].T - Tb) <= join_padding:
                groups[0].items += [("turn", j) for j, _ in turns]
                groups[0].bases += [base for _, base in turns]
            else:
                groups.append(Batch(Tb, [("turn", j) for j, _ in turns], [base for _, base in turns]))
        for g in groups:
            made += [i for k, i in g.items if k == "node"]
        out.extend(groups)
        wave = sorted(made)
    return out


def shared_tokens(prefixes: list[list[int]], thoughts: list[torch.Tensor], answers: list[list[int]],
                  rows: list[int]) -> int:
    """Tokens a prefix-shared scoring of these turns forwards (padding included): the sum over `schedule`'s batches
    of rows x length."""
    return footprint(prefixes, thoughts, answers, rows, list(range(len(prefixes))))[0]


def units(prefixes: list[list[int]], rows: list[int]) -> list[list[int]]:
    """Turn indices grouped into the trees of the forest over all turns (a GRPO group's turns, typically), each
    sorted; trees in order of their first turn."""
    nodes = forest(prefixes, rows)
    root = list(range(len(nodes)))
    for i, nd in enumerate(nodes):
        root[i] = i if nd.parent < 0 else root[nd.parent]
    trees: dict[int, list[int]] = {}
    for i, nd in enumerate(nodes):
        trees.setdefault(root[i], []).extend(nd.turns)
    return sorted((sorted(t) for t in trees.values()), key=lambda t: t[0])


def state_bytes(config, nodes: list[Node], batches: list[Batch], dtype_bytes: int = 2) -> float:
    """Bytes of the shared states a scoring keeps until backward, on top of its tokens' per-token costs: every node's
    state (the attention K/V of its whole prefix, each GDN layer's conv state and FP32 recurrent state), and the
    recurrent state repeated for each batch of several rows of one base (a contiguous copy; K/V and conv states are
    repeated as views), and every state stacked for a batch of several bases (copies, K/V left-padded)."""
    kinds = list(config.layer_types)
    n_attn = sum(k != LINEAR for k in kinds)
    n_lin = len(kinds) - n_attn
    kv_per_token = n_attn * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    C = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
        + config.linear_num_value_heads * config.linear_value_head_dim
    conv = n_lin * C * config.linear_conv_kernel_dim * dtype_bytes
    rec = n_lin * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    total = sum(kv_per_token * nd.end + conv + rec for nd in nodes)
    for b in batches:
        distinct = set(b.bases) - {-1}
        if len(distinct) == 1 and len(b.items) > 1:
            total += rec * len(b.items)  # one base repeated: K/V and conv as views, the recurrent state copied
        elif len(distinct) > 1:  # several bases stacked: copies, K/V left-padded to the longest prefix
            longest = max(nodes[i].end for i in distinct)
            total += (kv_per_token * longest + conv + rec) * len(b.items)
    return float(total)


def footprint(prefixes, thoughts, answers, rows, idx: list[int], config=None, dtype_bytes: int = 2
              ) -> tuple[int, float]:
    """(tokens forwarded, bytes of shared states kept: 0 without the model's `config`) of scoring turns `idx`."""
    nodes = forest([prefixes[i] for i in idx], [rows[i] for i in idx])
    sched = schedule(nodes, [branch_length(thoughts[i], answers[i]) for i in idx])
    tokens = sum(len(b.items) * b.T for b in sched)
    return tokens, (0.0 if config is None else state_bytes(config, nodes, sched, dtype_bytes))


def pack_shared(prefixes, thoughts, answers, rows, max_tokens: int, config=None, dtype_bytes: int = 2
                ) -> tuple[list[list[int]], list[int], list[float] | None]:
    """Micro-batches of whole trees (a group shares its prompt only inside one micro-batch) by shared token count,
    largest first onto the first micro-batch with room; a tree over max_tokens is split into its rows (each row's
    turns still share their prefixes), and a row over it gets a micro-batch of its own. Returns (micro-batches of turn
    indices, each sorted; their shared token counts; given the model's `config` (and its activations' bytes per
    element) each one's `state_bytes`, else None). Deterministic in its inputs."""
    def count(idx):
        return footprint(prefixes, thoughts, answers, rows, idx)[0]

    pieces: list[list[int]] = []
    for tree in units(prefixes, rows):
        if count(tree) <= max_tokens:
            pieces.append(tree)
            continue
        by_row: dict[int, list[int]] = {}
        for i in tree:
            by_row.setdefault(rows[i], []).append(i)
        pieces.extend(by_row[r] for r in sorted(by_row, key=lambda r: by_row[r][0]))
    sizes = [count(p) for p in pieces]
    bins: list[list[int]] = []
    load: list[int] = []
    for k in sorted(range(len(pieces)), key=lambda k: (-sizes[k], pieces[k][0])):
        for b in range(len(bins)):
            if load[b] + sizes[k] <= max_tokens:
                bins[b].extend(pieces[k])
                load[b] += sizes[k]
                break
        else:
            bins.append(list(pieces[k]))
            load.append(sizes[k])
    mbs = [sorted(b) for b in bins]
    sized = [footprint(prefixes, thoughts, answers, rows, b, config, dtype_bytes) for b in mbs]
    return mbs, [n for n, _ in sized], None if config is None else [e for _, e in sized]


# ----------------------------------------------------------------------------------------------------------------
# scoring


def score_turns_shared(model, prefixes: list[list[int]], thoughts: list[torch.Tensor], answers: list[list[int]],
                       rows: list[int], temperature: float, sigma: float, scale: float, toks: Tokens,
                       logprob_chunk: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """engine.scoring.score_turns over shared prefixes: the same outputs (per-turn answer log-probs [(L_i,)], thought
    log-densities (B, K)) in the same order, with gradients when enabled. Forwards as `schedule` batches them."""
    text, head, emb = _parts(model)
    cfg = text.config
    dev = emb.weight.device
    B = len(prefixes)
    K = thoughts[0].shape[0] if B else 0
    if any(z.shape[0] != K for z in thoughts):
        raise ValueError("all turns of one scoring batch need the same number of thoughts")
    nodes = forest(prefixes, rows)
    states: dict[int, list] = {}
    ans_lp: list = [None] * B
    logq: list = [None] * B
    for bt in schedule(nodes, [branch_length(z, a) for z, a in zip(thoughts, answers)]):
        seqs = []
        for kind, i in bt.items:
            if kind == "node":
                nd = nodes[i]
                seqs.append(emb(torch.tensor(nd.prefix[nd.start:], dtype=torch.long, device=dev)))
            else:
                head_e = emb(torch.tensor([toks.think], device=dev))
                tail_e = emb(torch.tensor([toks.answer_open] + answers[i][:-1], device=dev))
                seqs.append(torch.cat([head_e, thoughts[i].to(device=dev, dtype=head_e.dtype), tail_e], 0))
        n = len(seqs)
        x = seqs[0].new_zeros(n, bt.T, seqs[0].shape[1])
        for b, sq in enumerate(seqs):
            x[b, : sq.shape[0]] = sq  # right padding (branches only): causal, so nothing before it changes
        starts = [0 if base < 0 else nodes[base].end for base in bt.bases]
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(bt.T, device=dev)[None]
        P = max(starts)
        mask = None
        distinct = sorted(set(bt.bases))
        if len(distinct) == 1:
            cache = functional_cache(cfg, None if distinct[0] < 0 else states[distinct[0]], repeat=n)
        else:
            cache = functional_cache(cfg, stack_states(cfg, [states[base] for base in bt.bases], starts))
            if min(starts) != P:  # K/V left-padded to the longest prefix: mask the padding out
                keep = torch.arange(P + bt.T, device=dev)[None, :] >= (P - torch.tensor(starts, device=dev))[:, None]
                causal = torch.ones(bt.T, P + bt.T, dtype=torch.bool, device=dev).tril(P)
                mask = {"full_attention": (keep[:, None, :] & causal[None])[:, None], "linear_attention": None}
        kw = {} if mask is None else {"attention_mask": mask}
        hid = text(inputs_embeds=x, position_ids=pos, **cache_kw(cache), use_cache=True, **kw).last_hidden_state
        out = cache_states(cache)
        for b, (kind, i) in enumerate(bt.items):
            if kind == "node":  # a prefix forwarded unpadded: its state is exact; row b of the batch's states (a
                # copy: a view would keep the whole batch's K/V alive until backward), K/V without the left padding
                states[i] = out if n == 1 else [
                    None if st is None else tuple((t[b:b + 1] if kind_ == LINEAR else t[b:b + 1, :, P - starts[b]:])
                                                  .clone() for t in st)
                    for kind_, st in zip(cfg.layer_types, out)]
                continue
            L = len(answers[i])
            if K:
                mu = thought_mean(hid[b, :K], scale)  # mu_1 from <think>, mu_k from z_{k-1}
                logq[i] = gaussian_logq(thoughts[i].to(mu.device).float(), mu, sigma)
            h = hid[b, K + 1: K + 1 + L]  # </think>, a_1..a_{L-1} predict a_1..a_L
            tgt = torch.tensor(answers[i], device=dev)
            if logprob_chunk is None:
                lp = torch.log_softmax(head(h).float() / temperature, -1).gather(1, tgt[:, None])[:, 0]
            else:
                from engine.logprobs import selected_logprobs

                lp = selected_logprobs(h, head.weight, tgt, temperature, logprob_chunk)
            ans_lp[i] = lp
        del hid, cache, out
    lq = torch.stack(logq) if K else torch.zeros(B, 0, device=dev)
    return ans_lp, lq
