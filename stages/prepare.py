"""Run preparation: tokenizer, bootstrapped base (cached, keyed by its config), initial adapter.

The tokenizer and the bootstrap base are derived artifacts: their directory name is a hash of everything that
determines them, so a second run with the same settings reuses them (and a changed setting never does).
"""

from __future__ import annotations

import hashlib
import random
import shutil
import uuid
from pathlib import Path

import yaml

from artifacts import RunDir, atomic_write, dir_digest, sha256_file, write_adapter_dir, write_json
from configs.schema import GymConfig, RunConfig, config_hash
from engine.chat import episode_text, first_prompt, observation_block
from stages.context import env_factory, run_config, timer


def _oracle_episodes(cfg, n: int, seed: int) -> list[dict]:
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


def _seal_dir(src: Path, dst: Path) -> str:
    """Copy every file of `src` into `dst` as verified artifacts (atomic, with sidecars); returns dir digest."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for f in sorted(src.rglob("*")):
        if f.is_file():
            atomic_write(tmp / f.relative_to(src), lambda t, f=f: shutil.copyfile(f, t))
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dir_digest(dst)


def _without_eval_size(cfg: RunConfig) -> RunConfig:
    """The config as far as the tokenizer and the bootstrap depend on it: the held-out evaluation's size does not
    change either, so runs that differ only in `gym.eval_tasks` share them."""
    return cfg.with_overrides(**{"gym.eval_tasks": GymConfig.model_fields["eval_tasks"].default})


def prepare_tokenizer(run_dir: str) -> dict:
    """Train the BPE tokenizer on oracle episodes of the built-in gym (or use tokenizer.path)."""
    from engine.tokenizer import train_tokenizer

    cfg = run_config(run_dir)
    out = {"stage": "tokenizer"}
    with timer(out):
        if cfg.tokenizer.path:
            out["path"] = str(Path(cfg.tokenizer.path).resolve())
            out["cached"] = True
            return out
        key = config_hash(_without_eval_size(cfg), "tokenizer", "gym")
        target = RunDir(run_dir).tokenizer_dir(key)
        if target.exists():
            dir_digest(target)  # verifies
            out.update(path=str(target), cached=True)
            return out
        corpus = [episode_text(e["question"], e["answers"], e["observations"])
                  for e in _oracle_episodes(cfg, 2000, seed=cfg.gym.train_split_seed + 7)]
        scratch = target.with_name(target.name + ".build")
        train_tokenizer(corpus, cfg.tokenizer.vocab_size, scratch)
        _seal_dir(scratch, target)
        shutil.rmtree(scratch)
        out.update(path=str(target), cached=False)
    return out


def _turn_examples(episodes: list[dict], tok) -> list[tuple[list[int], list[int]]]:
    """(prefix ids, answer ids) per model turn of each episode, built by concatenation as in generation."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ex = []
    for e in episodes:
        prefix = tok(first_prompt(e["question"]))["input_ids"]
        for i, a in enumerate(e["answers"]):
            ans = tok(a)["input_ids"] + [eos]
            ex.append((prefix, ans))
            if i < len(e["observations"]):
                prefix = prefix + ans + tok(observation_block(e["observations"][i]))["input_ids"]
    return ex


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
        if cfg.model.source == "pretrained":  # imported once as a sealed artifact (every reader verifies it)
            src = Path(cfg.model.path)
            files = sorted(f for f in src.rglob("*") if f.is_file() and not f.name.endswith(".sha256"))
            if not files:
                raise FileNotFoundError(f"model.path {src} holds no files: give a local checkpoint directory")
            h = hashlib.sha256()
            for f in files:
                h.update(f.relative_to(src).as_posix().encode() + b"\0" + sha256_file(f).encode())
            target = RunDir(run_dir).bootstrap_dir("pretrained-" + h.hexdigest()[:16])
            cached = target.exists()
            if cached:
                dir_digest(target)
            else:
                _seal_dir(src, target)
            out.update(path=str(target), cached=cached, source=str(src.resolve()))
            return out
        tok = tokenizer(tok_dir)
        key = (config_hash(_without_eval_size(cfg), "model", "bootstrap", "latent", "gym", "tokenizer")[:12] + "-"
               + dir_digest(tok_dir)[:8])
        target = RunDir(run_dir).bootstrap_dir(key)
        if target.exists():
            dir_digest(target)
            out.update(path=str(target), cached=True)
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
        _seal_dir(scratch, target)
        shutil.rmtree(scratch)
        write_json(target.parent / f"{key}.report.json", {"losses": losses})
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
    _seal_dir(scratch, target)
    shutil.rmtree(scratch)


def _supervised(cfg, model, tok, toks) -> list[float]:
    import torch

    from engine import model as M

    bc = cfg.bootstrap
    episodes = _oracle_episodes(cfg, bc.episodes, seed=cfg.gym.train_split_seed)
    examples = _turn_examples(episodes, tok)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=bc.lr, weight_decay=0.0)
    n_batches = bc.epochs * ((len(examples) + bc.batch_size - 1) // bc.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.05, 1 - i / n_batches))
    losses = []
    K = cfg.latent.max_latent_steps
    ROUND = 8  # thoughts are sampled for ROUND batches at once (one wide latent loop), then trained on
    for _ in range(bc.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches = [order[b:b + bc.batch_size] for b in range(0, len(order), bc.batch_size)]
        for r in range(0, len(batches), ROUND):
            chunk = [i for b in batches[r:r + ROUND] for i in b]
            scale = M.embed_scale(model)
            sigma = cfg.latent.sigma * scale
            model.eval()
            z, _ = M.latent_loop(model, [examples[i][0] for i in chunk], K, sigma, scale, toks, gen)
            model.train()
            thought = dict(zip(chunk, z))
            for b in batches[r:r + ROUND]:
                losses.append(_sft_update(model, opt, sched, [examples[i] for i in b], [thought[i] for i in b],
                                          sigma, scale, toks))
    model.eval()
    return losses


def _sft_update(model, opt, sched, batch, thoughts, sigma, scale, toks) -> float:
    """One supervised step: -mean log-prob of the oracle answer tokens, thoughts as inputs."""
    import torch

    from engine import model as M

    lp, _ = M.score_turns(model, [p for p, _ in batch], thoughts, [a for _, a in batch], 1.0, sigma, scale, toks)
    loss = -torch.cat(lp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return round(loss.item(), 5)


def init_adapter(run_dir: str, base_dir: str) -> dict:
    """The step-0 adapter: PEFT's initialization (LoRA B = 0, so the policy starts as the base), seeded."""
    import torch

    from engine import model as M

    cfg = run_config(run_dir)
    out = {"stage": "init-adapter"}
    with timer(out):
        target = RunDir(run_dir).adapter_init()
        if target.exists():
            out.update(path=str(target), digest=dir_digest(target), cached=True)
            return out
        base = M.load_base(base_dir, cfg.model.dtype, cfg.device)
        torch.manual_seed(cfg.seed)
        peft_model = M.attach_adapter(base, cfg.adapter)
        digest = write_adapter_dir(target, M.adapter_config_dict(peft_model), M.adapter_state(peft_model))
        out.update(path=str(target), digest=digest, cached=False)
    return out


def record_prepared(run_dir: str, tok: dict, base: dict, init: dict) -> None:
    """prepared.json: where this run's tokenizer, base and initial adapter are (steps read it)."""
    write_json(RunDir(run_dir).prepared(), {"tokenizer": tok["path"], "base": base["path"],
                                                        "adapter_init": init["path"], "bootstrap": base})


def prepare_run(run_dir: str) -> dict:
    """Tokenizer, bootstrap base and initial adapter without Prefect (benchmarks, tests)."""
    tok = prepare_tokenizer(run_dir)
    base = bootstrap_base(run_dir, tok["path"])
    init = init_adapter(run_dir, base["path"])
    record_prepared(run_dir, tok, base, init)
    return {"tokenizer": tok, "base": base, "adapter_init": init}


def init_run_dir(cfg: RunConfig) -> RunDir:
    """Create (or resume) a run directory. Resuming needs the same config; anything else is refused."""
    rd = RunDir(Path(cfg.run_dir)).ensure()
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=True)
    if rd.config().exists():
        old = RunConfig.model_validate(yaml.safe_load(rd.config().read_text()))
        if old != cfg:
            diff = {k for k, v in cfg.model_dump().items() if old.model_dump().get(k) != v}
            raise ValueError(
                f"{rd.root} holds a run with another config (differs in: {', '.join(sorted(diff))}); "
                "pass a new --run-dir, or the same settings to resume it")
    else:
        atomic_write(rd.config(), lambda tmp: tmp.write_text(text))
    if not rd.run_info().exists():
        write_json(rd.run_info(), {"run_id": uuid.uuid4().hex})
    return rd
