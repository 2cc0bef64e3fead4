"""Prefix-shared replay (engine/shared_replay.py): the forest of distinct prefixes, shared packing, and scores and
gradients against the per-turn path (FP32: to summation order; every tier; bit for bit between two runs).

Reference: engine.scoring.score_turns (each turn forwarded alone from its first token), the kept-graph path."""

from __future__ import annotations

import pytest
import torch

from tests.test_replay_memory import ARCH, _Eng, _grads, _model, _objective, _zero, tiered_gradients


def episodes(groups: int = 2, rows: int = 2, turns: int = 3, K: int = 3, seed: int = 1):
    """Rows of multi-turn episodes as a gym writes them: a group's rows share the prompt c_0, and each turn's prefix
    is the previous one plus its answer and an observation (thoughts are not carried over)."""
    from engine.replay import Turns

    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(4, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    P, Z, A, R = [], [], [], []
    r = 0
    for _ in range(groups):
        c0 = ids(20, 50)
        for _ in range(rows):
            c = list(c0)
            for _ in range(turns):
                a = ids(2, 9)
                P.append(list(c))
                Z.append(torch.randn(K, ARCH["hidden_size"], generator=g))
                A.append(a)
                R.append(r)
                c = c + a + ids(3, 12)
            r += 1
    return Turns(P, Z, A, R)


def test_forest_shares_a_groups_prompt_and_each_rows_earlier_turns():
    from engine.shared_replay import forest, shared_tokens, units

    t = episodes(groups=2, rows=3, turns=2)
    nodes = forest(t.prefixes, t.rows)
    # per group: one prompt node (3 first turns branch there) + one node per row's second turn, parented to it
    assert len(nodes) == 2 * (1 + 3)
    roots = [n for n in nodes if n.parent < 0]
    assert [len(n.turns) for n in roots] == [3, 3] and all(n.start == 0 for n in roots)
    for n in nodes:
        if n.parent >= 0:
            p = nodes[n.parent]
            assert n.prefix[:p.end] == p.prefix and n.start == p.end and len(n.turns) == 1
    assert sorted(j for n in nodes for j in n.turns) == list(range(len(t.rows)))
    # each turn's prefix tokens are forwarded once per distinct prefix: fewer than turn by turn
    assert shared_tokens(t.prefixes, t.thoughts, t.answers, t.rows) < sum(t.lengths())
    assert units(t.prefixes, t.rows) == [list(range(6)), list(range(6, 12))]
    # a one-token extension is forwarded from the node before (a one-token chunk would take the in-place decode path)
    p1 = [list(t.prefixes[0]), list(t.prefixes[0]) + [5], list(t.prefixes[0]) + [5, 6, 7]]
    n1 = forest(p1, [0, 0, 0])
    assert [(n.parent, n.start) for n in n1] == [(-1, 0), (-1, 0), (1, len(p1[1]))]
    # a row whose later prefix does not extend its earlier one starts over from the empty state
    p2 = [list(p) for p in t.prefixes]
    p2[1] = [7] + p2[1]
    nodes2 = forest(p2, t.rows)
    assert any(n.parent < 0 and n.prefix == tuple(p2[1]) for n in nodes2)


def test_schedule_runs_a_recipe_group_in_turns_plus_one_forwards():
    """Recipe-like group (equal answer and tool lengths): the prompt; then per wave every row's next prefix with every
    row's current branch in one batch; the last branches: turns + 1 forwards. With unequal lengths the prefixes of a
    wave split by length (each batch unpadded) and the branches join the longest."""
    from engine.shared_replay import branch_length, forest, schedule, shared_tokens

    rows, turns, K, L, obs = 4, 4, 4, 8, 12  # a branch (1 + K + L = 13) fits in a next prefix (20)
    c0 = list(range(10, 60))
    P, Z, A, R = [], [], [], []
    ctx = [list(c0) for _ in range(rows)]
    for t in range(turns):
        for r in range(rows):
            a = [100 + 10 * r + t] * L
            P.append(list(ctx[r]))
            Z.append(torch.zeros(K, 4))
            A.append(a)
            R.append(r)
            ctx[r] += a + [200 + r] * obs
    nodes = forest(P, R)
    batches = schedule(nodes, [branch_length(z, a) for z, a in zip(Z, A)])
    assert len(batches) == turns + 1
    assert [len(b.items) for b in batches] == [1] + [2 * rows] * (turns - 1) + [rows]
    assert all(b.T == L + obs for b in batches[1:-1]) and batches[-1].T == 1 + K + L
    made = {-1}
    for b in batches:  # every base exists before it is used
        assert set(b.bases) <= made
        made |= {i for k, i in b.items if k == "node"}
    assert sorted(i for b in batches for k, i in b.items if k == "turn") == list(range(rows * turns))
    assert shared_tokens(P, Z, A, R) == sum(len(b.items) * b.T for b in batches) < sum(
        len(p) + K + len(a) + 1 for p, a in zip(P, A))
    t = episodes(groups=1, rows=3, turns=3)  # random lengths
    nodes = forest(t.prefixes, t.rows)
    for b in schedule(nodes, [branch_length(z, a) for z, a in zip(t.thoughts, t.answers)]):
        assert len({nodes[i].end - nodes[i].start for k, i in b.items if k == "node"}) <= 1
        assert all(branch_length(t.thoughts[j], t.answers[j]) <= b.T for k, j in b.items if k == "turn")


def test_pack_shared_keeps_groups_whole_splits_an_oversized_group_into_rows_and_is_deterministic():
    from engine.shared_replay import pack_shared, shared_tokens

    t = episodes(groups=3, rows=2, turns=3)
    args = (t.prefixes, t.thoughts, t.answers, t.rows)
    big, tokens, _ = pack_shared(*args, 10**6)
    assert big == [list(range(18))] and tokens == [shared_tokens(*args)]
    group = shared_tokens(*(x[:6] for x in args))
    mbs, tokens, _ = pack_shared(*args, group)
    assert sorted(sorted(m) for m in mbs) == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))] or \
        all(len(m) % 3 == 0 for m in mbs)  # whole groups (or rows, where a group exceeds the size)
    assert all(n <= group for n in tokens) or len(mbs) == 6
    small, tokens_small, _ = pack_shared(*args, 1)  # nothing fits: every row alone, its turns still together
    assert sorted(small) == [list(range(3 * r, 3 * r + 3)) for r in range(6)]
    assert pack_shared(*args, group) == (mbs, tokens, None)


def test_workers_get_whole_groups_with_share_prefix():
    """The pool's replay split (stages.replay.split_turns): by turn without units; with replay.share_prefix's units
    each group's turns land on one worker, balanced by the tokens each group forwards."""
    from stages.replay import shared_units, split_turns

    t = episodes(groups=4, rows=2, turns=2)
    units = shared_units(t)
    assert [ids for ids, _ in units] == [list(range(4 * g, 4 * g + 4)) for g in range(4)]
    split = split_turns(t.lengths(), 2, units)
    assert sorted(i for ids in split.values() for i in ids) == list(range(16))
    for ids, _ in units:
        assert sum(set(ids) <= set(w) for w in split.values()) == 1
    load = [sum(n for ids, n in units if set(ids) <= set(w)) for w in split.values()]
    assert max(load) - min(load) <= max(n for _, n in units)
    by_turn = split_turns(t.lengths(), 2)
    assert sorted(i for ids in by_turn.values() for i in ids) == list(range(16))


@pytest.mark.parametrize("tier", ["keep", "checkpoint"])
def test_states_are_freed_by_reference_counting_not_left_to_the_cycle_collector(tier, monkeypatch):
    """Every state tensor a shared scoring makes (forward and checkpoint recompute: K/V, conv and recurrent states)
    is freed once backward is done, with Python's cycle collector off: at the 27B width a reference cycle (a cache
    layer <-> its bound update method, a checkpoint's closure holding the recomputed state) kept ~27 GB alive until
    the collector happened to run (bench/results/h100-replay-27b-shared-prefix-2026-12-06.json: the second run's
    preflight saw 43.7 GB resident instead of 16.9)."""
    import gc
    import weakref

    from transformers.cache_utils import DynamicLayer

    from configs.schema import ReplayConfig
    from engine import shared_replay as SR
    from engine.replay import score_microbatch

    model = _model("dora", "float32")
    eng, turns = _Eng(model), episodes()
    idx = list(range(len(turns.rows)))
    rc = ReplayConfig(share_prefix=True, keep_graph_tokens=0 if tier == "checkpoint" else None)
    with torch.no_grad():
        score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)  # creates the functional layer classes
    refs = []

    def recording(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            refs.extend(weakref.ref(t) for t in (out if isinstance(out, tuple) else (out,)))
            return out
        return call

    for cls in SR._CLASSES.values():
        monkeypatch.setattr(cls, "update_conv_state", recording(SR._conv_update))
        monkeypatch.setattr(cls, "update_recurrent_state", recording(SR._recurrent_update))
    monkeypatch.setattr(DynamicLayer, "update", recording(DynamicLayer.update))
    gc.collect()
    gc.disable()
    try:
        _zero(model)
        with torch.enable_grad():
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)
        _objective(a, q, idx).backward()
        del a, q
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert len(refs) > 50 and alive == 0, (len(refs), alive)


@pytest.mark.parametrize("adapter_type", ["lora", "dora"])
def test_shared_scores_and_gradients_equal_the_per_turn_path_in_every_tier(adapter_type):
    """FP32: values to ~1e-6 and gradients to relative L2 ~1e-6 of the per-turn kept graph (a chunked recurrence
    sums in another order); the checkpoint tiers really recompute (layer forwards counted) and equal the shared kept
    graph bit for bit; two runs of the same micro-batch give the same bits (the replay-determinism gate)."""
    from configs.schema import ReplayConfig
    from engine import model as M
    from engine.replay import score_microbatch

    model = _model(adapter_type, "float32")
    eng, turns = _Eng(model), episodes()
    idx = list(range(len(turns.rows)))
    layers = list(M._parts(model)[0].layers)
    calls = [0]
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for layer in layers]
    res = {}
    try:
        for name, tier, share, keeps in (("turns", "keep", False, "inputs"), ("keep", "keep", True, "inputs"),
                                         ("ckpt", "checkpoint", True, "inputs"),
                                         ("ckpt_mm", "checkpoint", True, "matmuls")):
            rc = ReplayConfig(share_prefix=share, checkpoint_keeps=keeps, logprob_chunk=300)
            _zero(model)
            calls[0] = 0
            with torch.enable_grad():
                a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, tier, rc)
            fwd = calls[0]
            _objective(a, q, idx).backward()
            res[name] = ([x.detach() for x in a], q.detach(), _grads(model), fwd, calls[0] - fwd)
    finally:
        for h in hooks:
            h.remove()
    ra, rq, rg = res["turns"][:3]

    def rel(g):
        return (sum(float((g[k] - rg[k]).pow(2).sum()) for k in rg) ** 0.5
                / sum(float(rg[k].pow(2).sum()) for k in rg) ** 0.5)

    a, q, g_keep, fwd_keep, bwd_keep = res["keep"]
    assert max(float((x - y).abs().max()) for x, y in zip(a, ra)) < 1e-5
    assert float(((q - rq).abs() / rq.abs()).max()) < 1e-5
    assert rel(g_keep) < 1e-5, rel(g_keep)
    # (decoder layer bodies counted through their MLP: the checkpoint's recompute calls the layer's forward directly)
    assert bwd_keep == 0 and res["turns"][4] == 0
    for name in ("ckpt", "ckpt_mm"):
        a2, q2, g2, fwd, bwd = res[name]
        assert bwd == fwd == fwd_keep, (name, fwd, bwd)  # every layer call recomputed once in backward
        assert all(torch.equal(x, y) for x, y in zip(a2, a)) and torch.equal(q2, q)
        assert all(torch.equal(g2[k], g_keep[k]) for k in g_keep), name
    rc = ReplayConfig(share_prefix=True, logprob_chunk=300)
    with torch.no_grad():
        a3, q3 = score_microbatch(eng, turns, idx, 1.0, 0.05, "two_pass", rc)
    assert all(torch.equal(x, y) for x, y in zip(a3, a)) and torch.equal(q3, q)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_tiers_through_the_production_backward_equal_the_kept_graph(dtype):
    """keep / checkpoint / two-pass micro-batches of whole groups (plan_replay with the shared packer) through
    stages.optimize.accumulate_gradients give the kept graph's gradients bit for bit; in FP32 within the
    gradient-equivalence gate of the per-turn FP32 reference."""
    from configs.schema import ReplayConfig
    from engine.replay import score_microbatch
    from engine.shared_replay import shared_tokens
    from stages.gradcheck import REL_L2_MAX, compare

    turns = episodes(groups=3)
    weights_a = [torch.linspace(-1, 1, len(a)) for a in turns.answers]
    weights_q = [torch.full((3,), 0.01 * (i + 1)) for i in range(len(turns.rows))]

    def run(rc, model):
        return tiered_gradients(model, turns, rc, weights_q, weights_a)

    model = _model("dora", dtype)
    one_group = max(shared_tokens(*(x[6 * k: 6 * k + 6] for x in (turns.prefixes, turns.thoughts, turns.answers,
                                                                  turns.rows))) for k in range(3))
    base = dict(share_prefix=True, microbatch_tokens=one_group)  # one group per micro-batch
    g_keep, p_keep = run(ReplayConfig(**base), model)
    g_ckpt, p_ckpt = run(ReplayConfig(**base, keep_graph_tokens=0), model)
    g_two, p_two = run(ReplayConfig(**base, keep_graph_tokens=0, checkpoint_tokens=0), model)
    g_mix, p_mix = run(ReplayConfig(**base, keep_graph_tokens=p_keep.tokens[0],
                                    checkpoint_tokens=sum(p_keep.tokens[:2])), model)
    assert len(p_keep.microbatches) == 3 and all(len(m) == 6 for m in p_keep.microbatches)
    assert set(p_ckpt.tiers) == {"checkpoint"} and set(p_two.tiers) == {"two_pass"}
    assert {"keep", "checkpoint", "two_pass"} <= set(p_mix.tiers)
    for g in (g_ckpt, g_two, g_mix):
        assert all(torch.equal(g[k], g_keep[k]) for k in g_keep)
    if dtype != "float32":
        return
    ref_model = _model("dora", "float32")
    ref_model.load_state_dict(model.state_dict())
    _zero(ref_model)
    idx = list(range(len(turns.rows)))
    with torch.enable_grad():
        a, q = score_microbatch(_Eng(ref_model), turns, idx, 1.0, 0.05)  # per turn, PEFT's forward, full softmax
        sum((weights_a[n] * a[n]).sum() + (weights_q[n] * q[n]).sum() for n in idx).backward()
    got = compare(g_keep, _grads(ref_model))
    assert got["passed"] and got["rel_l2"] <= REL_L2_MAX, got


@pytest.mark.gpu
def test_shared_replay_on_the_gpu_kernels_matches_the_per_turn_pytorch_path():
    """On CUDA with the GDN kernels engine/gdn.py qualifies (fla's chunk then continues from states that carry
    gradients, and receives the final state's gradient): in FP32 against the per-turn path on the PyTorch reference
    kernels, the shared path's error is no larger than the same kernels' error turn by turn (sharing adds only
    summation order)."""
    from configs.schema import ReplayConfig
    from engine import gdn
    from engine import model as M
    from engine.replay import score_microbatch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    model = _model("dora", "float32").to(dev)
    eng, turns = _Eng(model), episodes(groups=2, rows=2, turns=3)
    idx = list(range(len(turns.rows)))
    config = M._parts(model)[0].config
    out = {}
    for label, mode, share in (("reference", "torch", False), ("turns", "auto", False), ("shared", "auto", True)):
        chosen = gdn.install(mode, config, dev)
        _zero(model)
        rc = ReplayConfig(share_prefix=share, logprob_chunk=300, keep_graph_tokens=0)  # checkpoint tier
        with torch.enable_grad():
            a, q = score_microbatch(eng, turns, idx, 1.0, 0.05, "checkpoint", rc)
        _objective([x.cpu() for x in a], q.cpu(), idx).backward()
        out[label] = ([x.detach().cpu() for x in a], _grads(model), chosen)
    gdn.install("auto", config, dev)
    ra, rg, _ = out["reference"]

    def errs(label):
        a, g, _ = out[label]
        rel = (sum(float((g[k] - rg[k]).pow(2).sum()) for k in rg) ** 0.5
               / sum(float(rg[k].pow(2).sum()) for k in rg) ** 0.5)
        return max(float((x - y).abs().max()) for x, y in zip(a, ra)), rel

    (da_t, rel_t), (da_s, rel_s) = errs("turns"), errs("shared")
    print(f"GDN kernels {out['shared'][2]}: vs the per-turn PyTorch path, answer log-prob max error / gradient rel L2:"
          f" per turn {da_t:.2e} / {rel_t:.2e}, shared {da_s:.2e} / {rel_s:.2e}")
    assert da_s <= 2 * da_t + 1e-5 and rel_s <= 2 * rel_t + 1e-5
    assert rel_s < gdn.QUALIFY_REL_L2


def test_preflight_counts_the_shared_states_a_micro_batch_keeps():
    """state_bytes matches the tensors one node's state really holds (K/V of its prefix, conv and recurrent states),
    and plan_replay adds each shared micro-batch's states to what its tier keeps and their gradients to what its
    backward holds in flight, and a budget that fits the tokens but not the states is refused naming the setting."""
    from configs.schema import ReplayConfig
    from engine import model as M
    from engine import shared_replay as SR
    from engine.replay import STATE_GRAD_SHARE, ReplayMemoryError, TokenCosts, packer_for, plan_replay

    model = _model("dora", "float32")
    text = M._parts(model)[0]
    turns = episodes(groups=2)
    nodes = SR.forest(turns.prefixes[:1], turns.rows[:1])
    cache = SR.functional_cache(text.config)
    with torch.no_grad():
        text(input_ids=torch.tensor([turns.prefixes[0]]), **M.cache_kw(cache), use_cache=True)
    held = sum(t.numel() * t.element_size() for st in SR.cache_states(cache) if st is not None for t in st)
    assert SR.state_bytes(text.config, nodes, [], dtype_bytes=4) == held

    rc = ReplayConfig(share_prefix=True, keep_graph_tokens=0)
    costs = TokenCosts(keep=4e6, checkpoint=1e4, transient=2e4, source="config")
    bare = plan_replay(turns.lengths(), rc, costs, 0.0, 1e12, packer=packer_for(turns, rc))
    full = plan_replay(turns.lengths(), rc, costs, 0.0, 1e12, packer=packer_for(turns, rc, model))
    assert bare.microbatches == full.microbatches and bare.tokens == full.tokens
    assert full.extra_bytes and all(e > 0 for e in full.extra_bytes)
    # kept until backward: each micro-batch's tokens in its tier and its states; in flight: the largest micro-batch's
    # transient per token and, in its backward, its states' gradients (STATE_GRAD_SHARE of the states)
    assert set(full.tiers) == {"checkpoint"}
    want = sum(costs.checkpoint * n + e for n, e in zip(full.tokens, full.extra_bytes)) + costs.fixed + max(
        costs.transient * n + STATE_GRAD_SHARE * e for n, e in zip(full.tokens, full.extra_bytes))
    assert full.est_peak_bytes == pytest.approx(want)
    assert full.est_peak_bytes >= bare.est_peak_bytes + (1 + STATE_GRAD_SHARE) * max(full.extra_bytes) - 1
    assert full.summary()["state_gb"] > 0
    tight = bare.est_peak_bytes + 0.5 * sum(full.extra_bytes)
    plan_replay(turns.lengths(), rc, costs, 0.0, tight, packer=packer_for(turns, rc))  # tokens alone fit
    one = ReplayConfig(share_prefix=True, keep_graph_tokens=0, checkpoint_tokens=10**9, microbatch_tokens=10**6)
    with pytest.raises(ReplayMemoryError, match="replay.checkpoint_tokens"):
        plan_replay(turns.lengths(), one, costs, 0.0, tight, packer=packer_for(turns, one, model))
