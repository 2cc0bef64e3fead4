"""Selected-token log-probs from vocabulary chunks: log softmax(h W^T / T)[a] without the (N, V) FP32 logits.

At the 27B shape (vocabulary 248,320) the full FP32 logits of N positions take N MB (8 GB at 8k positions), and
autograd would keep them, and their softmax, for backward. Here the forward walks the vocabulary in chunks of
`chunk` rows of the (frozen) LM head, keeping a running max and sum of exponentials per position (FP32), and saves
only h, the targets and the per-position log-normalizer. The backward walks the chunks again:
d lp / d h = (W[a] - Σ_v softmax_v W_v) / T, accumulated in FP32 and rounded once to h's dtype.

Logits are computed like the samplers compute them -- (h @ W_chunk^T) in the model dtype, then FP32, then / T --
so a chunked log-prob equals the full log_softmax(head(h).float() / T) up to FP32 summation order
(tests/test_replay_memory.py: <= 1e-5 nat in FP32 and BF16). The LM head gets no gradient (it is never an adapter
target here; a chunked head that needs one must not use this function).
"""

from __future__ import annotations

import torch


def _chunks(V: int, chunk: int):
    for v0 in range(0, V, chunk):
        yield v0, min(V, v0 + chunk)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int):
        N = h.shape[0]
        run_max = torch.full((N,), float("-inf"), device=h.device, dtype=torch.float32)
        run_sum = torch.zeros(N, device=h.device, dtype=torch.float32)
        picked = torch.zeros(N, device=h.device, dtype=torch.float32)
        for v0, v1 in _chunks(weight.shape[0], chunk):
            z = (h @ weight[v0:v1].t()).float() / temperature  # (N, c) fp32
            inside = (targets >= v0) & (targets < v1)  # the selected logit, from the same GEMM as the rest
            picked = torch.where(inside, z.gather(1, (targets - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0], picked)
            cmax = z.max(-1).values
            new_max = torch.maximum(run_max, cmax)
            run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
            run_max = new_max
        lse = run_max + torch.log(run_sum)  # (N,)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return picked - lse

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        T = ctx.temperature
        gf = g.float()  # (N,)
        grad = (gf[:, None] * weight[targets].float()) / T  # (N, d) fp32: the selected logit's term
        for v0, v1 in _chunks(weight.shape[0], ctx.chunk):
            z = (h @ weight[v0:v1].t()).float() / T
            p = torch.exp(z - lse[:, None])  # softmax over the chunk (N, c)
            grad -= ((p * gf[:, None]) @ weight[v0:v1].float()) / T
        return grad.to(h.dtype), None, None, None, None


def selected_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                      chunk: int = 32768) -> torch.Tensor:
    """log softmax(h W^T / T) at `targets`.  h (N, d) model dtype, weight (V, d) frozen, targets (N,) -> (N,) fp32."""
    if weight.requires_grad:
        raise ValueError("selected_logprobs: the LM head must be frozen (it is not an adapter target)")
    return _ChunkedLogprob.apply(h, weight, targets, float(temperature), int(chunk))
