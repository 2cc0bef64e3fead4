"""A step whose batch carries no learning signal (every group's rewards equal: every advantage is zero) leaves the
adapter and the AdamW state as they were. torch's AdamW would still move every weight on its momentum alone: on
the embedded default such a momentum-only step once dropped held-out success from 0.90 to 0.69 (README, learning)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import fresh_step, make_run

FLAT = "LGRPO_TEST_FLAT_REWARDS"


def spread_or_flat(prompts, completions, gym_reward, **kwargs) -> list[float]:
    """Rewards that differ within a group; with LGRPO_TEST_FLAT_REWARDS=1 every episode's total is 0.5 instead (the
    gym's own reward cancelled): no group has a signal."""
    if os.environ.get(FLAT) != "1":
        return [1e-3 * len(str(c)) for c in completions]
    return [0.5 - g for g in gym_reward]


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from artifacts import read_tensors

    return read_tensors(path)[0]  # verified against its sidecar


def test_adamw_moves_on_momentum_without_gradient():
    """Why the rule exists: one AdamW step on an all-zero gradient after a real one still changes the weights."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.tensor([1.0, -1.0, 0.5, 0.0])
    opt.step()
    before = p.detach().clone()
    p.grad = torch.zeros(4)
    opt.step()
    assert not torch.equal(p.detach(), before)


@pytest.mark.slow
def test_step_without_signal_keeps_adapter_and_optimizer(tmp_path, monkeypatch):
    from artifacts import RunDir, read_json
    from engine import runtime

    runtime.clear()
    monkeypatch.delenv(FLAT, raising=False)
    run_dir = make_run(tmp_path / "run", **{"gym.reward_funcs": ["tests.test_no_signal:spread_or_flat"]})
    rd = RunDir(run_dir)
    init = read_json(f"{run_dir}/prepared.json")["adapter_init"]
    s0 = fresh_step(run_dir, 0, init)
    assert s0["optimize"]["signal"] and s0["optimize"]["updated"] and s0["optimize"]["grad_norm"] > 0
    a0 = _tensors(f"{rd.adapter(0)}/adapter_model.safetensors")
    assert any(not torch.equal(a0[k], v) for k, v in _tensors(f"{init}/adapter_model.safetensors").items())

    monkeypatch.setenv(FLAT, "1")
    s1 = fresh_step(run_dir, 1, str(rd.adapter(0)))
    op = s1["optimize"]
    assert not op["signal"] and not op["updated"] and op["grad_norm"] == 0.0, op
    a1 = _tensors(f"{rd.adapter(1)}/adapter_model.safetensors")
    assert a1.keys() == a0.keys() and all(torch.equal(a1[k], a0[k]) for k in a0)
    o0, o1 = _tensors(str(rd.optimizer(0))), _tensors(str(rd.optimizer(1)))
    assert o1.keys() == o0.keys() and all(torch.equal(o1[k], o0[k]) for k in o0)
    assert read_json(rd.loss(1))["updated"] is False


@pytest.mark.slow
def test_first_step_without_signal_stores_adamws_initial_state(tmp_path, monkeypatch):
    """No AdamW step yet: the stored state is the one torch starts from (step 0, zero moments), and the next step
    starts from it."""
    from artifacts import RunDir, read_json
    from engine import runtime

    runtime.clear()
    monkeypatch.setenv(FLAT, "1")
    run_dir = make_run(tmp_path / "run", **{"gym.reward_funcs": ["tests.test_no_signal:spread_or_flat"]})
    rd = RunDir(run_dir)
    init = read_json(f"{run_dir}/prepared.json")["adapter_init"]
    s0 = fresh_step(run_dir, 0, init)
    assert not s0["optimize"]["updated"]
    o0 = _tensors(str(rd.optimizer(0)))
    assert o0 and all(float(v.abs().max()) == 0.0 for v in o0.values())
    a0, ai = _tensors(f"{rd.adapter(0)}/adapter_model.safetensors"), _tensors(f"{init}/adapter_model.safetensors")
    assert all(torch.equal(a0[k], ai[k]) for k in ai)
    monkeypatch.delenv(FLAT)
    runtime.clear()  # read the stored state back (no AdamW kept in memory)
    s1 = fresh_step(run_dir, 1, str(rd.adapter(0)))
    assert s1["optimize"]["updated"] and not s1["optimize"]["optimizer_kept"]
    assert all(float(v) == 1.0 for k, v in _tensors(str(rd.optimizer(1))).items() if k.endswith(".step"))
