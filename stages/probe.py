"""probe and verify-checkpoint: checks that sampling cannot fool.

probe (every ``gates.probe_every`` steps and after the last step): the trainer and the sampler score the same
``gates.probe_prompts`` fixed held-out turns teacher-forced with the current adapter. Reported: argmax agreement,
mean and max gap of the oracle answer tokens' log-probs (over tokens either engine gives at least
``parity_min_prob``), and — with the hf sampler, whose arithmetic is the trainer's — a layer-by-layer comparison
of every adapter layer's output, which must be bitwise equal. A gap above ``probe_gap_max`` or a differing layer
raises ``GateFailed("teacher-forced-probe")``: the run stops.

verify-checkpoint (end of run): reload the final adapter from disk through PEFT's own loader onto a freshly loaded
base and re-score the probe: log-probs must be identical to the trainer engine's.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from artifacts import RunDir, append_jsonl, write_json
from engine.gates import GateFailed
from stages.context import Laps, generator, run_config, seed_for, timer
from stages import faults

PROBE_SEED = 20261130  # the probe set never changes within a run (nor across runs of one config)


@lru_cache(maxsize=4)
def _probe_turns(cfg_json: str, tok_dir: str) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """(prefix ids, oracle answer ids) of the fixed probe turns: held-out tasks, at successive turn depths so the
    probe covers questions, tool results and final answers."""
    from configs.schema import RunConfig
    from engine.chat import ChatFormat, tool_specs
    from engine.runtime import tokenizer
    from gyms.registry import make_env_factory

    cfg = RunConfig.model_validate_json(cfg_json)
    tok = tokenizer(tok_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    fmt = ChatFormat.of(tok)
    # the oracle's whole episode must fit, whatever max_turns the run trains with
    env = make_env_factory(cfg.gym.name, {**cfg.gym.options, "max_turns": 64})()
    out = []
    for i, task in enumerate(env.sample_tasks(cfg.gates.probe_prompts, seed=PROBE_SEED, split="eval")):
        answers = env.oracle_answers(task)
        depth = i % len(answers)
        prefix = tok(fmt.first_prompt(env.reset(task), tool_specs(env)))["input_ids"]
        for a in answers[:depth]:
            res = env.step(a)
            prefix = prefix + tok(a)["input_ids"] + [eos] + tok(fmt.observation_block(res.observation or ""))["input_ids"]
        close = getattr(env, "close", None)
        if callable(close):
            close()
        out.append((tuple(prefix), tuple(tok(answers[depth])["input_ids"] + [eos])))
    return tuple(out)


def probe_inputs(cfg, trainer, tok_dir: str, thinker=None
                 ) -> tuple[list[list[int]], list[torch.Tensor], list[list[int]]]:
    """The probe turns with thoughts from a latent loop under the current adapter (fixed seed).

    thinker: None runs the trainer model's plain latent loop; an engine (the one generation samples thoughts with,
    runtime.latent_engine) runs its fastest path, Engine.thoughts -- on a GPU the CUDA-graphed loop: at the 27B shape
    the eager loop on the NF4 trainer was 13.9 of the probe's 17.9 s (h200-step-27b-g1-one-pass-auto-2026-12-03.json).
    Both draw from one generator seeded alike, and the graphed loop's thoughts are the eager loop's bit for bit."""
    from engine import latent as LT

    turns = _probe_turns(cfg.model_dump_json(), str(tok_dir))
    prefixes = [list(p) for p, _ in turns]
    answers = [list(a) for _, a in turns]
    sigma = cfg.latent.sigma * trainer.scale
    K = cfg.latent.max_latent_steps
    if thinker is None:
        z, _ = LT.latent_loop(trainer.model, prefixes, K, sigma, trainer.scale, trainer.toks,
                             generator(PROBE_SEED, "probe-thoughts"))
    else:  # no prefix cache: the probe's prefixes are not the step's, storing them would only evict the step's
        z, _ = thinker.thoughts(prefixes, None, K, sigma, seed_for(PROBE_SEED, "probe-thoughts"), None)
    return prefixes, [z[i] for i in range(len(prefixes))], answers


def compare_engines(trainer_lp: list[torch.Tensor], sampler_lp: list[torch.Tensor], answers: list[list[int]],
                    min_prob: float) -> dict:
    """Argmax agreement and gaps of the teacher-forced answer tokens between two engines' (L, V) log-softmaxes."""
    agree = total = 0
    gaps, worst = [], None
    for i, (t, s, a) in enumerate(zip(trainer_lp, sampler_lp, answers)):
        t, s = t.cpu(), s.cpu()
        agree += int((t.argmax(-1) == s.argmax(-1)).sum())
        total += len(a)
        idx = torch.tensor(a)[:, None]
        tl, sl = t.gather(1, idx)[:, 0], s.gather(1, idx)[:, 0]
        for j, (x, y) in enumerate(zip(tl.tolist(), sl.tolist())):
            if max(math.exp(x), math.exp(y)) >= min_prob:
                gaps.append(abs(x - y))
                if worst is None or abs(x - y) > worst["gap"]:
                    worst = {"prompt": i, "token": j, "trainer": x, "sampler": y, "gap": abs(x - y)}
    return {"tokens": total, "tokens_considered": len(gaps), "argmax_agreement": agree / max(total, 1),
            "mean_gap": sum(gaps) / len(gaps) if gaps else 0.0, "max_gap": max(gaps) if gaps else 0.0,
            "worst": worst}


@faults.kill_window("probe")
def probe(run_dir: str, step: int, adapter_in: str, export_in: str, base_in: str) -> dict:
    from engine import diagnose as D
    from engine import runtime

    cfg = run_config(run_dir)
    runtime.set_threads(cfg.threads)
    rd = RunDir(run_dir)
    out = {"stage": "probe", "step": step}
    seconds: dict = {}  # where the probe's time goes (at the 27B shape it took 19 s: the next GPU run says which part)
    with timer(out):
        lap = Laps(seconds)
        trainer = runtime.trainer(cfg, base_in, base_in)
        trainer.use_adapter(adapter_in)
        sampler = runtime.sampler(cfg, export_in, base_in)
        sampler.use_adapter(adapter_in)
        lap("engines", sync=True)
        prefixes, thoughts, answers = probe_inputs(cfg, trainer, base_in, runtime.latent_engine(cfg, trainer, sampler))
        lap("thoughts", sync=True)
        T = cfg.sampler.temperature
        t_lp = D.teacher_forced(trainer.model, prefixes, thoughts, answers, T, trainer.toks)
        lap("trainer", sync=True)
        s_lp = sampler.teacher_forced(prefixes, thoughts, answers, T, trainer)
        lap("sampler", sync=True)
        report = {"step": step, "adapter": trainer.adapter_digest, "sampler_adapter": sampler.adapter_digest,
                  "prompts": len(prefixes), **compare_engines(t_lp, s_lp, answers, cfg.gates.parity_min_prob),
                  "limits": {"gap_max": cfg.gates.probe_gap_max, "layers_bitwise": cfg.gates.probe_layers_bitwise},
                  "seconds": seconds}
        problems = []
        if report["max_gap"] > cfg.gates.probe_gap_max:
            w = report["worst"]
            problems.append(f"max gap {report['max_gap']:.3f} nat > {cfg.gates.probe_gap_max} (prompt {w['prompt']} "
                            f"token {w['token']}: trainer {w['trainer']:.3f}, sampler {w['sampler']:.3f})")
        # the same arithmetic on both sides only with the hf sampler on an unquantized base (an NF4 trainer's
        # sampler is the BF16 export: same values, other kernels), or when the sampler is the trainer's own model
        if cfg.gates.probe_layers_bitwise and cfg.sampler.kind == "hf" and (cfg.model.quantization == "none"
                                                                           or sampler is trainer):
            layers = [D.compare_adapter_layers(trainer.model, trainer.toks, sampler.model, sampler.toks, p, z, a)
                      for p, z, a in zip(prefixes, thoughts, answers)]
            first = next((x["first_differing"] for x in layers if x["first_differing"]), None)
            report["layers"] = {"compared": sum(x["layers"] for x in layers),
                                "differing": sum(x["differing"] for x in layers), "first_differing": first}
            if first is not None:
                problems.append(f"adapter layer {first['layer']} differs from the trainer's (max abs "
                                f"{first['max_abs']:.3g}, {first['relative']:.2g} of its output) although both "
                                "engines run the same arithmetic")
            lap("layers", sync=True)
        report["passed"] = not problems
        step_path = rd.probe(step)
        write_json(step_path, report)
        append_jsonl(rd.probe_history(), report, replace="step")
        out.update(path=str(step_path), **{k: report[k] for k in ("argmax_agreement", "mean_gap", "max_gap", "passed")})
        if problems:
            raise GateFailed("teacher-forced-probe", "; ".join(problems), report)
    return out


@faults.kill_window("checkpoint")
def verify_checkpoint(run_dir: str, adapter_in: str, base_in: str) -> dict:
    """Reload the final adapter through PEFT from disk onto a fresh base; the probe's log-probs must be identical."""
    from engine import diagnose as D
    from engine import runtime

    cfg = run_config(run_dir)
    out = {"stage": "verify-checkpoint"}
    with timer(out):
        trainer = runtime.trainer(cfg, base_in, base_in)
        trainer.use_adapter(adapter_in)
        prefixes, thoughts, answers = probe_inputs(cfg, trainer, base_in)
        T = cfg.sampler.temperature
        live = D.teacher_forced(trainer.model, prefixes, thoughts, answers, T, trainer.toks)
        # the run's generation is over: its caches make room for the second engine (at the 27B shape with 16 rows
        # the fresh engine did not fit beside them: bench/results/h200-step-27b-g4-norms-2026-12-02.json)
        memory = runtime.release_generation_memory()
        out["memory"] = memory
        try:
            # a fresh engine built as a new process would (device, NF4, attention), adapter through PEFT's own loader
            fresh = runtime.build(cfg, base_in, base_in, quantization=cfg.model.quantization, adapter_dir=adapter_in,
                                  via_peft=True).model
            reloaded = D.teacher_forced(fresh, prefixes, thoughts, answers, T, trainer.toks)
        except torch.OutOfMemoryError as e:  # say what holds the device, not only that it is full
            raise torch.OutOfMemoryError(f"{e}\nverify-checkpoint: a second engine does not fit beside this "
                                         f"process's engines after releasing their generation caches; what they hold "
                                         f"(GB): {memory['after']}. Set gates.verify_checkpoint: false to skip the "
                                         f"reload check on this device") from e
        del fresh
        diffs = [float((a - b).abs().max()) for a, b in zip(live, reloaded)]
        identical = all(torch.equal(a, b) for a, b in zip(live, reloaded))
        report = {"adapter": adapter_in, "prompts": len(prefixes), "identical": identical, "max_abs_diff": max(diffs)}
        write_json(RunDir(run_dir).verified_checkpoint(), report)
        out.update(report)
        if not identical:
            raise GateFailed("verified-checkpoint", f"the adapter reloaded from {adapter_in} scores the probe "
                             f"differently (max abs {max(diffs):.3g}): the stored checkpoint is not the trained model",
                             report)
    return out


def probe_due(cfg, step: int) -> bool:
    return (step + 1) % cfg.gates.probe_every == 0 or step == cfg.steps.total - 1

