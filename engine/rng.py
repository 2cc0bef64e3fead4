"""Randomness of a rollout that does not depend on where its row runs.

A step's rows can be generated in one batch or spread over workers in any grouping; a row's thought noise and its
answer tokens must come out the same either way (and two workers must never draw the same stream: the second
seed's ranks once sampled identical rollouts). So every row draws from its own generator, seeded from
(run seed, step, turn, row, purpose) by the caller (stages/generate.py), and a batch draw is the rows' draws side
by side:

    RowRandom(seeds).randn(B, d)       row i: torch.randn(d) from generator i    (one block per thought, in order)
    RowRandom(seeds).multinomial(p)    row i: torch.multinomial(p[i], 1) from generator i

`draw_normal` / `draw_multinomial` take either a RowRandom or a plain torch.Generator (one stream for the whole
batch, row order: the bootstrap's warm start and older callers), so every latent and decode path (eager,
prefix-cached, CUDA-graphed) shares one definition of how a batch draws.
"""

from __future__ import annotations

import torch


class RowRandom:
    """One CPU generator per row (CPU: the same numbers whatever device the model runs on)."""

    def __init__(self, seeds: list[int]):
        self.seeds = [int(s) for s in seeds]
        self.gens = [torch.Generator().manual_seed(s) for s in self.seeds]
        self.device = torch.device("cpu")

    def __len__(self) -> int:
        return len(self.gens)

    def randn(self, B: int, d: int) -> torch.Tensor:
        if B != len(self.gens):
            raise ValueError(f"RowRandom: {B} rows asked for, {len(self.gens)} generators")
        if B == 0:
            return torch.zeros(0, d)
        return torch.stack([torch.randn(d, generator=g) for g in self.gens])

    def multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        """(B,) one sample per row of the (B, V) probabilities (on the CPU)."""
        if probs.shape[0] != len(self.gens):
            raise ValueError(f"RowRandom: {probs.shape[0]} rows asked for, {len(self.gens)} generators")
        return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(self.gens)])


def draw_normal(gen, B: int, d: int) -> torch.Tensor:
    """(B, d) standard normal noise from a RowRandom or a torch.Generator (on the generator's device)."""
    if isinstance(gen, RowRandom):
        return gen.randn(B, d)
    return torch.randn(B, d, generator=gen, device=gen.device)


def draw_multinomial(gen, probs: torch.Tensor) -> torch.Tensor:
    """(B,) token ids sampled from (B, V) probabilities, on the generator's device."""
    if isinstance(gen, RowRandom):
        return gen.multinomial(probs.to(gen.device))
    return torch.multinomial(probs.to(gen.device), 1, generator=gen)[:, 0]


def generator_for(seed):
    """A batch's randomness from a seed: a list (one per row) gives a RowRandom, an int one shared generator."""
    if isinstance(seed, (list, tuple)):
        return RowRandom(list(seed))
    return torch.Generator().manual_seed(int(seed))
