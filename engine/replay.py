"""Replay: re-score stored turns with gradients, and lay per-turn terms out as GRPO sequences.

A rollout's GRPO "completion" is the concatenation over its turns of [thought terms (K), answer tokens (L)]:
thought terms carry log q(z_k) under the current policy (behaviour: the generation-time density), answer tokens
carry log pi(a_i) (behaviour: the sampler's log-prob). One advantage per rollout, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import model as M

MAX_TOKENS_PER_MICROBATCH = 8192


@dataclass
class Turns:
    """Stored turns, in rollouts.arrow order."""

    prefixes: list[list[int]]
    thoughts: list[torch.Tensor]  # (K, d) fp32 each
    answers: list[list[int]]
    rows: list[int]

    def lengths(self) -> list[int]:
        return [len(p) + z.shape[0] + len(a) + 1 for p, z, a in zip(self.prefixes, self.thoughts, self.answers)]


def microbatches(lengths: list[int], max_tokens: int = MAX_TOKENS_PER_MICROBATCH) -> list[list[int]]:
    """Consecutive index groups whose padded size (n * longest) stays within max_tokens. Deterministic."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def score_microbatch(engine, turns: Turns, idx: list[int], temperature: float, sigma: float):
    """Per-turn answer log-probs [(L,)] and thought log-densities (n, K) for turns `idx` (graph kept if enabled)."""
    return M.score_turns(engine.model, [turns.prefixes[i] for i in idx], [turns.thoughts[i] for i in idx],
                         [turns.answers[i] for i in idx], temperature, sigma, engine.scale, engine.toks)


def to_sequences(rows: list[int], per_turn: list[torch.Tensor], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-turn 1-D tensors by rollout (turn order kept) -> padded (B, T) values and a (B, T) mask."""
    by_row: list[list[torch.Tensor]] = [[] for _ in range(n_rows)]
    for r, x in zip(rows, per_turn):
        by_row[r].append(x)
    seqs = [torch.cat(xs) if xs else torch.zeros(0) for xs in by_row]
    T = max(s.numel() for s in seqs)
    vals = torch.zeros(n_rows, T, dtype=seqs[0].dtype)
    mask = torch.zeros(n_rows, T)
    for i, s in enumerate(seqs):
        vals[i, : s.numel()] = s
        mask[i, : s.numel()] = 1.0
    return vals, mask


def from_sequences(rows: list[int], lengths: list[int], seq: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `to_sequences`: split (B, T) back into per-turn 1-D tensors."""
    offsets = [0] * seq.shape[0]
    out = []
    for r, n in zip(rows, lengths):
        out.append(seq[r, offsets[r]: offsets[r] + n])
        offsets[r] += n
    return out
