"""prepare-tokenizer: the run's BPE tokenizer, trained on oracle episodes of the gym (cached, keyed by the
settings that determine it), or a given one -- `tokenizer.path`, else a pretrained checkpoint's own (`model.path`):
its tokenizer files and chat template are sealed into the run (kilobytes to megabytes; the weights are not copied)."""

from __future__ import annotations

import shutil
from pathlib import Path

from artifacts import shared_cache
from artifacts import RunDir, dir_digest, seal_dir
from configs.schema import config_hash
from engine.chat import episode_text
from stages.bootstrap import oracle_episodes, preparation_config
from stages.context import run_config, timer


def prepare_tokenizer(run_dir: str) -> dict:
    """Train the BPE tokenizer on oracle episodes of the built-in gym (or use tokenizer.path)."""
    from engine.tokenizer import train_tokenizer

    cfg = run_config(run_dir)
    out = {"stage": "tokenizer"}
    with timer(out):
        given = cfg.tokenizer.path or (cfg.model.path if cfg.model.source == "pretrained" else None)
        if given:  # a checkpoint's own tokenizer (and chat template), or tokenizer.path: its files, sealed in the run
            return {**out, **_seal_given(run_dir, Path(given))}
        key = config_hash(preparation_config(cfg), "tokenizer", "gym")
        target = RunDir(run_dir).tokenizer_dir(key)
        if target.exists():
            dir_digest(target)  # verifies
            out.update(path=str(target), cached=True)
            return out
        if shared_cache.fetch("tokenizer", key, target):
            out.update(path=str(target), cached="shared")
            return out
        corpus = [episode_text(e["question"], e["answers"], e["observations"])
                  for e in oracle_episodes(cfg, 2000, seed=cfg.gym.train_split_seed + 7)]
        scratch = target.with_name(target.name + ".build")
        train_tokenizer(corpus, cfg.tokenizer.vocab_size, scratch)
        seal_dir(scratch, target)
        shutil.rmtree(scratch)
        shared_cache.store("tokenizer", key, target)
        out.update(path=str(target), cached=False)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def _seal_given(run_dir: str, src: Path) -> dict:
    """The tokenizer files of `src` as a sealed run artifact keyed by their content."""
    import hashlib

    from artifacts import sha256_file

    src = src.resolve()
    files = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json: point tokenizer.path at a Hugging Face tokenizer "
                                f"directory (tokenizer.json, tokenizer_config.json, the chat template)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    target = RunDir(run_dir).tokenizer_dir("given-" + h.hexdigest()[:16])
    if target.exists():
        dir_digest(target)
        return {"path": str(target), "cached": True, "source": str(src)}
    scratch = target.with_name(target.name + ".build")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, scratch / f.name)
    seal_dir(scratch, target)
    shutil.rmtree(scratch)
    return {"path": str(target), "cached": False, "source": str(src)}
