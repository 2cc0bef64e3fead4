"""Replay: re-score stored turns with gradients, plan its memory, and lay per-turn terms out as GRPO sequences.

A rollout's GRPO "completion" is the concatenation over its turns of [thought terms (K), answer tokens (L)]:
thought terms carry log q(z_k) under the current policy (behaviour: the generation-time density), answer tokens
carry log pi(a_i) (behaviour: the sampler's log-prob). One advantage per rollout, as in TRL.

Memory policy (the run's ``replay:`` config). Replay is planned before it runs:
    pack        micro-batches of whole turns by padded token count (rows x longest), longest turns first, short
                turns of several groups sharing one; a turn is never split.
    tiers       by cumulative tokens on the device: keep the whole autograd graph until optimize (fastest), then
                activation checkpointing per decoder layer (keeps layer inputs only, or with replay.checkpoint_keeps:
                matmuls also the matrix products' outputs: less recompute), then two-pass: scored without
                a graph; optimize re-forwards each such micro-batch with its gradient weights and back-propagates it
                at once, after checking the re-forward equals the first pass bit for bit (gate replay-determinism).
    one pass    (replay.one_pass) instead of tiers: each micro-batch is back-propagated inside replay right after its
                forward, with the loss weights the driver will compute, and its graph freed at once -- one forward
                and one backward per token, no graph kept across micro-batches, no recompute in optimize. Its graph
                in flight keeps everything when that fits, else is checkpointed (replay.checkpoint_keeps). Optimize
                checks the weights it computes equal the ones used, bit for bit.
    preflight   peak = resident + kept graph of the keep/checkpoint tiers + the micro-batch in flight, from bytes
                per token measured on the device (CUDA allocator, one probe turn per engine), given in the config,
                or estimated from the architecture; a plan that cannot fit stops before replay with a message that
                names the setting to change (never an out-of-memory error halfway through a step).
Scoring uses engine.adapter_grad (PEFT's forward arithmetic with a lean backward) and engine.logprobs (selected-token
log-probs from vocabulary chunks) unless ``replay.adapter_forward: peft``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from engine import model as M
from engine import scoring as SC

TIERS = ("keep", "checkpoint", "two_pass", "one_pass")
GRAPHS = ("keep", "checkpoint")  # a one-pass micro-batch's graph in flight
GiB = 2**30


@dataclass
class Turns:
    """Stored turns, in rollouts.arrow order."""

    prefixes: list[list[int]]
    thoughts: list[torch.Tensor]  # (K, d) fp32 each
    answers: list[list[int]]
    rows: list[int]

    def lengths(self) -> list[int]:
        return [len(p) + z.shape[0] + len(a) + 1 for p, z, a in zip(self.prefixes, self.thoughts, self.answers)]


@dataclass
class OnePass:
    """A one-pass micro-batch in a step's live graphs: replay back-propagated it already, with these weights (per turn
    of `idx`); optimize keeps the gradients only if its own weights equal them bit for bit."""

    idx: list[int]
    w_thought: list[torch.Tensor]
    w_answer: list[torch.Tensor]


class LiveGraphs(list):
    """Per micro-batch: (idx, answer lp, thought logq) with their graphs, None (two-pass), or OnePass. `grads`: after a
    one-pass replay, each adapter parameter's .grad and its version counter, so optimize can tell they are untouched."""

    grads: list | None = None


# ----------------------------------------------------------------------------------------------------------------
# the plan: micro-batches of whole turns, a memory tier per micro-batch, and the preflight


# replay.share_prefix: a micro-batch's backward also holds gradients of the shared states it kept (the K/V of each
# prefix, the GDN states), up to as many bytes as the states themselves. Counted in full: measured on one H100 at the
# 27B width (one recipe group, checkpoint tier, bench/results/h100-replay-27b-shared-prefix-2026-12-07.json), the
# estimate without them came to 38.5 GB for a 44.5 GB peak (0.865), with states of 12.8 GB.
STATE_GRAD_SHARE = 1.0


class ReplayMemoryError(RuntimeError):
    """The planned replay cannot fit the device; the message names the setting to change. Raised before replay."""


@dataclass(frozen=True)
class TokenCosts:
    """Bytes per replayed (padded) token, per tier, of one engine on one device.

    keep        autograd graph kept per token without checkpointing (held until optimize back-propagates it)
    checkpoint  kept per token with activation checkpointing per decoder layer (layer inputs only)
    transient   extra bytes per token of the micro-batch in flight (its forward / one layer's recompute and its
                backward), on top of what is kept. A two-pass micro-batch in flight also holds its re-forward's
                checkpointed graph: the plan adds `checkpoint` per token for it when it has two-pass micro-batches"""

    keep: float
    checkpoint: float
    transient: float
    source: str  # measured (CUDA allocator, measure_costs) | estimated (architecture) | config
    fixed: float = 0.0  # size-independent bytes in flight (e.g. one dequantized NF4 weight), added once

    def as_dict(self) -> dict:
        return {"keep_mb": self.keep / 2**20, "checkpoint_mb": self.checkpoint / 2**20,
                "transient_mb": self.transient / 2**20, "fixed_gb": self.fixed / GiB, "source": self.source}


@dataclass
class ReplayPlan:
    """Micro-batches (turn indices), their padded token counts and tiers, and the preflight's peak estimate."""

    microbatches: list[list[int]]
    tokens: list[int]
    tiers: list[str]
    est_peak_bytes: float | None = None
    budget_bytes: float | None = None
    base_bytes: float | None = None
    costs: TokenCosts | None = None
    graphs: list[str] | None = None  # one-pass plans: each micro-batch's graph in flight (GRAPHS)
    extra_bytes: list[float] | None = None  # per micro-batch, beside its tokens (replay.share_prefix: shared states)

    @property
    def one_pass(self) -> bool:
        return bool(self.tiers) and all(t == "one_pass" for t in self.tiers)

    def summary(self) -> dict:
        out = {"microbatches": len(self.microbatches),
               "tier_tokens": {t: sum(n for n, x in zip(self.tokens, self.tiers) if x == t) for t in TIERS},
               "tier_microbatches": {t: self.tiers.count(t) for t in TIERS}}
        if self.graphs is not None:
            out["one_pass_graphs"] = {g: self.graphs.count(g) for g in GRAPHS}
        if self.extra_bytes:
            out["state_gb"] = round(sum(self.extra_bytes) / GiB, 3)
        if self.est_peak_bytes is not None:
            out["est_peak_gb"] = round(self.est_peak_bytes / GiB, 3)
        if self.budget_bytes is not None:
            out["budget_gb"] = round(self.budget_bytes / GiB, 3)
        if self.costs is not None:
            out["token_costs"] = {k: (round(v, 4) if isinstance(v, float) else v)
                                  for k, v in self.costs.as_dict().items()}
        return out


def pack(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches of whole turns whose padded size (rows x longest) stays within max_tokens.

    Turns are taken longest first (ties in stored order) and each goes to the first micro-batch it fits, so turns of
    similar length share one (little left padding) and short turns of several groups fill one. A turn is never
    split: one longer than max_tokens gets a micro-batch of its own. Deterministic in (lengths, max_tokens), so
    optimize re-derives exactly the plan replay ran. Indices inside a micro-batch are in stored order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if max(longest[b], lengths[i]) * (len(bins[b]) + 1) <= max_tokens:
                bins[b].append(i)
                longest[b] = max(longest[b], lengths[i])
                break
        else:
            bins.append([i])
            longest.append(lengths[i])
    return [sorted(b) for b in bins]


def padded_tokens(lengths: list[int], idx: list[int]) -> int:
    return len(idx) * max(lengths[i] for i in idx)


def plan_replay(lengths: list[int], rc, costs: TokenCosts | None = None, base_bytes: float = 0.0,
                budget_bytes: float | None = None, one_pass: bool = False, packer=None) -> ReplayPlan:
    """Pack micro-batches and choose a tier for each by cumulative tokens on this device; check that the plan fits.

    rc: the run's ``replay`` config. Tiers in order: keep the graph while the cumulative tokens stay within
    ``keep_graph_tokens`` (and, when that is unset, while the estimate fits), then activation checkpointing within
    ``checkpoint_tokens`` (likewise), then two-pass. Without a budget or costs (the CPU default) unset caps mean
    "all": every micro-batch keeps its graph. Raises ReplayMemoryError naming the setting to change when the plan
    cannot fit.

    one_pass: every micro-batch is back-propagated inside replay right after its forward (nothing kept across
    micro-batches); its graph keeps everything when that fits in flight, else it is checkpointed. See plan_one_pass.

    packer: max_tokens -> (micro-batches, their token counts, bytes each keeps beside its tokens or None) instead of `pack`
    by padded turn lengths (replay.share_prefix: engine.shared_replay.pack_shared, whole groups counted by the tokens
    they forward, plus the shared states they keep until backward)."""
    if not lengths:
        return ReplayPlan([], [], [])
    known = budget_bytes is not None and costs is not None
    packer = packer or _turn_packer(lengths)
    if one_pass:
        return plan_one_pass(lengths, rc, costs if known else None, base_bytes, budget_bytes, packer)
    mb_tokens = rc.microbatch_tokens
    if mb_tokens is None:
        mb_tokens = rc.auto_microbatch_tokens
        if known:  # the micro-batch in flight takes at most transient_share of the free memory
            room = (budget_bytes - base_bytes - costs.fixed) * rc.transient_share
            mb_tokens = max(1, min(mb_tokens, int(room / max(costs.transient, 1.0))))
    mbs, tokens, extra = packer(mb_tokens)
    plan = ReplayPlan(mbs, tokens, ["keep"] * len(mbs), budget_bytes=budget_bytes, base_bytes=base_bytes, costs=costs,
                      extra_bytes=extra)
    inf = float("inf")
    if not known:
        keep_cap = inf if rc.keep_graph_tokens is None else rc.keep_graph_tokens
        ckpt_cap = inf if rc.checkpoint_tokens is None else rc.checkpoint_tokens
        cum = 0
        for j, n in enumerate(tokens):
            cum += n
            plan.tiers[j] = "keep" if cum <= keep_cap else ("checkpoint" if cum <= ckpt_cap else "two_pass")
        return plan
    plan = _assign(plan, tokens, lengths, rc, costs, base_bytes, budget_bytes, two_pass_in_flight=False)
    if "two_pass" in plan.tiers:  # then a re-forward's checkpointed graph is in flight too: plan again with it
        plan = _assign(plan, tokens, lengths, rc, costs, base_bytes, budget_bytes, two_pass_in_flight=True)
    return plan


_SHARED_HINT = (" (with replay.share_prefix a row's turns share one micro-batch; set it to false to replay "
                "them one by one)")


def _turn_packer(lengths: list[int]):
    def packer(max_tokens: int) -> tuple[list[list[int]], list[int], None]:
        mbs = pack(lengths, max_tokens)
        return mbs, [padded_tokens(lengths, idx) for idx in mbs], None

    return packer


def plan_one_pass(lengths: list[int], rc, costs: TokenCosts | None, base_bytes: float,
                  budget_bytes: float | None, packer=None) -> ReplayPlan:
    """Micro-batches that are each scored and back-propagated at once: the peak is resident + the largest micro-batch's
    graph in flight (its keep cost when that fits, else its checkpoint cost) + what its backward adds. The automatic
    micro-batch size is what fits checkpointed; a turn longer than that gets its own micro-batch and, when even that
    does not fit, the plan is refused before replay, naming the setting."""
    mb_tokens = rc.microbatch_tokens
    room = None if costs is None else budget_bytes - base_bytes - costs.fixed
    if mb_tokens is None:
        mb_tokens = rc.auto_microbatch_tokens
        if costs is not None:
            mb_tokens = max(1, min(mb_tokens, int(room / max(costs.checkpoint + costs.transient, 1.0))))
    mbs, tokens, extra = (packer or _turn_packer(lengths))(mb_tokens)
    plan = ReplayPlan(mbs, tokens, ["one_pass"] * len(mbs), budget_bytes=budget_bytes, base_bytes=base_bytes,
                      costs=costs, graphs=["keep"] * len(mbs), extra_bytes=extra)
    extra = extra or [0.0] * len(mbs)
    if costs is None:  # no budget (the CPU default): every graph in full
        return plan
    peak = 0.0
    for j, n in enumerate(tokens):
        e = extra[j] * (1.0 + STATE_GRAD_SHARE)  # the shared states and, in the backward, their gradients
        need = (costs.keep + costs.transient) * n + e
        if need > room:
            plan.graphs[j], need = "checkpoint", (costs.checkpoint + costs.transient) * n + e
        if need > room:
            longest = max(lengths[i] for i in mbs[j])
            what = (f"one turn of {longest} tokens needs {need / GiB:.1f} GiB checkpointed in flight: shorten "
                    "episodes (gym.token_budget) or raise replay.memory_budget_gb" if len(mbs[j]) == 1 else
                    f"micro-batches of {n} tokens need {need / GiB:.1f} GiB checkpointed in flight: lower "
                    "replay.microbatch_tokens" + _SHARED_HINT * bool(rc.share_prefix))
            raise ReplayMemoryError(
                f"replay preflight (one pass): {base_bytes / GiB:.1f} GiB resident + {costs.fixed / GiB:.1f} GiB "
                f"fixed + {need / GiB:.1f} GiB in flight exceeds the budget of {budget_bytes / GiB:.1f} GiB; {what}")
        peak = max(peak, need)
    plan.est_peak_bytes = base_bytes + costs.fixed + peak
    return plan


def _assign(plan: ReplayPlan, tokens: list[int], lengths: list[int], rc, costs: TokenCosts, base_bytes: float,
            budget_bytes: float, two_pass_in_flight: bool) -> ReplayPlan:
    """plan_replay's tiers against a budget: the peak is resident + kept graphs + the largest micro-batch in flight
    (plus, when two-pass micro-batches may be in flight, a re-forward's checkpointed graph)."""
    per_token = costs.transient + (costs.checkpoint if two_pass_in_flight else 0.0)
    extra = plan.extra_bytes or [0.0] * len(tokens)
    # the micro-batch in flight: in its backward, the gradients of its shared states (STATE_GRAD_SHARE of the states;
    # a two-pass re-forward also holds the states themselves, which it keeps until its backward)
    transient = max(per_token * n + e * (STATE_GRAD_SHARE + (1.0 if two_pass_in_flight else 0.0))
                    for n, e in zip(tokens, extra)) + costs.fixed
    if base_bytes + transient > budget_bytes:
        longest = max(lengths)
        what = (f"one turn of {longest} tokens needs {transient / GiB:.1f} GiB in flight: shorten episodes "
                "(gym.token_budget) or raise replay.memory_budget_gb" if max(tokens) == longest else
                f"micro-batches of {max(tokens)} tokens need {transient / GiB:.1f} GiB in flight: lower "
                "replay.microbatch_tokens" + _SHARED_HINT * bool(rc.share_prefix))
        raise ReplayMemoryError(
            f"replay preflight: {base_bytes / GiB:.1f} GiB resident + {transient / GiB:.1f} GiB in flight exceeds "
            f"the budget of {budget_bytes / GiB:.1f} GiB; {what}")
    kept, cum = 0.0, 0
    for j, n in enumerate(tokens):
        cum += n
        room = budget_bytes - base_bytes - transient - kept
        e = extra[j]  # shared states: kept with the graph until backward
        if (cum <= rc.keep_graph_tokens) if rc.keep_graph_tokens is not None else costs.keep * n + e <= room:
            plan.tiers[j], kept = "keep", kept + costs.keep * n + e
        elif (cum <= rc.checkpoint_tokens) if rc.checkpoint_tokens is not None else costs.checkpoint * n + e <= room:
            plan.tiers[j], kept = "checkpoint", kept + costs.checkpoint * n + e
        else:
            plan.tiers[j] = "two_pass"
    plan.est_peak_bytes = base_bytes + kept + transient
    if plan.est_peak_bytes > budget_bytes:
        tt = plan.summary()["tier_tokens"]
        setting = "replay.keep_graph_tokens" if tt["keep"] and rc.keep_graph_tokens is not None else \
            "replay.checkpoint_tokens"
        raise ReplayMemoryError(
            f"replay preflight: the plan keeps {kept / GiB:.1f} GiB of graph (tokens per tier {tt}) and peaks at an "
            f"estimated {plan.est_peak_bytes / GiB:.1f} GiB, over the budget of {budget_bytes / GiB:.1f} GiB: lower "
            f"{setting}, or leave it unset to let the preflight choose")
    return plan


def estimate_costs(model) -> TokenCosts:
    """Bytes per token from the architecture, for devices without an allocator to measure (the CPU): a coarse guide.

    keep: ~24 hidden-size and 3 intermediate-size activations per decoder layer in the compute dtype; checkpoint: one
    hidden state per layer; transient: one layer's keep cost plus FP32 input gradients."""
    text, _, emb = M._parts(model)
    cfg = text.config
    b = torch.finfo(emb.weight.dtype).bits // 8
    per_layer = (24 * cfg.hidden_size + 3 * cfg.intermediate_size) * b
    return TokenCosts(keep=float(per_layer * cfg.num_hidden_layers),
                      checkpoint=float(cfg.hidden_size * b * (cfg.num_hidden_layers + 2)),
                      transient=float(per_layer + 4 * cfg.hidden_size * 4), source="estimated")


# ----------------------------------------------------------------------------------------------------------------
# scoring


# the "matmuls" checkpoint mode keeps the outputs of these ops (wide matrix products and attention) through the
# backward; a product whose reduction is at most LOW_RANK wide (a LoRA term) is recomputed instead: cheap to redo, and
# its FP32 output would be as wide as the layer's
PRODUCT_OPS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::baddbmm": 1}  # op -> its left operand
KEPT_OPS = frozenset({
    *PRODUCT_OPS, "bitsandbytes::gemm_4bit",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"})
LOW_RANK = 64


def _keep_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy of checkpoint_keeps=matmuls (torch.utils.checkpoint)."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = op.name()
    if name in PRODUCT_OPS and args[PRODUCT_OPS[name]].shape[-1] <= LOW_RANK:
        return CheckpointPolicy.PREFER_RECOMPUTE  # a LoRA term's product
    return CheckpointPolicy.MUST_SAVE if name in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def checkpointed_layers(model, context=None, keeps: str = "inputs"):
    """Activation checkpointing per decoder layer (non-reentrant): a layer keeps only its inputs; backward
    recomputes its forward with the same kernels, so values are bit-identical to the plain forward.

    context: layer -> the context manager that layer ran under (the replay adapter's forwards on that layer's
    modules); the recompute in backward runs outside the caller's `with` block, so it enters it again itself.
    keeps: "inputs" (the above) or "matmuls": selective checkpointing that also keeps the outputs of KEPT_OPS, so
    the recompute skips the matrix products (their kept outputs are the same tensors: still bit-identical)."""
    from contextlib import nullcontext
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if keeps not in ("inputs", "matmuls"):
        raise ValueError(f"checkpoint keeps {keeps!r}: one of inputs, matmuls")
    extra = {} if keeps == "inputs" else {"context_fn": partial(create_selective_checkpoint_contexts, _keep_matmuls)}
    from engine import shared_replay as SR

    layers = list(M._parts(model)[0].layers)
    ctx = context or (lambda layer: nullcontext())
    for i, layer in enumerate(layers):
        orig = layer.forward

        def run(*args, _orig=orig, _layer=layer, **kwargs):
            with ctx(_layer):
                return _orig(*args, **kwargs)

        def fwd(*args, _run=run, _i=i, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if not getattr(cache, "_lgrpo_functional", False):
                return checkpoint(_run, *args, use_reentrant=False, **extra, **kwargs)
            # a cache with gradients (engine.shared_replay): the layer's state in and out are the checkpointed
            # function's explicit inputs and outputs, so the recompute in backward starts from the state this forward
            # saw (the cache object itself has moved on by then)
            cl = cache.layers[_i]
            state = SR.get_state(cl)

            def stateful(hidden, *st, _rest=args[1:], _kw=kwargs):
                SR.set_state(cl, st or None)
                out = _run(hidden, *_rest, **_kw)
                new = SR.get_state(cl)
                SR.set_state(cl, None)  # the checkpoint keeps this closure: it must not keep the (recomputed) state
                return (out, *new)

            res = checkpoint(stateful, args[0], *(state or ()), use_reentrant=False, **extra)
            SR.set_state(cl, tuple(res[1:]))
            return res[0]

        layer.forward = fwd
    try:
        yield
    finally:
        for layer in layers:
            if "forward" in layer.__dict__:
                del layer.forward


def replay_adapter(engine, rc=None):
    """The engine's lean-backward adapter forwards (engine.adapter_grad), built on first use; rc (the run's replay
    config) sets how they compute the rank-r product (replay.lora_product)."""
    ra = getattr(engine, "_replay_adapter", None)
    if ra is None or ra.model is not engine.model:
        from engine.adapter_grad import ReplayAdapter

        ra = ReplayAdapter(engine.model)
        engine._replay_adapter = ra
    if rc is not None:
        ra.split_forward = rc.lora_product == "split"
    return ra


def score_microbatch(engine, turns: Turns, idx: list[int], temperature: float, sigma: float, tier: str = "keep",
                     rc=None, graph: str = "keep"):
    """Per-turn answer log-probs [(L,)] and thought log-densities (n, K) for turns `idx`.

    tier keep: the autograd graph is kept (grad mode permitting); checkpoint: per-layer activation checkpointing;
    two_pass: the caller scores under no_grad now and re-forwards later; one_pass: `graph` says which of the two
    (the caller back-propagates at once). rc: the run's replay config (adapter forward, log-prob chunk); None scores
    through PEFT's own forward and a full log-softmax."""
    if tier not in TIERS:
        raise ValueError(f"unknown replay tier {tier!r}: one of {TIERS}")
    if graph not in GRAPHS:
        raise ValueError(f"unknown one-pass graph {graph!r}: one of {GRAPHS}")
    checkpointed = tier in ("checkpoint", "two_pass") or (tier == "one_pass" and graph == "checkpoint")
    args = ([turns.prefixes[i] for i in idx], [turns.thoughts[i] for i in idx], [turns.answers[i] for i in idx],
            temperature, sigma, engine.scale, engine.toks)
    from contextlib import nullcontext

    lean = rc is not None and rc.adapter_forward == "lean"
    with ExitStack() as stack:
        if lean:
            stack.enter_context(replay_adapter(engine, rc))
        if checkpointed and torch.is_grad_enabled():
            stack.enter_context(checkpointed_layers(engine.model, (lambda layer: replay_adapter(engine).scope(layer))
                                                    if lean else (lambda layer: nullcontext()),
                                                    "inputs" if rc is None else rc.checkpoint_keeps))
        if rc is not None and rc.share_prefix:
            from engine.shared_replay import score_turns_shared

            return score_turns_shared(engine.model, *args[:3], [turns.rows[i] for i in idx], *args[3:],
                                      logprob_chunk=rc.logprob_chunk)
        return SC.score_turns(engine.model, *args, logprob_chunk=None if rc is None else rc.logprob_chunk)


@contextmanager
def _fresh_grads(params):
    """Back-propagate into fresh .grad tensors (so a measurement counts them), then restore the old ones."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def measure_costs(engine, turns: Turns, rc, temperature: float, sigma: float, probe_tokens: int = 512
                  ) -> TokenCosts:
    """Bytes per token of each tier, measured with the CUDA allocator on probe turns of `probe_tokens` and twice that
    (4x those for the checkpoint tier; the first stored turn's prefix cut or repeated to length, its thoughts and
    answer): what stays allocated after the forward (slope over the two sizes), and the peak above that during
    forward and backward (slope, plus the size-independent part -- e.g. a dequantized NF4 weight -- as `fixed`).
    Uses rc's checkpoint_keeps. Leaves .grad as it was."""
    dev = engine.device
    if dev.type != "cuda":
        raise ValueError("measure_costs needs the CUDA allocator; on the CPU use estimate_costs")
    p0, z0, a0 = turns.prefixes[0], turns.thoughts[0], turns.answers[0]
    params = [p for p in engine.model.parameters() if p.requires_grad]

    def one(tier: str, tokens: int) -> tuple[float, float, int]:
        n_prefix = max(1, tokens - z0.shape[0] - len(a0) - 1)
        probe = Turns([(p0 * (n_prefix // max(1, len(p0)) + 1))[:n_prefix]], [z0], [a0], [0])
        torch.cuda.synchronize(dev)
        m0 = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.enable_grad():
            a, q = score_microbatch(engine, probe, [0], temperature, sigma, tier, rc)
            torch.cuda.synchronize(dev)
            kept = torch.cuda.memory_allocated(dev) - m0
            (a[0].sum() + q[0].sum()).backward()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - m0
        for p in params:
            p.grad = None
        return float(kept), float(peak - kept), probe.lengths()[0]

    budget, resident = device_budget(engine, rc)
    fits = {}
    # the checkpoint tier is probed 4x longer: its in-flight bytes per token (one layer's recompute and backward) are
    # small enough that at probe_tokens a size-independent allocation (a dequantized NF4 weight) hides their slope
    # (measured at the 27B width: 0.02 MB/token from 512/1024-token probes, ~0.55 in an 8k-token turn)
    sizes = {"keep": probe_tokens, "checkpoint": 4 * probe_tokens}
    with _fresh_grads(params):
        for tier in ("keep", "checkpoint"):
            k1, t1, n1 = probe_or_explain(one, tier, sizes[tier], budget, resident)
            k2, t2, n2 = probe_or_explain(one, tier, 2 * sizes[tier], budget, resident)
            dn = max(1, n2 - n1)
            ks, ts = max(0.0, (k2 - k1) / dn), max(0.0, (t2 - t1) / dn)
            fits[tier] = (ks, ts, max(0.0, t2 - ts * n2), max(0.0, k2 - ks * n2))
    keep, ckpt = fits["keep"], fits["checkpoint"]
    # a two-pass micro-batch in flight also holds its checkpointed re-forward graph: plan_replay adds ckpt[0] for it
    transient = max(keep[1], ckpt[1])
    fixed = max(keep[2], ckpt[2] + ckpt[3])
    return TokenCosts(keep=keep[0], checkpoint=ckpt[0], transient=transient, source="measured", fixed=fixed)


def probe_or_explain(one, tier: str, tokens: int, budget: float | None, resident: float):
    """one(tier, tokens) -- a measure_costs probe -- or, when it runs out of device memory, a ReplayMemoryError
    before replay saying what holds the memory and what to change (the probe is the preflight's first step: its OOM
    is the preflight's answer, not a crash halfway through the step). The probe's tensors are gone by then."""
    try:
        return one(tier, tokens)
    except torch.OutOfMemoryError as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        room = "" if budget is None else (f" of a {budget / GiB:.1f} GiB budget (replay.memory_budget_gb / "
                                          f"memory_fraction), leaving {max(0.0, budget - resident) / GiB:.1f} GiB")
        raise ReplayMemoryError(
            f"replay preflight: measuring replay's memory per token ran out of device memory on a {tokens}-token "
            f"probe of the {tier} tier, with {resident / GiB:.1f} GiB resident (the trainer's weights and adapter, "
            f"and anything else this process holds on the device: an hf sampler's weights, prefix caches){room}. "
            "Replay cannot fit beside what is resident: run on a GPU with more memory (the 27B presets are sized for "
            "one H200), or, when the costs are known, give replay.token_costs_mb {keep, checkpoint, transient} (MB per "
            "token, e.g. the token_costs of bench/replay_27b.py or of an earlier step's replay_plan) so the probe "
            f"is skipped. ({exc.args[0].splitlines()[0] if exc.args else exc})") from exc


def device_budget(engine, rc) -> tuple[float | None, float]:
    """(budget bytes or None, bytes resident now) of the engine's device, for the preflight."""
    dev = engine.device
    resident = float(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else 0.0
    if rc.memory_budget_gb is not None:
        return rc.memory_budget_gb * GiB, resident
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory * rc.memory_fraction, resident
    return None, resident


def plan_for(engine, turns: Turns, rc, temperature: float, sigma: float, one_pass: bool = False) -> ReplayPlan:
    """The replay plan of `turns` on this engine's device. Token costs: from the config, else measured once per
    engine (CUDA) or estimated from the architecture, when there is a budget to plan against."""
    budget, resident = device_budget(engine, rc)
    costs = None
    if rc.token_costs_mb is not None:
        c = rc.token_costs_mb
        costs = TokenCosts(c["keep"] * 2**20, c["checkpoint"] * 2**20, c["transient"] * 2**20, "config")
    elif budget is not None:
        costs = getattr(engine, "_replay_costs", None)
        if costs is None:
            costs = (measure_costs(engine, turns, rc, temperature, sigma) if engine.device.type == "cuda"
                     else estimate_costs(engine.model))
            engine._replay_costs = costs
    return plan_replay(turns.lengths(), rc, costs, resident, budget, one_pass, packer_for(turns, rc, engine.model))


def packer_for(turns: Turns, rc, model=None):
    """plan_replay's packer for rc: None (whole turns by padded length) or, with replay.share_prefix, whole groups
    by the tokens a prefix-shared scoring forwards (engine.shared_replay.pack_shared), with the bytes of the shared
    states each keeps when the `model` is given."""
    if not rc.share_prefix:
        return None
    from engine.shared_replay import pack_shared

    sizing = ()  # the model's config and activation bytes: pack_shared then counts the shared states too
    if model is not None:
        text, _, emb = M._parts(model)
        sizing = (text.config, torch.finfo(emb.weight.dtype).bits // 8)

    def packer(max_tokens: int):
        return pack_shared(turns.prefixes, turns.thoughts, turns.answers, turns.rows, max_tokens, *sizing)

    return packer


def to_sequences(rows: list[int], per_turn: list[torch.Tensor], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-turn 1-D tensors by rollout (turn order kept) -> padded (B, T) values and a (B, T) mask."""
    by_row: list[list[torch.Tensor]] = [[] for _ in range(n_rows)]
    for r, x in zip(rows, per_turn):
        by_row[r].append(x)
    seqs = [torch.cat(xs) if xs else torch.zeros(0) for xs in by_row]
    T = max(s.numel() for s in seqs)
    vals = torch.zeros(n_rows, T, dtype=seqs[0].dtype)
    mask = torch.zeros(n_rows, T)
    for i, s in enumerate(seqs):
        vals[i, : s.numel()] = s
        mask[i, : s.numel()] = 1.0
    return vals, mask


def from_sequences(rows: list[int], lengths: list[int], seq: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `to_sequences`: split (B, T) back into per-turn 1-D tensors."""
    offsets = [0] * seq.shape[0]
    out = []
    for r, n in zip(rows, lengths):
        out.append(seq[r, offsets[r]: offsets[r] + n])
        offsets[r] += n
    return out

