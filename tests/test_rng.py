"""engine.rng: a row's draws do not depend on its batch or device.

CPU (CI): RowRandom.multinomial is torch.multinomial row by row -- the same tokens and the same generator state
after every step, at the tiny and the 27B vocabulary, at the sampling temperatures used -- and a row's tokens are
the same whether it is drawn alone or beside others.
GPU (`gpu` marker): probabilities on the GPU give the tokens the CPU gives for the same probabilities.
"""

from __future__ import annotations

import pytest
import torch

from engine.rng import RowRandom, draw_multinomial


def _probs(B: int, V: int, temperature: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 4
    logits[:, : V // 3] -= 30  # a long tail of near-zero probabilities, like a trained model's
    return torch.log_softmax(logits / temperature, -1).exp()


@pytest.mark.parametrize("V", [5, 512, 248_320])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_row_draws_are_torch_multinomial_row_by_row(V, temperature):
    seeds = [11, 12, 13, 14]
    ours, ref = RowRandom(seeds), [torch.Generator().manual_seed(s) for s in seeds]
    for step in range(6 if V < 10_000 else 3):
        p = _probs(4, V, temperature, seed=step)
        got = draw_multinomial(ours, p)
        want = torch.stack([torch.multinomial(p[i], 1, generator=ref[i])[0] for i in range(4)])
        assert torch.equal(got, want), f"step {step}"
    for g, r in zip(ours.gens, ref):  # the same generator consumption: later draws stay in step
        assert torch.equal(g.get_state(), r.get_state())


def test_a_rows_tokens_do_not_depend_on_its_neighbours():
    p = _probs(3, 1000, 1.3, seed=5)
    together = RowRandom([7, 8, 9]).multinomial(p)
    alone = torch.stack([RowRandom([s]).multinomial(p[i:i + 1])[0] for i, s in enumerate([7, 8, 9])])
    assert torch.equal(together, alone)


def test_bad_probabilities_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="2 rows asked for, 3 generators"):
        RowRandom([1, 2, 3]).multinomial(torch.full((2, 4), 0.25))
    for bad in (float("nan"), float("inf"), -0.5):
        p = torch.full((2, 4), 0.25)
        p[1, 2] = bad
        with pytest.raises(ValueError, match="inf, nan or element < 0"):
            RowRandom([1, 2]).multinomial(p)
    with pytest.raises(ValueError, match="sum of probabilities <= 0"):
        RowRandom([1, 2]).multinomial(torch.tensor([[0.5, 0.5], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\(B, V\) float32/float64"):
        RowRandom([1]).multinomial(torch.full((1, 4), 0.25, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_probabilities_give_the_cpu_tokens():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    seeds = [3, 4, 5, 6]
    on_gpu, on_cpu = RowRandom(seeds), RowRandom(seeds)
    for step in range(20):
        p = _probs(4, 248_320, 1.3, seed=100 + step)
        got = on_gpu.multinomial(p.cuda())
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), on_cpu.multinomial(p)), f"step {step}"


def test_row_random_records_where_a_draw_spends_its_host_time():
    """RowRandom.multinomial adds the seconds spent drawing q and waiting for the probabilities (engine.runtime
    reports them per turn as answers_draw_s / answers_wait_s); the tokens are those of torch.multinomial."""
    import torch

    from engine.rng import RowRandom

    probs = torch.softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)), -1)
    g = RowRandom([4, 5, 6])
    assert g.times == {"draw_s": 0.0, "wait_s": 0.0}
    got = [g.multinomial(probs) for _ in range(3)]
    assert g.times["draw_s"] > 0 and g.times["wait_s"] >= 0
    ref = [torch.Generator().manual_seed(s) for s in (4, 5, 6)]
    want = [torch.stack([torch.multinomial(probs[i], 1, generator=ref[i])[0] for i in range(3)]) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
