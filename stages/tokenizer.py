"""prepare-tokenizer: the run's BPE tokenizer, trained on oracle episodes of the gym (cached, keyed by the
settings that determine it), or `tokenizer.path` as given."""

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
        if cfg.tokenizer.path:
            out["path"] = str(Path(cfg.tokenizer.path).resolve())
            out["cached"] = True
            return out
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
