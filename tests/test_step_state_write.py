"""stages.optimize.write_step_state: the adapter directory and the AdamW state of a step written on two threads are
the files the sequential writes make (same bytes, same digests, loadable), and a failed write raises with nothing
half-written left behind."""

from __future__ import annotations

import pytest
import torch

from artifacts import RunDir, read_adapter_dir, read_tensors
from artifacts.store import dir_digest, verify
from configs.schema import load_config
from engine import model as M
from stages import optimize as O

torch.set_num_threads(1)


class _Engine:
    def __init__(self, model):
        self.model = model


@pytest.fixture()
def stepped(tmp_path):
    """A tiny PEFT model whose AdamW took one step (so its state is not all zeros)."""
    cfg = load_config("tiny")
    base = M.build_random_model(cfg.model.arch, 300, 0, 3, seed=0)
    torch.manual_seed(0)
    model = M.attach_adapter(base, cfg.adapter)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=1e-3)
    for _, p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return _Engine(model), opt, params, RunDir(tmp_path / "run")


def test_side_by_side_write_equals_the_sequential_files(stepped, tmp_path):
    engine, opt, params, rd = stepped
    digest, opt_digest = O.write_step_state(rd, 3, engine, opt, params)
    # the same state written one file after the other, as before: byte-identical files
    seq = RunDir(tmp_path / "seq")
    d2 = O.write_adapter_dir(seq.adapter(3), M.adapter_config_dict(engine.model), M.adapter_state(engine.model))
    tensors, meta = O._optimizer_tensors(opt, params)
    o2 = O.write_tensors(seq.optimizer(3), tensors, meta)
    assert (digest, opt_digest) == (d2, o2)
    assert digest == dir_digest(rd.adapter(3)) and opt_digest == verify(rd.optimizer(3))
    assert rd.optimizer(3).read_bytes() == seq.optimizer(3).read_bytes()
    _, adapter = read_adapter_dir(rd.adapter(3))
    live = M.adapter_state(engine.model)
    assert adapter.keys() == live.keys() and all(torch.equal(adapter[k], live[k]) for k in live)
    stored, _ = read_tensors(rd.optimizer(3))
    assert all(torch.equal(stored[k], tensors[k]) for k in tensors)


def test_adapter_state_is_a_copy(stepped):
    engine = stepped[0]
    state = M.adapter_state(engine.model)
    params = dict(engine.model.named_parameters())
    for t in state.values():
        assert all(t.data_ptr() != p.data_ptr() for p in params.values())


def test_a_failed_write_raises_and_leaves_no_partial_files(stepped, monkeypatch):
    engine, opt, params, rd = stepped

    def broken(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(O, "write_adapter_dir", broken)
    with pytest.raises(OSError, match="disk full"):
        O.write_step_state(rd, 4, engine, opt, params)
    # the AdamW state finished (its own atomic write); no adapter, no temporary files anywhere
    assert not rd.adapter(4).exists()
    assert not [p for p in rd.root.rglob("*") if ".tmp-" in p.name]
