"""Run preparation: the run directory (config, run id), the initial adapter (init-adapter), prepared.json, and
`prepare_run`, which runs the three preparation stages without Prefect: the tokenizer (stages/tokenizer.py), the
bootstrapped base (stages/bootstrap.py) and the initial adapter.

The tokenizer and the bootstrap base are derived artifacts: their directory name is a hash of everything that
determines them, so a second run with the same settings reuses them (and a changed setting never does).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import yaml

from artifacts import RunDir, atomic_write, dir_digest, write_adapter_dir, write_json
from configs.schema import RunConfig
from stages.context import run_config, timer


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
    from stages.bootstrap import bootstrap_base
    from stages.tokenizer import prepare_tokenizer

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
