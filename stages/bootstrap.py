"""bootstrap-base: the base model GRPO starts from (cached, keyed by everything that determines it).

A tiny hybrid built from the config and fine-tuned on the gym's oracle episodes (thoughts from its own latent loop
as inputs), a `model.source: random` recipe the engines build on their device, or a local pretrained checkpoint used
in place: the run holds a sealed reference to it (artifacts/checkpoint.py), never a copy. The oracle episodes also feed the tokenizer (stages/tokenizer.py).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from artifacts import RunDir, dir_digest, seal_dir, write_json
from artifacts import shared_cache
from artifacts.progress import Progress
from configs.schema import GymConfig, ModelConfig, RunConfig, config_hash
from engine.chat import ChatFormat, tool_specs
from stages import faults
from stages.context import env_factory, run_config, timer


def oracle_episodes(cfg, n: int, seed: int) -> list[dict]:
    """Expert episodes from the gym's oracle: question, answers, observations (train split only)."""
    make = env_factory(cfg)
    env = make()
    episodes = []
    for task in env.sample_tasks(n, seed=seed, split="train"):
        q = env.reset(task)
        answers = env.oracle_answers(task)
        obs = []
        for a in answers:
            res = env.step(a)
            if res.done:
                break
            obs.append(res.observation)
        close = getattr(env, "close", None)
        if callable(close):
            close()  # seal the episode's trace: the tool service frees it
        episodes.append({"question": q, "answers": answers, "observations": obs, "reward": res.reward})
    return episodes


# model settings that choose CUDA kernels only: on a CPU run every one of them runs the PyTorch path
CUDA_ONLY_MODEL_SETTINGS = ("adapter_kernels", "adapter_step_kernels", "norm_kernels", "attention_kernels",
                            "nf4_kernels")


def preparation_config(cfg: RunConfig) -> RunConfig:
    """The config as far as the tokenizer and the bootstrap depend on it: the held-out evaluation's size does not
    change either, so runs that differ only in `gym.eval_tasks` share them; on a CPU run neither do the CUDA kernel
    choices (`CUDA_ONLY_MODEL_SETTINGS`), so changing one of them (or its default) does not bootstrap the base again."""
    resets = {"gym.eval_tasks": GymConfig.model_fields["eval_tasks"].default}
    if cfg.device == "cpu":
        resets.update({f"model.{k}": ModelConfig.model_fields[k].default for k in CUDA_ONLY_MODEL_SETTINGS})
    return cfg.with_overrides(**resets)


def _turn_examples(episodes: list[dict], tok, tools: list[dict] | None = None) -> list[tuple[list[int], list[int]]]:
    """(prefix ids, answer ids) per model turn of each episode, built by concatenation as in generation."""
    fmt = ChatFormat.of(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ex = []
    for e in episodes:
        prefix = tok(fmt.first_prompt(e["question"], tools))["input_ids"]
        for i, a in enumerate(e["answers"]):
            ans = tok(a)["input_ids"] + [eos]
            ex.append((prefix, ans))
            if i < len(e["observations"]):
                prefix = prefix + ans + tok(fmt.observation_block(e["observations"][i]))["input_ids"]
    return ex


def bootstrap_key(cfg, tok_dir: str) -> str:
    """The directory name of a run's bootstrapped base: a hash of the settings the bootstrap depends on and of the
    tokenizer."""
    return (config_hash(preparation_config(cfg), "model", "bootstrap", "latent", "gym", "tokenizer")[:12] + "-"
            + dir_digest(tok_dir)[:8])


def bootstrap_base(run_dir: str, tok_dir: str) -> dict:
    """The base model GRPO starts from: a random-init tiny hybrid, fine-tuned on oracle trajectories.

    The supervised turns carry stochastic thoughts from the model's own latent loop (no gradient through them),
    so the base learns to answer after K thoughts exactly as it will in rollouts.
    """
    from engine import model as M
    from engine.runtime import set_threads, tokenizer

    cfg = run_config(run_dir)
    set_threads(cfg.threads)
    out = {"stage": "bootstrap"}
    with timer(out):
        if cfg.model.source == "pretrained":  # used in place: hashed once, referenced, re-verified on every load
            from artifacts import checkpoint

            recorded = sorted(d for d in (RunDir(run_dir).root / "bootstrap").glob("pretrained-*")
                              if (d / checkpoint.REF_NAME).is_file())
            if recorded:  # a resumed run: its checkpoint must be as it recorded it (refused otherwise)
                target = recorded[-1]
                ref = checkpoint.read_ref(target)  # verifies the reference itself
                now = checkpoint.check_unchanged(ref)
                out.update(path=str(target), cached=True, source=ref["path"], digest=ref["digest"],
                           files=len(ref["files"]), files_hashed=len(now["hashed"]))
                return out
            record = checkpoint.hash_checkpoint(cfg.model.path)
            target = RunDir(run_dir).bootstrap_dir("pretrained-" + record["digest"][:16])
            checkpoint.write_ref(target, record)
            out.update(path=str(target), cached=False, source=record["path"], digest=record["digest"],
                       files=len(record["files"]), files_hashed=len(record["hashed"]))
            return out
        tok = tokenizer(tok_dir)
        key = bootstrap_key(cfg, tok_dir)
        target = RunDir(run_dir).bootstrap_dir(key)
        if target.exists():
            dir_digest(target)
            out.update(path=str(target), cached=True)
            return out
        # shared by runs: the training also depends on the seed and (CPU reductions) on the thread count
        import torch

        shared_key = f"{key}-seed{cfg.seed}-threads{torch.get_num_threads()}"
        if shared_cache.fetch("bootstrap", shared_key, target):
            out.update(path=str(target), cached="shared")
            return out
        toks = M.Tokens.of(tok)
        if cfg.model.source == "random":  # a recipe, not weights: engines build it on their device from the seed
            write_random_base(target, cfg, tok, toks)
            out.update(path=str(target), cached=False, source="random")
            return out
        # the warm start trains in FP32 whatever the run computes in (bf16 training on a CPU is slow and coarse);
        # engines load the checkpoint in model.dtype, and the export casts it once for the sampler
        model = M.build_random_model(cfg.model.arch, len(tok), toks.pad, toks.eos, cfg.model.init_seed, "float32")
        losses = []
        if cfg.bootstrap.enabled:
            losses = _supervised(cfg, model, tok, toks)
        scratch = target.with_name(target.name + ".build")
        model.save_pretrained(scratch)
        tok.save_pretrained(scratch)
        seal_dir(scratch, target)
        shutil.rmtree(scratch)
        write_json(target.parent / f"{key}.report.json", {"losses": losses})
        shared_cache.store("bootstrap", shared_key, target)
        out.update(path=str(target), cached=False, first_loss=losses[0] if losses else None,
                   last_loss=losses[-1] if losses else None)
    return out


def write_random_base(target: Path, cfg, tok, toks) -> None:
    """A `model.source: random` base: random_base.json (arch, vocabulary, seed, init std) and the tokenizer, sealed
    like a checkpoint. The vocabulary is model.arch.vocab_size when set (the 27B shape keeps its 248,320 rows; the
    tokenizer uses the first ids), else the tokenizer's."""
    import json

    from engine.model import RANDOM_BASE

    vocab = int(cfg.model.arch.get("vocab_size", len(tok)))
    if vocab < len(tok):
        raise ValueError(f"model.arch.vocab_size={vocab} is smaller than the tokenizer ({len(tok)} tokens): raise it "
                         "or drop the key")
    arch = {k: v for k, v in cfg.model.arch.items() if k != "vocab_size"}
    scratch = target.with_name(target.name + ".build")
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / RANDOM_BASE).write_text(json.dumps({
        "arch": arch, "vocab_size": vocab, "pad_id": toks.pad, "eos_id": toks.eos, "seed": cfg.model.init_seed,
        "std": 0.02}, indent=1, sort_keys=True))
    tok.save_pretrained(scratch)
    seal_dir(scratch, target)
    shutil.rmtree(scratch)


def _supervised(cfg, model, tok, toks) -> list[float]:
    import torch

    from engine import model as M
    from engine import latent as LT

    bc = cfg.bootstrap
    episodes = oracle_episodes(cfg, bc.episodes, seed=cfg.gym.train_split_seed)
    tools = tool_specs(env_factory(cfg)()) if ChatFormat.of(tok).template else None  # built-in format: no tools
    examples = _turn_examples(episodes, tok, tools)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=bc.lr, weight_decay=0.0)
    n_batches = bc.epochs * ((len(examples) + bc.batch_size - 1) // bc.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.05, 1 - i / n_batches))
    losses = []
    K = cfg.latent.max_latent_steps
    ROUND = 8  # thoughts are sampled for ROUND batches at once (one wide latent loop), then trained on
    progress = Progress("bootstrap-base", n_batches, "updates")
    for _ in range(bc.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches = [order[b:b + bc.batch_size] for b in range(0, len(order), bc.batch_size)]
        for r in range(0, len(batches), ROUND):
            chunk = [i for b in batches[r:r + ROUND] for i in b]
            scale = M.embed_scale(model)
            sigma = cfg.latent.sigma * scale
            model.eval()
            z, _ = LT.latent_loop(model, [examples[i][0] for i in chunk], K, sigma, scale, toks, gen)
            model.train()
            thought = dict(zip(chunk, z))
            for b in batches[r:r + ROUND]:
                losses.append(_sft_update(model, opt, sched, [examples[i] for i in b], [thought[i] for i in b],
                                          sigma, scale, toks))
                progress.update()
            faults.maybe_kill("bootstrap", 0)
    model.eval()
    return losses


def _sft_update(model, opt, sched, batch, thoughts, sigma, scale, toks) -> float:
    """One supervised step: -mean log-prob of the oracle answer tokens, thoughts as inputs."""
    import torch

    from engine import scoring as SC

    lp, _ = SC.score_turns(model, [p for p, _ in batch], thoughts, [a for _, a in batch], 1.0, sigma, scale, toks)
    loss = -torch.cat(lp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return round(loss.item(), 5)
