"""Prefix cache for the hybrid model: lookup, LRU by bytes, counters, immutability, numerics vs uncached, bitwise.

Tiny random model (configs/tiny.yaml arch, 64-token vocab), fp32 unless stated; synthetic token ids.
"""

from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from engine import model as M
from engine import answers as AN
from engine import latent as LT
from engine import prefix_cache as PC

torch.set_num_threads(1)

V = 64
TOKS = M.Tokens(pad=0, eos=1, think=2, answer_open=3)


def _model(dtype="float32"):
    cfg = load_config("tiny")
    return M.build_random_model(cfg.model.arch, V, TOKS.pad, TOKS.eos, seed=0, dtype=dtype)


@pytest.fixture(scope="module")
def model():
    return _model().eval()


def _rand(gen, n):
    return torch.randint(4, V, (n,), generator=gen).tolist()


def _episodes(rows=4, turns=3, prompt=40, seed=0):
    """Prefixes c_t per turn for one GRPO group: a shared prompt, then each row's answer ⊕ observation tokens."""
    g = torch.Generator().manual_seed(seed)
    c0 = _rand(g, prompt)
    per_turn = [[list(c0) for _ in range(rows)]]
    for _ in range(turns - 1):
        per_turn.append([p + _rand(g, int(torch.randint(3, 12, (1,), generator=g))) + _rand(g, 6) for p in per_turn[-1]])
    return per_turn


def _full_logp(model, prefix):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prefix])).logits[0, -1].float(), -1)


def _row_logp(model, row):
    with torch.no_grad():
        return torch.log_softmax(model.lm_head(row.last_hidden).float(), -1)


def _entry_bytes(model, new_tokens: int) -> int:
    """Exact bytes of one entry holding `new_tokens` of K/V (tiny arch, fp32)."""
    c = model.config
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) * c.linear_conv_kernel_dim
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    kv = 2 * c.num_key_value_heads * new_tokens * c.head_dim
    n_lin = sum(t == PC.LINEAR for t in c.layer_types)
    return 4 * (n_lin * (conv + rec) + (len(c.layer_types) - n_lin) * kv + c.hidden_size)


# ------------------------------------------------------------------------------------------------------------------
# the store


def test_longest_prefix_lookup(model):
    g = torch.Generator().manual_seed(1)
    a, b, c = _rand(g, 10), _rand(g, 10), _rand(g, 5)
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [a, a + b, a + c], pc)
    assert pc.stored_lengths() == [10, 15, 20]
    assert pc.lookup(a + b + [5, 6])[0] == 20
    assert pc.lookup(a + c)[0] == 15
    assert pc.lookup(a + c[:4])[0] == 10  # never cut inside an entry: there is no GDN state there
    assert pc.lookup(a[:9]) == (0, None)
    assert pc.lookup(b)[0] == 0
    # an entry nested inside an existing sibling's segment: both stay findable, the longest wins
    PC.prefill_rows(model, [a + b[:4]], pc)
    assert pc.lookup(a + b[:4] + [7])[0] == 14
    assert pc.lookup(a + b)[0] == 20
    assert (a + b) in pc and (a + b[:3]) not in pc
    assert pc.lookups == 11 and pc.hits == 8  # prefill_rows looks up too (4 lookups, 3 hits)


def test_bytes_are_exact_and_lru_evicts_leaves_first(model):
    g = torch.Generator().manual_seed(2)
    a, b, x, y = _rand(g, 12), _rand(g, 5), _rand(g, 12), _rand(g, 12)
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [a, a + b], pc)
    # the child stores only its own 5 tokens of K/V (shared prompts are stored once)
    assert pc.stored_bytes == _entry_bytes(model, 12) + _entry_bytes(model, 5)
    pc.max_bytes = 3 * _entry_bytes(model, 12)
    PC.prefill_rows(model, [x], pc)
    assert pc.evictions == 0 and len(pc) == 3
    PC.prefill_rows(model, [y], pc)  # over budget: the LRU end is a+b (a leaf), never its parent a first
    assert pc.evictions == 1 and pc.stored_lengths() == [12, 12, 12]
    assert pc.lookup(a + b)[0] == 12  # a survived
    assert pc.stored_bytes == 3 * _entry_bytes(model, 12) <= pc.max_bytes
    pc.lookup(x)  # touch x: now a is least recent
    PC.prefill_rows(model, [y + b], pc)
    assert a not in pc and x in pc and y in pc and (y + b) in pc
    assert pc.stored_bytes <= pc.max_bytes
    pc.clear()
    assert len(pc) == 0 and pc.stored_bytes == 0 and pc.lookup(x) == (0, None)


def test_clear_releases_the_stored_tensors_without_the_garbage_collector(model):
    """Replay's preflight counts what is allocated right after release_prefix_caches(): a cleared tree must not wait
    for a cyclic collection (nodes and parents point at each other) to give its tensors back."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(5)
    a, b = _rand(g, 12), _rand(g, 5)
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [a, a + b], pc)
    nodes, stack = [], [pc._root]
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(k for kids in n.children.values() for k in kids)
    refs = [weakref.ref(t) for n in nodes if n.layers is not None for pair in n.layers for t in pair]
    assert len(refs) > 0 and all(r() is not None for r in refs)
    del nodes, stack, n
    gc.disable()
    try:
        pc.clear()
        assert all(r() is None for r in refs), "cleared entries still allocated until a gc.collect()"
    finally:
        gc.enable()


def test_put_shares_kv_only_with_the_prefix_it_continued(model):
    g = torch.Generator().manual_seed(4)
    a, b = _rand(g, 12), _rand(g, 5)
    kinds = PC.layer_kinds(model.config)
    continued = PC.prefill_rows(model, [a, a + b], PC.PrefixCache(10**9)).rows[1]  # prompt, then extension
    one_shot = PC.prefill_rows(model, [a + b], None).rows[0]  # K/V of `a` differ by rounding
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [a], pc)
    pc.put(a + b, one_shot, kinds)
    assert pc.stored_bytes == _entry_bytes(model, 12) + _entry_bytes(model, 17)  # stored in full, under the root
    got = pc.lookup(a + b)[1]
    assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(got.layers, one_shot.layers))
    pc2 = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [a], pc2)
    pc2.put(a + b, continued)
    assert pc2.stored_bytes == _entry_bytes(model, 12) + _entry_bytes(model, 5)  # shares the prompt's K/V
    got = pc2.lookup(a + b)[1]
    assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(got.layers, continued.layers))
    pc2.use_weights("adapter-1")
    assert len(pc2) == 0
    PC.prefill_rows(model, [a], pc2)
    pc2.use_weights("adapter-1")
    assert len(pc2) == 1


def test_stored_entries_are_immutable(model):
    eps = _episodes(rows=2, turns=2)
    pc = PC.PrefixCache(10**9)
    rs = PC.prefill_rows(model, eps[1], pc)
    before = [pc.lookup(p)[1] for p in eps[1]]
    # decode on the stacked cache (in-place conv/recurrent updates) and scribble on returned states
    kv, mask, pos = PC.stack_rows(rs)
    text, _, emb = M._parts(model)
    with torch.no_grad():
        for t in range(3):
            PC._decode_step(text, emb(torch.full((2, 1), 5 + t)), kv, mask, pos)
            mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
            pos = pos + 1
    for r in rs.rows + before:
        for a, b in r.layers:
            a.add_(1.0)
            b.mul_(-3.0)
        r.last_hidden.zero_()
    # decoding from a fresh copy changes nothing either
    again = PC.prefill_rows(model, eps[1], pc)
    kv2, mask2, pos2 = PC.stack_rows(again)
    with torch.no_grad():
        PC._decode_step(text, emb(torch.full((2, 1), 5)), kv2, mask2, pos2)
    fresh = PC.prefill_rows(model, eps[1], None)
    for p, want in zip(eps[1], fresh.rows):
        got = pc.lookup(p)[1]
        assert torch.equal(got.last_hidden, want.last_hidden)
        for (a, b), (c, d) in zip(got.layers, want.layers):
            assert a.shape == c.shape
            assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, d, atol=1e-5)  # (different chunk layout)


def test_group_turns_compute_only_new_tokens(model):
    """4 rows x 3 turns: turn 0 computes the shared prompt once, later turns only answer ⊕ observation tokens."""
    eps = _episodes(rows=4, turns=3, prompt=40)
    pc = PC.PrefixCache(10**9)
    total_in = total_comp = 0
    for t, prefixes in enumerate(eps):
        pc.reset_counters()
        rs = PC.prefill_rows(model, prefixes, pc)
        new = len(prefixes[0]) if t == 0 else sum(len(p) - len(q) for p, q in zip(prefixes, eps[t - 1]))
        assert pc.computed_tokens == new == sum(rs.computed)  # no extra tokens: a full hit recomputes nothing
        assert pc.input_tokens == sum(len(p) for p in prefixes)
        total_in += pc.input_tokens
        total_comp += pc.computed_tokens
        # the same turn again (the sampler's prefill of the same c_t, or a retry): nothing computed
        pc.reset_counters()
        PC.prefill_rows(model, prefixes, pc)
        assert pc.computed_tokens == 0 and pc.hits == 4
    share = total_comp / total_in
    print(f"\n4 rows x 3 turns: input {total_in} tokens, computed {total_comp} ({share:.1%})")
    assert share < 0.3


# ------------------------------------------------------------------------------------------------------------------
# numerics


def test_cached_prefill_matches_uncached_fp32(model):
    eps = _episodes(rows=3, turns=3)
    pc = PC.PrefixCache(10**9)
    worst = 0.0
    for prefixes in eps:  # turn by turn: prompt, then extensions continued from stored states
        rs = PC.prefill_rows(model, prefixes, pc)
        for p, r in zip(prefixes, rs.rows):
            worst = max(worst, float((_row_logp(model, r) - _full_logp(model, p)).abs().max()))
    print(f"\nfp32 cached vs uncached prefill: max |dlogp| = {worst:.2e}")
    assert worst < 1e-4  # measured ~4e-6; target 1e-3


def test_cached_prefill_matches_uncached_bf16():
    """bf16: the chunked computation rounds like the one-shot one almost everywhere (difference exactly 0), but a
    single bf16 rounding flip of an intermediate moves the last hidden state by ~1 bf16 ulp (rel <= 7e-3 measured)
    and bf16 logits by one ulp: max |dlogp| 1.8e-2 measured over 36 rows (4 of them non-zero)."""
    model = _model("bfloat16").eval()
    worst = worst_h = 0.0
    for seed, prompt, ext in ((0, 40, 1), (8, 100, 30)):  # seed 8: a case with a rounding flip
        g = torch.Generator().manual_seed(seed)
        a, b = _rand(g, prompt), _rand(g, ext)
        pc = PC.PrefixCache(10**9)
        PC.prefill_rows(model, [a], pc)
        (row,) = PC.prefill_rows(model, [a + b], pc).rows
        with torch.no_grad():
            out = model(input_ids=torch.tensor([a + b]), output_hidden_states=True)
        h = out.hidden_states[-1][0, -1].float()
        worst_h = max(worst_h, float((row.last_hidden.float() - h).abs().max() / h.abs().max()))
        worst = max(worst, float((_row_logp(model, row) - torch.log_softmax(out.logits[0, -1].float(), -1)).abs().max()))
    print(f"\nbf16 cached vs uncached prefill: max |dlogp| = {worst:.2e}, max rel |dh| = {worst_h:.2e}")
    assert worst < 5e-2 and worst_h < 1.5e-2


def test_stacked_batch_decode_matches_rows_alone(model):
    eps = _episodes(rows=4, turns=3)
    prefixes = eps[2]  # rows of different lengths: left padding of up to ~15 positions
    assert len({len(p) for p in prefixes}) > 1
    pc = PC.PrefixCache(10**9)
    for t in range(3):
        rs = PC.prefill_rows(model, eps[t], pc)
    text, head, emb = M._parts(model)
    steps = torch.randint(4, V, (4, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kv, mask, pos = PC.stack_rows(rs)
        batched = []
        for s in range(steps.shape[1]):
            h, mask, pos = PC._decode_step(text, emb(steps[:, s:s + 1]), kv, mask, pos)
            batched.append(torch.log_softmax(head(h), -1))
        worst = 0.0
        for i in range(4):
            one = PC.RowStates([pc.lookup(prefixes[i])[1]], rs.config, [0])
            kv1, m1, p1 = PC.stack_rows(one)
            assert m1.all() and int(p1) == len(prefixes[i])
            for s in range(steps.shape[1]):
                h1, m1, p1 = PC._decode_step(text, emb(steps[i:i + 1, s:s + 1]), kv1, m1, p1)
                worst = max(worst, float((torch.log_softmax(head(h1), -1)[0] - batched[s][i]).abs().max()))
    print(f"\nstacked left-padded decode vs rows alone: max |dlogp| = {worst:.2e}")
    assert worst < 1e-5  # measured ~1e-6; target 1e-3


def _scale_sigma(model):
    scale = M.embed_scale(model)
    return scale, 0.05 * scale


def test_latent_loop_cached_bitwise_and_close_to_uncached(model):
    eps = _episodes(rows=4, turns=2)
    scale, sigma = _scale_sigma(model)
    K = 4

    def run(pc):
        return PC.latent_loop_cached(model, eps[1], K, sigma, scale, TOKS, torch.Generator().manual_seed(7), pc)

    # cold: turn 0 stored the prompt; turn 1 computes each row's extension (layout: prompt, then extension)
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, eps[0], pc)
    pc.reset_counters()
    z1, q1 = run(pc)
    assert pc.computed_tokens == sum(len(p) - len(q) for p, q in zip(eps[1], eps[0]))
    # warm: every row is a full hit, nothing computed
    pc.reset_counters()
    z2, q2 = run(pc)
    assert pc.computed_tokens == 0 and pc.hits == 4
    assert torch.equal(z1, z2) and torch.equal(q1, q2)
    # cleared cache recomputing in the same chunk layout
    pc.clear()
    PC.prefill_rows(model, eps[0], pc)
    z3, q3 = run(pc)
    assert torch.equal(z1, z3) and torch.equal(q1, q3)
    # the thoughts never enter the cache: only the pure-token prefixes are stored
    assert pc.stored_lengths() == sorted([len(eps[0][0])] + [len(p) for p in eps[1]])
    # vs the uncached latent loop (one left-padded prefill of prefix ⊕ <think>), same eps draws
    z0, q0 = LT.latent_loop(model, eps[1], K, sigma, scale, TOKS, torch.Generator().manual_seed(7))
    dz, dq = float((z1 - z0).abs().max()), float(((q1 - q0) / q0).abs().max())
    print(f"\nlatent_loop_cached vs latent_loop: max |dz| = {dz:.2e} (|z| ~ {float(z0.abs().max()):.2f}), "
          f"max rel dlogq = {dq:.2e}")
    assert dz < 1e-4 and dq < 1e-5
    # no cache: rows computed in full, same draws
    z4, _ = PC.latent_loop_cached(model, eps[1], K, sigma, scale, TOKS, torch.Generator().manual_seed(7), None)
    assert torch.allclose(z4, z0, atol=1e-4, rtol=0)


def test_turn_boundaries_make_thoughts_bitwise_whatever_the_cache_holds(model):
    """With each row's earlier prefix lengths as chunk boundaries, turn 2's thoughts are identical bit for bit from
    a warm cache, no cache, a cache that lost turn 1, and a cache holding a stray non-boundary prefix."""
    eps = _episodes(rows=4, turns=3)
    scale, sigma = _scale_sigma(model)
    bounds = [[len(eps[s][i]) for s in range(2)] for i in range(4)]

    def turn2(pc):
        return PC.latent_loop_cached(model, eps[2], 3, sigma, scale, TOKS, torch.Generator().manual_seed(5), pc, bounds)

    warm = PC.PrefixCache(10**9)
    for t in range(2):
        PC.latent_loop_cached(model, eps[t], 3, sigma, scale, TOKS, torch.Generator().manual_seed(t), warm)
    z_warm, q_warm = turn2(warm)
    z_none, q_none = turn2(None)
    assert torch.equal(z_warm, z_none) and torch.equal(q_warm, q_none)
    lost = PC.PrefixCache(10**9)
    PC.prefill_rows(model, eps[0][:1], lost)
    lost.reset_counters()
    z_lost, q_lost = turn2(lost)
    assert torch.equal(z_warm, z_lost) and torch.equal(q_warm, q_lost)
    assert lost.computed_tokens == sum(len(p) - len(eps[0][0]) for p in eps[2])
    assert all(p in lost for p in eps[1])  # states at the cuts are stored on the way
    stray = PC.PrefixCache(10**9)
    PC.prefill_rows(model, [eps[0][0], eps[2][0][:-3]], stray)  # not a boundary of row 0: not restored from
    z_stray, _ = turn2(stray)
    assert torch.equal(z_warm, z_stray)


def test_multi_turn_latent_loop_counts_only_new_tokens(model):
    """Prefixes grow by answer ⊕ observation each turn; each turn computes exactly the new tokens (no extra)."""
    eps = _episodes(rows=4, turns=4, prompt=30)
    scale, sigma = _scale_sigma(model)
    pc = PC.PrefixCache(10**9)
    shares = []
    for t, prefixes in enumerate(eps):
        pc.reset_counters()
        z, q = PC.latent_loop_cached(model, prefixes, 3, sigma, scale, TOKS, torch.Generator().manual_seed(t), pc)
        assert z.shape == (4, 3, model.config.hidden_size) and q.shape == (4, 3)
        new = len(prefixes[0]) if t == 0 else sum(len(p) - len(o) for p, o in zip(prefixes, eps[t - 1]))
        assert pc.computed_tokens == new
        assert pc.input_tokens == sum(len(p) for p in prefixes)
        shares.append((pc.computed_tokens, pc.input_tokens))
    comp, inp = sum(c for c, _ in shares), sum(i for _, i in shares)
    print(f"\nper turn (computed, input): {shares}; total {comp}/{inp} = {comp / inp:.1%}")
    assert shares[0] == (30, 120) and comp / inp < 0.25


def test_sample_answers_cached_matches_uncached(model):
    eps = _episodes(rows=3, turns=2)
    scale, sigma = _scale_sigma(model)
    pc = PC.PrefixCache(10**9)
    PC.prefill_rows(model, eps[0], pc)
    z, _ = PC.latent_loop_cached(model, eps[1], 3, sigma, scale, TOKS, torch.Generator().manual_seed(1), pc)
    pc.reset_counters()
    ids, lps = PC.sample_answers_cached(model, eps[1], z, 8, 1.0, TOKS, torch.Generator().manual_seed(2), pc,
                                        limits=[8, 3, 8])
    assert pc.computed_tokens == 0  # the latent loop already stored every c_t
    prompts = [AN.prompt_embeddings(model, p, z[i], TOKS) for i, p in enumerate(eps[1])]
    ids0, lps0 = AN.sample_answers(model, prompts, 8, 1.0, TOKS, torch.Generator().manual_seed(2), limits=[8, 3, 8])
    assert ids == ids0 and len(ids[1]) <= 3
    for a, b in zip(lps, lps0):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# in the pipeline: generate-turn


def test_generate_turn_thoughts_bitwise_warm_or_cold_and_counters(tmp_path):
    """generate-turn runs the latent loop and the hf sampler through the prefix cache. A retried turn in a fresh
    process (cold cache) must give the stored thoughts and answers bit for bit (turn boundaries fix the chunk
    layout), and the step's later turns must compute only their new tokens."""
    import numpy as np

    from artifacts import read_json, read_table
    from engine import runtime
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from artifacts.tables import write_state
    from tests.conftest import make_run

    run_dir = make_run(tmp_path / "run", **{"gym.max_turns": 3})
    prep = read_json(f"{run_dir}/prepared.json")
    export = export_base(run_dir, prep["base"])["path"]
    state = sample_tasks(run_dir, 0, prep["base"])["path"]
    runtime.clear()
    states, outs, new_tokens = [], [], []
    for turn in range(3):
        states.append(state)
        tr = generate_turn(run_dir, 0, turn, state, prep["adapter_init"], export, prep["base"])
        outs.append(tr)
        # the next turn's state as the gym writes it (every episode continues): c_{t+1} = c_t ⊕ answer ⊕ 5 tool
        # tokens, the earlier prefix length appended to the row's boundaries
        answers = {r["row"]: r["answer_ids"] for r in read_table(tr["path"]).to_pylist()}
        new_tokens.append(sum(len(a) + 5 for a in answers.values()))
        rows = read_table(state).to_pylist()
        for r in rows:
            r["prefix_bounds"] = list(r["prefix_bounds"]) + [len(r["prefix_ids"])]
            r["prefix_ids"] = list(r["prefix_ids"]) + list(answers[r["row"]]) + [40 + r["row"] % 7] * 5
        state = str(tmp_path / f"gym-{turn}.arrow")
        write_state(state, rows, metadata={"step": "0"})
    first = outs[0]
    G = load_config(f"{run_dir}/config.yaml").grpo.num_generations
    # turn 0: each group's shared question is computed once by the trainer; the sampler computes nothing
    assert first["prefix_computed_tokens"] * G == first["prefix_input_tokens"] // 2
    for t in (1, 2):  # later turns: only each row's answer and tool-result tokens of the last turn, once
        assert outs[t]["prefix_computed_tokens"] == new_tokens[t - 1]
        assert outs[t]["prefix_input_tokens"] == outs[t - 1]["prefix_input_tokens"] + 2 * new_tokens[t - 1]  # 2 engines
    last = len(outs) - 1
    runtime.clear()  # a retry in a fresh worker: nothing cached
    again = generate_turn(run_dir, 0, last, states[last], prep["adapter_init"], export, prep["base"],
                          out_path=str(tmp_path / "again.arrow"))
    assert again["prefix_computed_tokens"] > outs[last]["prefix_computed_tokens"]  # it did recompute the prefixes
    a, b = read_table(outs[last]["path"]), read_table(again["path"])
    for col in ("thoughts", "thought_logq", "answer_ids", "sampler_logps"):
        for x, y in zip(a.column(col).to_pylist(), b.column(col).to_pylist()):
            assert np.array_equal(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)), col


def test_generate_turn_static_path_on_cpu(tmp_path):
    """The GPU generation path (per-row prefill, static cache loops) wired through generate-turn, run eagerly on the
    CPU: same eps draws, thoughts within fp32 rounding of the prefix-cached loop, answers' log-probs likewise."""
    import numpy as np

    from artifacts import read_json, read_table
    from engine import runtime
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from tests.conftest import make_run

    run_dir = make_run(tmp_path / "run")
    cfg = run_config(run_dir)
    prep = read_json(f"{run_dir}/prepared.json")
    export = export_base(run_dir, prep["base"])["path"]
    state = sample_tasks(run_dir, 0, prep["base"])["path"]
    runtime.clear()
    ref = generate_turn(run_dir, 0, 0, state, prep["adapter_init"], export, prep["base"],
                        out_path=str(tmp_path / "ref.arrow"))
    runtime.trainer(cfg, prep["base"], prep["base"]).graphs = True
    runtime.sampler(cfg, export, prep["base"]).graphs = True
    got = generate_turn(run_dir, 0, 0, state, prep["adapter_init"], export, prep["base"],
                        out_path=str(tmp_path / "static.arrow"))
    assert runtime.trainer(cfg, prep["base"], prep["base"]).latent_graph().stats() is not None
    a, b = read_table(ref["path"]), read_table(got["path"])
    za = np.stack([np.asarray(x, dtype=np.float32) for x in a.column("thoughts").to_pylist()])
    zb = np.stack([np.asarray(x, dtype=np.float32) for x in b.column("thoughts").to_pylist()])
    assert np.abs(za - zb).max() < 1e-4
    same = [x == y for x, y in zip(a.column("answer_ids").to_pylist(), b.column("answer_ids").to_pylist())]
    assert sum(same) >= len(same) - 1  # sampled tokens may flip only where rounding meets a boundary
    for x, y, ok in zip(a.column("sampler_logps").to_pylist(), b.column("sampler_logps").to_pylist(), same):
        if ok:
            assert np.abs(np.asarray(x) - np.asarray(y)).max() < 1e-3  # fp32: other kernels (grouped attention)
    runtime.clear()


@pytest.mark.gpu
def test_turn_boundaries_bitwise_on_cuda_graphed():
    """On the GPU (bf16, CUDA-graph latent loop after the per-row prefill): turn 2's thoughts are identical bit for
    bit from a warm cache, no cache and a cache that lost turn 1, and equal to the eager static path."""
    from engine.cuda_graphs import GraphedLatentLoop

    model = _model("bfloat16").cuda().eval()
    eps = _episodes(rows=4, turns=3)
    scale, sigma = _scale_sigma(model)
    bounds = [[len(eps[s][i]) for s in range(2)] for i in range(4)]
    loop = GraphedLatentLoop(model)

    def turn2(pc, runner=loop):
        rs = PC.prefill_rows(model, eps[2], pc, bounds)
        return runner.run_rows(rs, 5, sigma, scale, TOKS, torch.Generator().manual_seed(5))

    warm = PC.PrefixCache(10**9)
    for t in range(2):
        PC.prefill_rows(model, eps[t], warm, [b[:t] for b in bounds])
    warm.reset_counters()
    z_warm, q_warm = turn2(warm)
    assert warm.computed_tokens == sum(len(p) - len(q) for p, q in zip(eps[2], eps[1]))
    z_none, q_none = turn2(None)
    lost = PC.PrefixCache(10**9)
    PC.prefill_rows(model, eps[0][:1], lost)
    z_lost, q_lost = turn2(lost)
    z_eager, q_eager = turn2(None, GraphedLatentLoop(model, graphed=False))
    assert loop.counts.get("replay", 0) > 0
    for z, q in ((z_none, q_none), (z_lost, q_lost), (z_eager, q_eager)):
        assert torch.equal(z_warm, z) and torch.equal(q_warm, q)


@pytest.mark.parametrize("static", [False, True], ids=["cached-loop", "static-path"])
def test_latent_engine_sampler_gives_the_trainers_thoughts_on_an_unquantized_base(tmp_path, static):
    """latent.engine: sampler runs the latent loop on the hf sampler's model. On an unquantized base that model holds
    the trainer's weights in the trainer's dtype, so thoughts, densities and answers must equal the trainer's bit for
    bit, through the one prefix cache both engines share (the same tokens computed) -- on the prefix-cached loops and
    on the GPU's static path run eagerly (the sampler engine then holds both static loops, each with its frozen
    adapter). auto keeps the trainer there; a sampler holding another adapter is refused."""
    import numpy as np

    from artifacts import read_json, read_table
    from engine import runtime
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from tests.conftest import make_run

    outs = {}
    for engine in ("trainer", "sampler"):
        run_dir = make_run(tmp_path / engine, **{"latent.engine": engine})
        prep = read_json(f"{run_dir}/prepared.json")
        export = export_base(run_dir, prep["base"])["path"]
        state = sample_tasks(run_dir, 0, prep["base"])["path"]
        runtime.clear()
        if static:
            cfg = run_config(run_dir)
            runtime.trainer(cfg, prep["base"], prep["base"]).graphs = True
            runtime.sampler(cfg, export, prep["base"]).graphs = True
        outs[engine] = generate_turn(run_dir, 0, 0, state, prep["adapter_init"], export, prep["base"])
        assert outs[engine]["latent_engine"] == engine
        if static:
            thinker = (runtime.sampler if engine == "sampler" else runtime.trainer)(
                cfg, export if engine == "sampler" else prep["base"], prep["base"])
            assert thinker.latent_graph().stats()["counts"].get("eager", 0) > 0  # the static loop ran here
    a, b = read_table(outs["trainer"]["path"]), read_table(outs["sampler"]["path"])
    for col in ("thoughts", "thought_logq", "answer_ids", "sampler_logps"):
        for x, y in zip(a.column(col).to_pylist(), b.column(col).to_pylist()):
            assert np.array_equal(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)), col
    for k in ("prefix_input_tokens", "prefix_computed_tokens"):
        assert outs["trainer"][k] == outs["sampler"][k], k

    cfg = run_config(run_dir).with_overrides(**{"latent.engine": "auto"})
    tr = runtime.trainer(cfg, prep["base"], prep["base"])
    sm = runtime.sampler(cfg, export, prep["base"])
    assert runtime.latent_engine(cfg, tr, sm) is tr  # auto: the trainer unless the base is NF4
    sm.adapter_digest = "another"
    with pytest.raises(RuntimeError, match="load the same adapter"):
        runtime.latent_engine(cfg.with_overrides(**{"latent.engine": "sampler"}), tr, sm)
    runtime.clear()


def test_latent_engine_sampler_needs_the_hf_sampler():
    with pytest.raises(ValueError, match="latent.engine: trainer"):
        load_config("tiny").with_overrides(**{"latent.engine": "sampler", "sampler.kind": "vllm",
                                              "model.dtype": "bfloat16"})


def test_sampler_on_the_trainers_weights_samples_what_the_export_samples(tmp_path):
    """sampler.weights: trainer -- the hf sampler is the trainer engine itself (one copy of the base on the device: the
    NF4 27B step on one 80 GB GPU). On an unquantized base the export holds the same weights in the same dtype, so a
    turn's thoughts, densities, answers and sampler log-probs equal the export's bit for bit; the export stage writes
    only a sealed note; an export made for the other setting is refused with the command that fixes it."""
    from pathlib import Path

    import numpy as np

    from artifacts import read_json, read_table
    from engine import runtime
    from stages.context import run_config
    from stages.export import export_base
    from stages.generate import generate_turn, sample_tasks
    from tests.conftest import make_run

    outs, exports = {}, {}
    for weights in ("export", "trainer"):
        run_dir = make_run(tmp_path / weights, **{"sampler.weights": weights})
        prep = read_json(f"{run_dir}/prepared.json")
        ex = export_base(run_dir, prep["base"])
        exports[weights] = ex["path"]
        state = sample_tasks(run_dir, 0, prep["base"])["path"]
        runtime.clear()
        outs[weights] = generate_turn(run_dir, 0, 0, state, prep["adapter_init"], ex["path"], prep["base"])
        cfg = run_config(run_dir)
        tr = runtime.trainer(cfg, prep["base"], prep["base"])
        sm = runtime.sampler(cfg, ex["path"], prep["base"])
        assert (sm is tr) == (weights == "trainer")
        assert outs[weights]["latent_engine"] == "trainer"
    assert ex["on_trainer"] and sorted(p.name for p in Path(exports["trainer"]).iterdir()) == \
        [runtime.SAMPLER_ON_TRAINER, runtime.SAMPLER_ON_TRAINER + ".sha256"]  # the note and its seal
    assert export_base(run_dir, prep["base"])["path"] == exports["trainer"]  # stable across calls
    a, b = read_table(outs["export"]["path"]), read_table(outs["trainer"]["path"])
    for col in ("thoughts", "thought_logq", "answer_ids", "sampler_logps"):
        for x, y in zip(a.column(col).to_pylist(), b.column(col).to_pylist()):
            assert np.array_equal(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)), col
    with pytest.raises(ValueError, match="made for sampler.weights=export.*--stage export"):
        runtime.sampler(run_config(run_dir), exports["export"], prep["base"])
    with pytest.raises(ValueError, match="sampler.weights=trainer"):
        load_config("tiny").with_overrides(**{"sampler.weights": "trainer", "sampler.kind": "vllm",
                                              "model.dtype": "bfloat16"})
    runtime.clear()
