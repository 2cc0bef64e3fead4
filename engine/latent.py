"""The latent loop (trainer model): K thoughts per row, z_k = mu_k + sigma * eps_k, with their log-densities; the
thought mean mu = g(h) and the density log q (replay scoring uses them too).

thought_step is the one definition of a latent step; the prefix-cached loop (engine/prefix_cache.py) and the
CUDA-graphed loop (engine/cuda_graphs.py) run it too.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.model import Tokens, _parts, cache_kw, left_pad
from engine.rng import draw_normal


def thought_mean(h: torch.Tensor, scale: float) -> torch.Tensor:
    """mu = g(h): the post-norm last hidden state rescaled to the embedding table's RMS.  (..., d) fp32."""
    h = h.float()
    return scale * h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


def gaussian_logq(z: torch.Tensor, mu: torch.Tensor, sigma: float) -> torch.Tensor:
    """log N(z; mu, sigma^2 I), summed over the last dim (fp32)."""
    d = z.shape[-1]
    sq = (z.float() - mu.float()).pow(2).sum(-1)
    return -0.5 * sq / sigma**2 - d * math.log(sigma) - 0.5 * d * math.log(2 * math.pi)


@torch.no_grad()
def latent_loop(model, prefixes: list[list[int]], K: int, sigma: float, scale: float, toks: Tokens,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample K thoughts per row.  Returns thoughts (B, K, d) fp32 and their log-densities (B, K) fp32.

    z_k = mu_k + sigma * eps_k, eps from `gen` (drawn as one (B, d) block per step, row order).
    """
    from transformers import DynamicCache

    text, _, emb = _parts(model)
    B = len(prefixes)
    d = emb.weight.shape[1]
    dtype, dev = emb.weight.dtype, emb.weight.device
    if K == 0:
        return torch.zeros(B, 0, d, device=dev), torch.zeros(B, 0, device=dev)
    seqs = [emb(torch.tensor(p + [toks.think], device=dev)) for p in prefixes]
    x, mask, pos = left_pad(seqs)
    cache = DynamicCache(config=text.config)
    h = text(inputs_embeds=x, attention_mask=mask, position_ids=pos, **cache_kw(cache), use_cache=True).last_hidden_state[:, -1]

    def feed(z: torch.Tensor) -> torch.Tensor:
        nonlocal mask, pos
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        pos = pos[:, -1:] + 1
        return text(inputs_embeds=z[:, None].to(dtype), attention_mask=mask, position_ids=pos, **cache_kw(cache),
                    use_cache=True).last_hidden_state[:, -1]

    return sample_thoughts(h, K, sigma, scale, gen, feed)


def thought_step(h: torch.Tensor, eps: torch.Tensor, sigma: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One latent step from the last hidden state h (B, d): mu = g(h), z = mu + sigma * eps, and log q(z). Every
    latent path runs this one definition: the eager and prefix-cached loops (sample_thoughts) and the CUDA-graphed
    loop (engine.cuda_graphs.GraphedLatentLoop), so their thoughts agree bit for bit. Returns z (B, d), log q (B,)."""
    mu = thought_mean(h, scale)
    z = mu + sigma * eps
    return z, gaussian_logq(z, mu, sigma)


def sample_thoughts(h: torch.Tensor, K: int, sigma: float, scale: float, gen: torch.Generator,
                    feed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K thoughts from h (B, d), the hidden state at <think>: eps drawn from `gen` as one (B, d) block per step in
    row order; feed(z) runs z through the model (in its dtype) and returns the next h. Returns (B, K, d), (B, K)."""
    B, d = h.shape
    zs, lqs = [], []
    for k in range(K):
        eps = draw_normal(gen, B, d).to(h.device)
        z, lq = thought_step(h, eps, sigma, scale)
        zs.append(z)
        lqs.append(lq)
        if k < K - 1:
            h = feed(z)
    return torch.stack(zs, 1), torch.stack(lqs, 1)
