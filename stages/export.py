"""export: the sampler's copy of the base, written once per base (keyed by the base's content hash).

The copy is in the sampler's compute dtype (BF16 for GPU configs; the tiny CPU default computes in FP32) and is
produced by casting the trainer's base weights once, so both engines start from identical values. An NF4 base
is dequantized here once (GPU issue), never per decode step. A checkpoint used in place (artifacts/checkpoint.py)
under the hf sampler with an unquantized base is not written at all: the export is the run's reference again.
With sampler.weights: trainer the hf sampler runs on the trainer's own model and the export is a note saying so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from artifacts import RunDir, checkpoint, dir_digest, seal_dir, shared_cache
from stages.context import run_config, timer
from stages.tokenizer import TOKENIZER_FILES


def export_base(run_dir: str, base_dir: str) -> dict:
    from engine import model as M

    cfg = run_config(run_dir)
    out = {"stage": "export"}
    with timer(out):
        base_hash = dir_digest(base_dir)[:16]
        if cfg.sampler.weights == "trainer":
            # the hf sampler runs on the trainer's own model (one copy of the base on the device): nothing to write
            # but the note that says so, sealed like every export (engine.runtime.sampler reads it)
            return _trainer_weights(run_dir, base_dir, base_hash, out)
        tag = "nf4-bf16" if cfg.model.quantization == "nf4" else cfg.model.dtype
        target = RunDir(run_dir).export_dir(f"{base_hash}-{tag}")
        if target.exists():
            dir_digest(target)
            out.update(path=str(target), base_hash=base_hash, cached=True)
            return out
        ref = checkpoint.read_ref(base_dir)
        if ref is not None and cfg.model.quantization == "none" and cfg.sampler.kind == "hf":
            # a checkpoint used in place: the hf sampler loads it where it is, cast to model.dtype at load exactly as
            # the trainer's base is (same function, same values), so the export is the run's reference again -- no
            # copy. vLLM (its own loader) and an NF4 trainer (the sampler's BF16 weights are its dequantized ones) get
            # a written export below.
            checkpoint.check_unchanged(ref)
            checkpoint.write_ref(target, ref)
            out.update(path=str(target), base_hash=base_hash, cached=False, in_place=True)
            return out
        manifest = M.random_base_manifest(base_dir)
        shareable = manifest is None and cfg.model.quantization == "none"  # a checkpoint cast: depends on the base only
        if shareable and shared_cache.fetch("export", target.name, target):
            out.update(path=str(target), base_hash=base_hash, cached="shared")
            return out
        scratch = target.with_name(target.name + ".build")
        if scratch.exists():  # a crash mid-export left it
            shutil.rmtree(scratch)
        if manifest is not None:
            # a random base has no checkpoint: the export is its recipe too; for an NF4 trainer the sampler's BF16
            # weights are the trainer's dequantized ones, copied in memory and checked bit for bit when the sampler
            # is built (engine.runtime._dequantized_copy) instead of 54 GB written to disk here
            import json

            scratch.mkdir(parents=True)
            if cfg.model.quantization == "nf4":
                manifest["dequantized_from"] = str(Path(base_dir).resolve())
            (scratch / M.RANDOM_BASE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            out["in_memory"] = cfg.model.quantization == "nf4"
        elif cfg.model.quantization == "nf4":
            # the trainer's own NF4 base (the engine the run trains): dequantize once, write, check bit for bit
            from engine import nf4
            from engine import runtime

            trainer = runtime.trainer(cfg, base_dir, base_dir)
            info = nf4.write_bf16_export(trainer.model, scratch)
            check = nf4.verify_export(trainer.model, scratch)
            if not check["equal"]:
                raise RuntimeError(f"the BF16 export differs from the trainer's dequantized NF4 weights: mismatched "
                                   f"{check['mismatched']}, missing {check['missing']}, extra {check['extra']}")
            out.update(export_tensors=info["tensors"], export_quantized_checked=check["quantized"])
        else:
            model = M.load_base(base_dir, cfg.model.dtype)
            model.save_pretrained(scratch)
        source = checkpoint.resolve(base_dir)  # a checkpoint used in place, checked unchanged; else base_dir
        if source != Path(base_dir):
            # a published checkpoint's multi-token-prediction head, as stored, for the vLLM sampler (the trainer
            # leaves it out: it trains the text model)
            mtp = M.mtp_tensors(source)
            if mtp:
                from safetensors.torch import save_file

                save_file(mtp, str(scratch / "mtp.safetensors"), metadata={"format": "pt"})
                out["mtp_tensors"] = len(mtp)
        for name in TOKENIZER_FILES:  # tokenizer files and the chat template travel with the checkpoint
            if (source / name).is_file():
                shutil.copyfile(source / name, scratch / name)
        seal_dir(scratch, target)
        shutil.rmtree(scratch)
        if shareable:
            shared_cache.store("export", target.name, target)
        out.update(path=str(target), base_hash=base_hash, cached=False)
    return out


def _trainer_weights(run_dir: str, base_dir: str, base_hash: str, out: dict) -> dict:
    """sampler.weights: trainer -- the export is a sealed note naming the trainer's base (SAMPLER_ON_TRAINER)."""
    import json

    from engine.runtime import SAMPLER_ON_TRAINER

    target = RunDir(run_dir).export_dir(f"{base_hash}-trainer")
    if target.exists():
        dir_digest(target)
    else:
        scratch = target.with_name(target.name + ".build")
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(parents=True)
        (scratch / SAMPLER_ON_TRAINER).write_text(json.dumps({"base": str(Path(base_dir).resolve())}, indent=1))
        seal_dir(scratch, target)
        shutil.rmtree(scratch)
    out.update(path=str(target), base_hash=base_hash, cached=False, on_trainer=True)
    return out
