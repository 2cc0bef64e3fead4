"""optimize: GRPO loss on the driver -> per-token weights -> back-propagation of Σ w·logp -> AdamW.

The loss (TRL semantics, engine/loss.py) is evaluated on the *detached* per-token log-probs that replay stored;
w_i = d loss / d logp_i. The engine then back-propagates Σ w_i·logp_i micro-batch by micro-batch, using the live
autograd graph replay left behind, or — when there is none (a rerun from stored artifacts, a restarted
worker) — by re-scoring each micro-batch and checking the recomputed log-probs equal the stored ones bit for bit.
Both paths run the same micro-batches in the same order, so they give the same gradients.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from artifacts import (ArtifactError, RunDir, read_table, read_tensors, to_tensor_list, write_adapter_dir, write_json,
                       write_tensors)
from artifacts.store import sidecar_digest
from artifacts.tables import table_meta
from engine import gates
from engine import model as M
from engine.loss import grpo_loss, importance_sampling_ratio, negative_token_advantages, token_weights
from engine.replay import OnePass, from_sequences, to_sequences
from stages.context import Laps, run_config, timer
from stages.replay import live_key, load_turns
from stages import faults


def _adapter_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _param_groups(cfg, params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[list[torch.nn.Parameter], float]]:
    """AdamW's groups as (parameters, lr), each in `params` order: the adapter at optimizer.lr, then (with
    adapter.train_final_norm) the fully trained final norm at optimizer.final_norm_lr."""
    from engine.model import is_trained_module_param

    oc = cfg.optimizer
    full = [p for n, p in params if is_trained_module_param(n)]
    groups = [([p for n, p in params if not is_trained_module_param(n)], oc.lr)]
    if full:
        groups.append((full, oc.final_norm_lr if oc.final_norm_lr is not None else oc.lr))
    return groups


def _optimizer(cfg, params: list[tuple[str, torch.nn.Parameter]], state_in: str | None) -> torch.optim.AdamW:
    oc = cfg.optimizer
    opt = torch.optim.AdamW([{"params": ps, "lr": lr} for ps, lr in _param_groups(cfg, params)], lr=oc.lr,
                            betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
    if state_in:
        tensors, meta = read_tensors(state_in)
        names = json.loads(meta["names"])
        if names != [n for n, _ in params]:
            raise ValueError(f"{state_in}: optimizer state was saved for different adapter parameters")
        dev = params[0][1].device if params else torch.device("cpu")
        # the state's index i is params[i]; load_state_dict numbers the groups' parameters in group order
        order = {id(p): i for i, (_, p) in enumerate(params)}
        state = {j: {"step": tensors[f"{i}.step"], "exp_avg": tensors[f"{i}.exp_avg"].to(dev),
                     "exp_avg_sq": tensors[f"{i}.exp_avg_sq"].to(dev)}
                 for j, i in enumerate(order[id(p)] for g in opt.param_groups for p in g["params"])}
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)
    return opt


def _kept_optimizer(engine, cfg, params, state_in: str | None) -> torch.optim.AdamW | None:
    """The AdamW this engine's last optimize kept, when `state_in` is the state it wrote (same path, and the sidecar
    still records the digest of that write), over the same parameter objects with the configured hyperparameters:
    its in-memory state is bit for bit what the file holds, so it is not read and verified back. Taken, not peeked:
    an optimize that fails after its update leaves nothing to reuse, and the retry reads the file."""
    kept, engine.kept_optimizer = engine.kept_optimizer, None
    if kept is None or not state_in:
        return None
    path, digest, opt = kept
    oc = cfg.optimizer
    try:
        recorded = sidecar_digest(state_in)
    except ArtifactError:
        return None  # the reader below names what is wrong with the file
    want = _param_groups(cfg, params)
    same = (str(Path(state_in).resolve()) == path and recorded == digest and len(opt.param_groups) == len(want)
            and all(len(g["params"]) == len(ps) and all(a is b for a, b in zip(g["params"], ps))
                    and (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"])
                    == (lr, tuple(oc.betas), oc.eps, oc.weight_decay)
                    for g, (ps, lr) in zip(opt.param_groups, want)))
    return opt if same else None


def _optimizer_tensors(opt, params) -> tuple[dict, dict]:
    """The AdamW state as write_tensors stores it. The live tensors themselves: write_tensors copies them to the
    host once and serializes them before returning (a clone here was a second ~900 MB copy per step at 27B)."""
    tensors = {}
    for i, (_, p) in enumerate(params):
        st = opt.state[p]
        if not st:  # AdamW has not stepped yet (every step so far had no signal): its initial state, as torch makes it
            st = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                  "exp_avg_sq": torch.zeros_like(p)}
        tensors[f"{i}.step"] = st["step"].detach().reshape(())
        tensors[f"{i}.exp_avg"] = st["exp_avg"].detach()
        tensors[f"{i}.exp_avg_sq"] = st["exp_avg_sq"].detach()
    return tensors, {"names": json.dumps([n for n, _ in params])}


def write_step_state(rd: RunDir, step: int, engine, opt, params, adapter_state: dict | None = None) -> tuple[str, str]:
    """The step's adapter directory and AdamW state, written side by side; returns (adapter digest, optimizer digest).

    The two files are independent and each write spends its time in the host copy, safetensors' serialisation,
    sha256 and fsync, which release the GIL: the adapter goes on a second thread while this one writes the AdamW
    state (at the 27B shape ~450 MB + ~900 MB per step; bench/checkpoint_write.py times both layouts). An error in
    either write is raised here once both have ended; atomic writes leave no partial file."""
    from concurrent.futures import ThreadPoolExecutor

    config = M.adapter_config_dict(engine.model)
    with ThreadPoolExecutor(1, thread_name_prefix="lgrpo-write-adapter") as pool:
        adapter = pool.submit(lambda: write_adapter_dir(
            rd.adapter(step), config, adapter_state if adapter_state is not None else M.adapter_state(engine.model)))
        tensors, meta = _optimizer_tensors(opt, params)
        opt_digest = write_tensors(rd.optimizer(step), tensors, meta)
        return adapter.result(), opt_digest


def _thoughts_then_answer(table, thought_col: str, answer_col: str) -> list[torch.Tensor]:
    """Per turn: [thought terms (K), answer tokens (L)], the layout of one turn inside a GRPO sequence."""
    thoughts = to_tensor_list(table, thought_col, torch.float32)
    answers = to_tensor_list(table, answer_col, torch.float32)
    return [torch.cat([q, a]) for q, a in zip(thoughts, answers)]


@dataclass
class LossInputs:
    """Everything the driver's loss needs, laid out as GRPO sequences (one row per rollout)."""

    turns: object
    rows: list[int]
    K: int
    sigma: float
    lengths: list[int]  # per turn: K thought terms + answer tokens
    lp_turn: list[torch.Tensor]  # stored replay values per turn (thoughts then answer)
    old_lp: torch.Tensor
    samp_lp: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    is_ratio: torch.Tensor | None
    n_rows: int
    adv_tokens: torch.Tensor | None = None  # (B, T) per-token advantages (grpo.negative_token_max_prob), else None
    thought_gap: float = 0.0  # max |recorded - replayed| thought log-density (nat): generation vs replay numerics

    def loss(self, cfg, lp: torch.Tensor, metrics: dict | None = None) -> torch.Tensor:
        g = cfg.grpo
        adv = self.adv if self.adv_tokens is None else self.adv_tokens
        loss, m = grpo_loss(lp, self.old_lp, adv, self.mask, loss_type=g.loss_type, epsilon=g.epsilon,
                            epsilon_high=g.epsilon_high, delta=g.delta,
                            importance_sampling_level=g.importance_sampling_level, is_ratio=self.is_ratio,
                            max_completion_length=g.max_completion_length, max_log_ratio=g.max_log_ratio)
        if metrics is not None:
            metrics.update(m)
            metrics["loss"] = loss.item()
        return loss


def loss_inputs(cfg, rollouts_in: str, replay_in: str, old_replay_in: str) -> LossInputs:
    """Read a stored trajectory (rollouts + replay) into the loss's sequence layout."""
    turns, roll = load_turns(rollouts_in)
    rep = read_table(replay_in)
    old = rep if old_replay_in == replay_in else read_table(old_replay_in)  # fresh step: its own replay
    lp_turn = _thoughts_then_answer(rep, "trainer_logq", "trainer_logps")
    old_turn = lp_turn if old is rep else _thoughts_then_answer(old, "trainer_logq", "trainer_logps")
    keep = [torch.tensor(k, dtype=torch.float32) for k in old.column("loss_mask").to_pylist()]
    return loss_inputs_of(cfg, turns, roll, lp_turn, old_turn, keep)


def loss_inputs_of(cfg, turns, roll, lp_turn: list[torch.Tensor], old_turn: list[torch.Tensor],
                   keep: list[torch.Tensor]) -> LossInputs:
    """The loss's sequence layout from per-turn values: the replay's (thoughts then answer), the old policy's (the
    same on a fresh step) and the answer tokens' loss mask (the old replay's parity-gate mask)."""
    g = cfg.grpo
    meta = table_meta(roll)
    n_rows = int(meta["rows"])
    rows = turns.rows
    K = int(meta["K"])
    recorded = to_tensor_list(roll, "thought_logq", torch.float32)
    thought_gap = max((float((r - o[:K]).abs().max()) for r, o in zip(recorded, old_turn) if K), default=0.0)
    # the thoughts' sampling density: the trainer's own (old) replay value, or the one the latent loop recorded
    samp_q = [o[:K] for o in old_turn] if g.thought_sampling_logq == "replay" else recorded
    samp_turn = [torch.cat([q, a]) for q, a in zip(samp_q, to_tensor_list(roll, "sampler_logps", torch.float32))]
    mask_turn = [torch.cat([torch.ones(K), k]) for k in keep]
    _, mask = to_sequences(rows, lp_turn, n_rows)  # (B, T)
    old_lp, _ = to_sequences(rows, old_turn, n_rows)
    samp_lp, _ = to_sequences(rows, samp_turn, n_rows)
    mask = mask * to_sequences(rows, mask_turn, n_rows)[0]
    adv_by_row = {r: a for r, a in zip(rows, roll.column("advantage").to_pylist())}
    adv = torch.tensor([adv_by_row.get(r, 0.0) for r in range(n_rows)], dtype=torch.float32)  # (B,)
    is_ratio = None
    if g.vllm_importance_sampling_correction:
        is_ratio = importance_sampling_ratio(old_lp, samp_lp, mask, g.vllm_importance_sampling_mode,
                                             g.vllm_importance_sampling_clip_max, g.vllm_importance_sampling_clip_min)
    adv_tokens = None
    if g.negative_token_max_prob is not None:
        answer_turn = [torch.cat([torch.zeros(K), torch.ones(x.numel() - K)]) for x in lp_turn]
        adv_tokens = negative_token_advantages(adv, samp_lp, to_sequences(rows, answer_turn, n_rows)[0] * mask,
                                               g.negative_token_max_prob)
    return LossInputs(turns=turns, rows=rows, K=K, sigma=float(meta["sigma"]),
                      lengths=[x.numel() for x in lp_turn], lp_turn=lp_turn, old_lp=old_lp, samp_lp=samp_lp,
                      mask=mask, adv=adv, is_ratio=is_ratio, n_rows=n_rows, thought_gap=thought_gap,
                      adv_tokens=adv_tokens)


def driver_weights(cfg, li: LossInputs, metrics: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """w = d loss / d logp on the detached stored log-probs, split per turn into thought and answer weights."""
    lp, _ = to_sequences(li.rows, li.lp_turn, li.n_rows)
    w = token_weights(lp, lambda x: li.loss(cfg, x, metrics))  # (B, T)
    w_turn = from_sequences(li.rows, li.lengths, w)
    return [x[:li.K] * cfg.grpo.thought_loss_weight for x in w_turn], [x[li.K:] for x in w_turn]


class PredictedWeights:
    """The loss weights of a one-pass micro-batch's turns, computed in replay before the later micro-batches exist:
    the driver's own loss (loss_inputs_of, driver_weights) on the turns scored so far, with every turn not yet scored
    standing at its sampling values (thoughts at their recorded or replayed density, answers at the sampler's
    log-probs: a ratio of exp(0) there) and unmasked. For token-level losses a turn's weights depend on the other
    turns only through the loss normalizer's token count, so they are the driver's weights unless a later turn gets
    parity-masked tokens; optimize compares them bit for bit (OnePass entries) and re-forwards if one differs. Call it
    once per micro-batch, in replay order (a fresh step's parity masks are taken from the turns of each call). Not
    so a sequence-level importance correction on a fresh step, whose row ratio sums the trainer-sampler gaps of turns
    not yet scored: exact only where the sampler's log-probs equal the trainer's bit for bit (at the 27B shape the
    NF4 trainer and its BF16-export sampler do not: every fresh step there re-forwarded)."""

    def __init__(self, cfg, turns, roll, fresh: bool, old_replay_in: str | None):
        self.cfg, self.turns, self.roll, self.fresh = cfg, turns, roll, fresh
        self.sampler_lp = to_tensor_list(roll, "sampler_logps", torch.float32)
        self.parity_keep: dict[int, torch.Tensor] = {}  # fresh step: a scored turn's parity-gate mask, once per turn
        if fresh:
            recorded = to_tensor_list(roll, "thought_logq", torch.float32)
            self.guess = [torch.cat([q, a]) for q, a in zip(recorded, self.sampler_lp)]
            self.old_turn, self.keep = None, None
        else:
            old = read_table(old_replay_in)
            self.old_turn = _thoughts_then_answer(old, "trainer_logq", "trainer_logps")
            self.keep = [torch.tensor(k, dtype=torch.float32) for k in old.column("loss_mask").to_pylist()]
            self.guess = self.old_turn

    def __call__(self, ans_lp: dict, logq: dict, idx: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = len(self.turns.rows)
        lp_turn = [torch.cat([logq[i].to(torch.float32), ans_lp[i].to(torch.float32)]) if i in ans_lp else self.guess[i]
                   for i in range(n)]
        if self.fresh:
            g = self.cfg.gates
            for i in idx:  # the parity gate's per-token mask, as replay's _finish will compute it
                _, k = gates.rollout_parity([ans_lp[i].tolist()], [self.sampler_lp[i].tolist()],
                                            mean_max=g.parity_mean_max, token_max=g.parity_token_max,
                                            min_prob=g.parity_min_prob)
                self.parity_keep[i] = torch.tensor(k[0], dtype=torch.float32)
            keep = [self.parity_keep.get(i, torch.ones(self.sampler_lp[i].numel())) for i in range(n)]
            li = loss_inputs_of(self.cfg, self.turns, self.roll, lp_turn, lp_turn, keep)
        else:
            li = loss_inputs_of(self.cfg, self.turns, self.roll, lp_turn, self.old_turn, self.keep)
        wt, wa = driver_weights(self.cfg, li, {})
        return [wt[i] for i in idx], [wa[i] for i in idx]


def backward_microbatch(idx: list[int], a, q, w_thought, w_answer) -> None:
    """Back-propagate Σ w·logp of one micro-batch's turns (the one expression every tier and one-pass replay use)."""
    dev = a[0].device if a else torch.device("cpu")
    obj = sum((w_answer[i].to(dev) * a[n]).sum() + (w_thought[i].to(dev) * q[n]).sum() for n, i in enumerate(idx))
    obj.backward()


def one_pass_verified(live, params, w_thought, w_answer) -> bool | None:
    """None when `live` holds no one-pass micro-batches; else whether the gradients their replay accumulated can stand:
    every weight it used equals the driver's bit for bit, and the .grad tensors are the ones it left, untouched since
    (their version counters)."""
    entries = [e for e in (live or []) if isinstance(e, OnePass)]
    if not entries:
        return None
    grads = getattr(live, "grads", None)
    if grads is None or len(grads) != len(params) or any(
            p.grad is not g or p.grad._version != v for (_, p), (g, v) in zip(params, grads)):
        return False
    return all(torch.equal(e.w_thought[n], w_thought[i]) and torch.equal(e.w_answer[n], w_answer[i])
               for e in entries for n, i in enumerate(e.idx))


def stored_plan(replay_in: str) -> tuple[list[list[int]], list[str]]:
    """The micro-batches and tiers replay ran (replay.arrow metadata): optimize follows them exactly."""
    meta = table_meta(replay_in)
    if "plan" not in meta:
        raise ValueError(f"{replay_in} has no replay plan in its metadata: it was written by an older version; "
                         "re-run the step from replay (lgrpo rerun --stage replay)")
    plan = json.loads(meta["plan"])
    return plan["microbatches"], plan["tiers"]


def stored_graphs(replay_in: str) -> list[str] | None:
    """A one-pass replay's graph per micro-batch (keep / checkpoint), for a re-forward in optimize; None otherwise."""
    return json.loads(table_meta(replay_in)["plan"]).get("graphs")


def accumulate_gradients(cfg, engine, li: LossInputs, w_thought, w_answer, live=None, step: int = -1,
                         plan: tuple[list[list[int]], list[str]] | None = None, graphs: list[str] | None = None) -> None:
    """Back-propagate Σ w·logp micro-batch by micro-batch into .grad, following replay's plan.

    A micro-batch with a live graph (keep / checkpoint tiers) back-propagates it; a one-pass micro-batch whose replay
    already did (a OnePass entry: the caller checked one_pass_verified) is skipped; one without (two-pass tier, or no
    live graph at all: a rerun, a restarted worker) is re-forwarded with gradients -- two-pass ones with activation
    checkpointing, one-pass ones with the graph replay used (`graphs`) -- checked bit for bit against the stored
    replay, and back-propagated at once."""
    mbs, tiers = plan
    for j, (idx, tier) in enumerate(zip(mbs, tiers)):
        entry = live[j] if live is not None else None
        if isinstance(entry, OnePass):
            live[j] = None
            continue
        if entry is not None:
            _, a, q = entry
        else:
            graph = graphs[j] if graphs is not None else ("checkpoint" if tier == "one_pass" else "keep")
            with torch.enable_grad():
                a, q = engine.score(li.turns, idx, cfg.sampler.temperature, li.sigma, tier, cfg.replay, graph)
            _check_bitwise(step, idx, a, q, li.lp_turn)
        backward_microbatch(idx, a, q, w_thought, w_answer)
        del a, q
        if live is not None:
            live[j] = None  # the graph is spent: free it now, not at the end of the step


@faults.kill_window("optimize")
def optimize(run_dir: str, step: int, rollouts_in: str, replay_in: str, old_replay_in: str, adapter_in: str,
             optimizer_in: str | None, base_in: str) -> dict:
    from engine import runtime

    cfg = run_config(run_dir)
    runtime.set_threads(cfg.threads)
    rd = RunDir(run_dir)
    out = {"stage": "optimize"}
    with timer(out):
        lap = Laps(out)
        li = loss_inputs(cfg, rollouts_in, replay_in, old_replay_in)
        if cfg.model.attention_fp32:  # generation and replay then compute the same thought means: gated
            gates.check_thought_gap(li.thought_gap, cfg.gates.thought_logq_gap_max, step)
        metrics: dict = {}
        w_thought, w_answer = driver_weights(cfg, li, metrics)
        gates.check_finite_weights(  # before the backward it would waste
            step, w_thought, w_answer,
            lambda: [n - o for n, o in zip(li.lp_turn, from_sequences(li.rows, li.lengths, li.old_lp))],
            cfg.grpo.max_log_ratio)
        adv, mask, n_rows = li.adv, li.mask, li.n_rows

        engine = runtime.trainer(cfg, base_in, base_in)
        engine.use_adapter(adapter_in)
        params = _adapter_params(engine.model)
        kept = _kept_optimizer(engine, cfg, params, optimizer_in)
        opt = kept or _optimizer(cfg, params, optimizer_in)
        out["optimizer_kept"] = kept is not None  # the AdamW of the last step in memory, its file not read back
        live = engine.live.pop(live_key(rollouts_in, engine.adapter_digest), None)
        out["live_graph"] = live is not None
        one_pass = one_pass_verified(live, params, w_thought, w_answer)
        if one_pass is not None:  # True: replay's one-pass gradients stand; False: re-forward those micro-batches
            out["one_pass"] = one_pass
        if not one_pass:
            opt.zero_grad(set_to_none=False)
            for _, p in params:
                p.grad = torch.zeros_like(p)
            if one_pass is False:
                live[:] = [None if isinstance(e, OnePass) else e for e in live]
        lap("prepare_s")  # loss and weights on the driver, the engine with the adapter, the optimizer state
        accumulate_gradients(cfg, engine, li, w_thought, w_answer, live, step, stored_plan(replay_in),
                             stored_graphs(replay_in))
        lap("backward_s", sync=True)
        gnorm, bad = _grad_norm(params)
        signal = bool((adv != 0).any()) and bool(mask.any())
        _check_gradients(cfg, step, gnorm, bad, signal)
        if cfg.optimizer.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.optimizer.max_grad_norm)
        if signal:  # no signal: every loss weight is zero and AdamW would move the adapter on momentum alone
            engine.adapter_digest = None  # weights change below: nothing may trust the old digest
            opt.step()
        lap("update_s", sync=True)  # gradient gates, clipping, AdamW
        adapter_dir = rd.adapter(step)
        digest, opt_digest = write_step_state(rd, step, engine, opt, params)
        engine.adapter_digest = digest
        engine.kept_optimizer = (str(Path(rd.optimizer(step)).resolve()), opt_digest, opt)
        metrics.update(grad_norm=gnorm, signal=signal, updated=signal, tokens=int(mask.sum()), rollouts=n_rows,
                       thought_logq_gap_max=li.thought_gap)
        write_json(rd.loss(step), metrics)
        lap("write_s")  # adapter and optimizer state to the run directory (digests included)
        out.update(adapter=str(adapter_dir), adapter_digest=digest, optimizer=str(rd.optimizer(step)),
                   loss=metrics["loss"], grad_norm=gnorm, signal=signal, updated=signal,
                   thought_logq_gap_max=li.thought_gap)
    return out


def _grad_norm(params) -> tuple[float, list[str]]:
    """The adapter gradient's L2 norm and the names of the tensors holding a non-finite value."""
    gnorm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for _, p in params])))
    return gnorm, [n for n, p in params if not bool(torch.isfinite(p.grad).all())]


def _check_gradients(cfg, step: int, gnorm: float, bad: list[str], signal: bool) -> None:
    """The finite-gradients and nonzero-gradients gates on the (all-reduced) adapter gradient."""
    if not torch.isfinite(torch.tensor(gnorm)):
        raise gates.GateFailed(
            "finite-gradients", f"gradient norm is {gnorm} at step {step} although every loss weight was finite: "
            f"the backward through the model produced it, in {len(bad)} adapter tensors (first: {bad[:3]}); compare "
            "with the FP32 reference on this step's stored rollouts (stages/gradcheck.py)", {"step": step, "tensors": bad[:20]})
    if cfg.gates.require_nonzero_grad and signal and gnorm == 0.0:
        raise gates.GateFailed("nonzero-gradients", f"step {step} had non-zero advantages but an all-zero gradient")


def _check_bitwise(step: int, idx: list[int], a: list[torch.Tensor], q: torch.Tensor, stored: list[torch.Tensor]) -> None:
    """Re-scored log-probs must equal what replay stored, bit for bit (same weights, same micro-batch)."""
    for n, i in enumerate(idx):
        fresh = torch.cat([q[n].detach(), a[n].detach()]).cpu()
        if not torch.equal(fresh, stored[i]):
            diff = float((fresh - stored[i]).abs().max())
            raise gates.GateFailed(
                "replay-determinism",
                f"step {step}: re-scored turn {i} differs from the stored replay by {diff:.3e} "
                "(the weights, micro-batch layout or kernels changed between replay and optimize)")


# -- on the worker pool (engine/pool.py): loss on the driver, backward where each graph lives ------------------------

_PENDING: dict = {}  # (run_dir, step) -> (engine, params, optimizer) between backward_shard and step_shard


def backward_shard(run_dir: str, step: int, rollouts_in: str, replay_in: str, adapter_in: str, optimizer_in: str | None,
                   base_in: str, microbatches: list[list[int]], tiers: list[str], w_thought: dict, w_answer: dict) -> dict:
    """A worker's part of optimize: back-propagate Σ w·logp over its micro-batches (the graphs its replay kept, or
    re-scored and checked bit for bit), then all-reduce the adapter gradients in FP32 over the workers. Returns the
    gradient norm and the tensors that are not finite (identical on every worker: the gradients are)."""
    import types

    import torch.distributed as dist

    from engine import runtime

    cfg = run_config(run_dir)
    runtime.set_threads(cfg.threads)
    turns, roll = load_turns(rollouts_in)
    rep = read_table(replay_in)
    li = types.SimpleNamespace(turns=turns, sigma=float(table_meta(roll)["sigma"]),
                               lp_turn=_thoughts_then_answer(rep, "trainer_logq", "trainer_logps"))
    engine = runtime.trainer(cfg, base_in, base_in)
    engine.use_adapter(adapter_in)
    params = _adapter_params(engine.model)
    kept = _kept_optimizer(engine, cfg, params, optimizer_in)
    opt = kept or _optimizer(cfg, params, optimizer_in)
    for _, p in params:
        p.grad = torch.zeros_like(p)
    live = engine.live.pop(live_key(rollouts_in, engine.adapter_digest), None)
    if live is not None and len(live) != len(microbatches):
        live = None  # not this plan's graphs: re-score
    wt = {int(k): v for k, v in w_thought.items()}
    wa = {int(k): v for k, v in w_answer.items()}
    accumulate_gradients(cfg, engine, li, wt, wa, live, step, (microbatches, tiers))
    for _, p in params:  # FP32 sums over the workers, in parameter order
        dist.all_reduce(p.grad)
    gnorm, bad = _grad_norm(params)
    _PENDING[(run_dir, step)] = (engine, params, opt)
    return {"grad_norm": gnorm, "bad": bad[:20], "live_graph": live is not None, "optimizer_kept": kept is not None}


def step_shard(run_dir: str, step: int, write: bool, update: bool = True) -> dict:
    """AdamW on this worker's replica (the same update on every worker; none when `update` is False: a batch
    without signal); the writer stores the adapter and the optimizer state. Returns a digest of the updated adapter
    tensors: the driver checks the replicas agree bit for bit.

    When every replica's digest is the same, each worker labels its adapter with the digest of the written adapter
    and keeps its AdamW with the digest of the written state (gathered from the writer), as `optimize` does in one
    process: the next step's use_adapter and backward_shard then neither read nor verify back what the writer just
    stored (at the 27B shape ~450 MB of adapter and ~900 MB of AdamW state per worker and step)."""
    import hashlib

    import torch.distributed as dist

    cfg = run_config(run_dir)
    engine, params, opt = _PENDING.pop((run_dir, step))
    if cfg.optimizer.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.optimizer.max_grad_norm)
    if update:  # False when the batch carries no signal (optimize's rule)
        engine.adapter_digest = None  # the weights change: the next use_adapter reloads from the written adapter
        opt.step()
    state = M.adapter_state(engine.model)
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + b"\0" + state[k].numpy().tobytes())
    out = {"replica_digest": h.hexdigest()}
    rd = RunDir(run_dir)
    written = None
    if write:
        written = write_step_state(rd, step, engine, opt, params, state)
        out["adapter_digest"] = written[0]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (out["replica_digest"], written))
    writes = [w for _, w in everyone if w is not None]
    if len({d for d, _ in everyone}) == 1 and len(writes) == 1:  # else the driver fails replica-agreement
        engine.adapter_digest = writes[0][0]
        engine.kept_optimizer = (str(Path(rd.optimizer(step)).resolve()), writes[0][1], opt)
    return out


def optimize_on_workers(run_dir: str, step: int, rollouts_in: str, replay_in: str, old_replay_in: str,
                        adapter_in: str, optimizer_in: str | None, base_in: str, pool) -> dict:
    """optimize with the pool: the loss and its per-token weights once, on the driver; each worker back-propagates
    the turns it replayed; gradients all-reduced in FP32; every replica applies the same AdamW update and the
    driver checks they agree bit for bit before the step counts. The gates as in `optimize`."""
    cfg = run_config(run_dir)
    rd = RunDir(run_dir)
    out = {"stage": "optimize"}
    with timer(out):
        li = loss_inputs(cfg, rollouts_in, replay_in, old_replay_in)
        if cfg.model.attention_fp32:
            gates.check_thought_gap(li.thought_gap, cfg.gates.thought_logq_gap_max, step)
        metrics: dict = {}
        w_thought, w_answer = driver_weights(cfg, li, metrics)
        gates.check_finite_weights(
            step, w_thought, w_answer,
            lambda: [n - o for n, o in zip(li.lp_turn, from_sequences(li.rows, li.lengths, li.old_lp))],
            cfg.grpo.max_log_ratio)
        plan = json.loads(table_meta(replay_in)["plan"])
        if "workers" not in plan:
            raise ValueError(f"{replay_in} was replayed without the worker pool: run optimize the same way "
                             f"(workers: 0), or replay again with the pool (lgrpo rerun --stage replay)")
        owners = plan["workers"]

        def part(w):
            mbs = [mb for mb, o in zip(plan["microbatches"], owners) if o == w]
            tiers = [t for t, o in zip(plan["tiers"], owners) if o == w]
            mine = sorted({i for mb in mbs for i in mb})
            return {"run_dir": run_dir, "step": step, "rollouts_in": rollouts_in, "replay_in": replay_in,
                    "adapter_in": adapter_in, "optimizer_in": optimizer_in, "base_in": base_in, "microbatches": mbs,
                    "tiers": tiers, "w_thought": {i: w_thought[i] for i in mine},
                    "w_answer": {i: w_answer[i] for i in mine}}

        with timer(out, "backward_s"):
            res = pool.call_all("stages.optimize.backward_shard", part)
        gnorm = res[0]["grad_norm"]
        out["live_graph"] = all(r["live_graph"] for r in res)
        out["optimizer_kept"] = [r["optimizer_kept"] for r in res]  # per worker: the AdamW its last step kept
        signal = bool((li.adv != 0).any()) and bool(li.mask.any())
        if any(r["grad_norm"] != gnorm for r in res):
            raise gates.GateFailed("replica-agreement", f"step {step}: the workers' all-reduced gradient norms differ: "
                                   f"{[r['grad_norm'] for r in res]}", {"step": step})
        _check_gradients(cfg, step, gnorm, res[0]["bad"], signal)
        steps = pool.call_all("stages.optimize.step_shard", lambda w: {"run_dir": run_dir, "step": step,
                                                                      "write": w == 0, "update": signal})
        digests = [s["replica_digest"] for s in steps]
        if len(set(digests)) != 1:
            raise gates.GateFailed("replica-agreement", f"step {step}: after the same AdamW update the adapter replicas "
                                   f"differ ({digests}): a worker computed another update", {"step": step})
        metrics.update(grad_norm=gnorm, signal=signal, updated=signal, tokens=int(li.mask.sum()), rollouts=li.n_rows,
                       thought_logq_gap_max=li.thought_gap, workers=len(res))
        write_json(rd.loss(step), metrics)
        out.update(adapter=str(rd.adapter(step)), adapter_digest=steps[0]["adapter_digest"],
                   optimizer=str(rd.optimizer(step)), loss=metrics["loss"], grad_norm=gnorm, signal=signal,
                   updated=signal, thought_logq_gap_max=li.thought_gap, workers=len(res))
    return out
