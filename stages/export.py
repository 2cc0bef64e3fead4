"""export: the sampler's copy of the base, written once per base (keyed by the base's content hash).

The copy is in the sampler's compute dtype (BF16 for GPU configs; the tiny CPU default computes in FP32) and is
produced by casting the trainer's base weights once, so both engines start from identical values. An NF4 base
is dequantized here once (GPU issue), never per decode step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from artifacts import RunDir, dir_digest
from stages.context import run_config, timer
from stages.prepare import _seal_dir


def export_base(run_dir: str, base_dir: str) -> dict:
    from engine import model as M

    cfg = run_config(run_dir)
    out = {"stage": "export"}
    with timer(out):
        base_hash = dir_digest(base_dir)[:16]
        target = RunDir(run_dir).export_dir(f"{base_hash}-{cfg.model.dtype}")
        if target.exists():
            dir_digest(target)
            out.update(path=str(target), base_hash=base_hash, cached=True)
            return out
        model = M.load_base(base_dir, cfg.model.dtype)
        scratch = target.with_name(target.name + ".build")
        model.save_pretrained(scratch)
        for f in Path(base_dir).iterdir():  # tokenizer files travel with the checkpoint
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                if not f.name.endswith(".sha256"):
                    shutil.copyfile(f, scratch / f.name)
        _seal_dir(scratch, target)
        shutil.rmtree(scratch)
        out.update(path=str(target), base_hash=base_hash, cached=False)
    return out
