"""Randomness of a rollout that does not depend on where its row runs.

A step's rows can be generated in one batch or spread over workers in any grouping; a row's thought noise and its
answer tokens must come out the same either way (and two workers must never draw the same stream: the second
seed's ranks once sampled identical rollouts). So every row draws from its own generator, seeded from
(run seed, step, turn, row, purpose) by the caller (stages/generate.py), and a batch draw is the rows' draws side
by side:

    RowRandom(seeds).randn(B, d)       row i: torch.randn(d) from generator i    (one block per thought, in order)
    RowRandom(seeds).multinomial(p)    row i: torch.multinomial(p[i], 1) from generator i (computed on p's device)

`draw_normal` / `draw_multinomial` take either a RowRandom or a plain torch.Generator (one stream for the whole
batch, row order: the bootstrap's warm start and older callers), so every latent and decode path (eager,
prefix-cached, CUDA-graphed) shares one definition of how a batch draws.
"""

from __future__ import annotations

import os
import time

import torch


class RowRandom:
    """One CPU generator per row (CPU: the same numbers whatever device the model runs on)."""

    def __init__(self, seeds: list[int]):
        self.seeds = [int(s) for s in seeds]
        self.gens = [torch.Generator().manual_seed(s) for s in self.seeds]
        self.device = torch.device("cpu")
        # where a decoded token's host time goes (multinomial): drawing q, and blocked until the step's probabilities
        # exist (on a GPU: the device still computing). Read by engine.runtime.Engine.answers into the turn's record.
        self.times = {"draw_s": 0.0, "wait_s": 0.0}

    def __len__(self) -> int:
        return len(self.gens)

    def randn(self, B: int, d: int) -> torch.Tensor:
        if B != len(self.gens):
            raise ValueError(f"RowRandom: {B} rows asked for, {len(self.gens)} generators")
        if B == 0:
            return torch.zeros(0, d)
        return torch.stack([torch.randn(d, generator=g) for g in self.gens])

    def multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        """(B,) one sample per row of the (B, V) probabilities, computed on their device: row i is exactly
        ``torch.multinomial(probs[i].cpu(), 1, generator=gens[i])``.

        One draw of torch.multinomial is argmax(p / q) with q ~ Exp(1) drawn by ``empty_like(p).exponential_(1,
        gen)`` (ATen's single-sample path: the Gumbel-max trick in exponential form). Here q comes from the row's
        CPU generator exactly so -- same generator consumption, same numbers -- and only q travels to the
        probabilities' device, where p / q (IEEE division, correctly rounded on both devices) and argmax (first
        maximum on both) choose the token. So a GPU decode no longer copies (B, V) probabilities to the host and
        waits for them: the CPU draws q while the GPU still computes the step (at the 27B vocabulary, 248,320
        exponentials per row). tests/test_rng.py checks it against torch.multinomial on the CPU; the GPU test
        against it across devices."""
        if probs.shape[0] != len(self.gens):
            raise ValueError(f"RowRandom: {probs.shape[0]} rows asked for, {len(self.gens)} generators")
        if probs.dim() != 2 or probs.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"RowRandom.multinomial: (B, V) float32/float64 probabilities expected, got "
                             f"{tuple(probs.shape)} {probs.dtype}")
        V, dtype = probs.shape[1], probs.dtype

        def q_of(g: torch.Generator) -> torch.Tensor:
            return torch.empty(V, dtype=dtype).exponential_(1, generator=g)

        t0 = time.perf_counter()
        if probs.device.type != "cpu" and len(self.gens) > 1:
            # ~9 ms per row at V = 248,320 on the H200's host (bench/sampling_draw.py): the rows draw side by side
            # (each generator on one thread; torch releases the GIL), while the GPU still computes the step
            q = torch.stack(list(_draw_pool(len(self.gens)).map(q_of, self.gens)))
        else:
            q = torch.stack([q_of(g) for g in self.gens])
        t1 = time.perf_counter()
        # torch.multinomial's own checks, in its words; one host sync per draw (the GPU decode's hot path)
        finite = (torch.isfinite(probs) & (probs >= 0)).all()
        valid = bool(finite & (probs.sum(-1) > 0).all())
        self.times["draw_s"] += t1 - t0
        self.times["wait_s"] += time.perf_counter() - t1
        if not valid:
            if not bool(finite):
                raise ValueError("RowRandom.multinomial: probability tensor contains either inf, nan or element < 0 "
                                 "(the model's log-probs are not finite: a diverged adapter or a broken forward)")
            raise ValueError("RowRandom.multinomial: invalid multinomial distribution (sum of probabilities <= 0)")
        return (probs / q.to(probs.device)).argmax(-1)


_POOL = None


def _forget_pool() -> None:  # a forked child has none of the parent's threads: it makes its own pool
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _draw_pool(n: int):
    """Threads for the rows' q draws (engine.rng.RowRandom.multinomial on a GPU), grown to the batch size."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers < n:
        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="lgrpo-row-draw")
    return _POOL


def draw_normal(gen, B: int, d: int) -> torch.Tensor:
    """(B, d) standard normal noise from a RowRandom or a torch.Generator (on the generator's device)."""
    if isinstance(gen, RowRandom):
        return gen.randn(B, d)
    return torch.randn(B, d, generator=gen, device=gen.device)


def draw_multinomial(gen, probs: torch.Tensor) -> torch.Tensor:
    """(B,) token ids sampled from (B, V) probabilities: a RowRandom's on the probabilities' device, a
    torch.Generator's on the generator's device."""
    if isinstance(gen, RowRandom):
        return gen.multinomial(probs)  # on the probabilities' device; the same tokens as on the CPU
    return torch.multinomial(probs.to(gen.device), 1, generator=gen)[:, 0]


def generator_for(seed):
    """A batch's randomness from a seed: a list (one per row) gives a RowRandom, an int one shared generator."""
    if isinstance(seed, (list, tuple)):
        return RowRandom(list(seed))
    return torch.Generator().manual_seed(int(seed))
