"""The hf sampler's answers: decode from prompt embeddings (prefix ⊕ <think> ⊕ thoughts ⊕ </think>), and the
sampling loop every decoder shares (eager, prefix-cached, CUDA-graphed)."""

from __future__ import annotations

import torch

from engine.model import Tokens, _parts, cache_kw, left_pad
from engine.rng import draw_multinomial


def prompt_embeddings(model, prefix: list[int], thoughts: torch.Tensor, toks: Tokens) -> torch.Tensor:
    """embed(prefix ⊕ <think>) ⊕ z_1..z_K ⊕ embed(</think>)  -> (P + K + 2, d) in the model dtype."""
    _, _, emb = _parts(model)
    dev = emb.weight.device
    head = emb(torch.tensor(prefix + [toks.think], device=dev))
    tail = emb(torch.tensor([toks.answer_open], device=dev))
    return torch.cat([head, thoughts.to(device=dev, dtype=head.dtype), tail], 0)


@torch.no_grad()
def sample_answers(model, prompts: list[torch.Tensor], max_new: int, temperature: float, toks: Tokens,
                   gen: torch.Generator, limits: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Decode answers from prompt embeddings; returns token ids and processed (post-temperature) log-probs.

    A row stops after it emits <|im_end|> (kept as its last token), after `max_new` tokens, or after
    `limits[i]` tokens (what is left of its episode's token budget). A row's tokens do not depend on the others'
    limits: every row draws from the shared generator at every step while any row is live.
    """
    from transformers import DynamicCache

    text, head, emb = _parts(model)
    B = len(prompts)
    x, mask, pos = left_pad([p.to(emb.weight.device) for p in prompts])
    cache = DynamicCache(config=text.config)
    h = text(inputs_embeds=x, attention_mask=mask, position_ids=pos, **cache_kw(cache), use_cache=True).last_hidden_state[:, -1]
    state = {"h": h, "mask": mask, "pos": pos}

    def next_logp() -> torch.Tensor:
        return torch.log_softmax(head(state["h"]).float() / temperature, -1)

    def feed(nxt: torch.Tensor) -> None:
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(B, 1)], 1)
        state["pos"] = state["pos"][:, -1:] + 1
        state["h"] = text(inputs_embeds=emb(nxt.to(x.device)[:, None]), attention_mask=state["mask"], position_ids=state["pos"],
                          **cache_kw(cache), use_cache=True).last_hidden_state[:, -1]

    return sampling_loop(next_logp, feed, B, max_new, toks, gen, limits)


def sampling_loop(next_logp, feed, B: int, max_new: int, toks: Tokens, gen: torch.Generator,
                  limits: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Answer sampling shared by every decoder (HF eager, prefix-cached, CUDA-graphed).

    ``next_logp()`` gives the (B, V) post-temperature log-softmax of the next token on any device; ``feed(nxt)``
    advances the decoder by the sampled tokens (a CPU tensor). Every row draws from ``gen`` at every step while any
    row is live; a row stops after <|im_end|> (kept), after ``max_new`` or after ``limits[i]`` tokens."""
    ids: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    cap = [max_new if limits is None else max(0, min(max_new, int(limits[i]))) for i in range(B)]
    live = torch.tensor([c > 0 for c in cap], dtype=torch.bool)
    for n in range(max_new):
        if not live.any():
            break
        logp = next_logp()
        nxt = draw_multinomial(gen, logp.exp())  # on the generator's device (engine/rng.py: per row or shared)
        chosen = logp.gather(1, nxt.to(logp.device)[:, None])[:, 0].cpu()
        nxt = nxt.cpu()
        for i in range(B):
            if live[i]:
                ids[i].append(int(nxt[i]))
                lps[i].append(float(chosen[i]))
        live &= (nxt != toks.eos) & torch.tensor([n + 1 < c for c in cap], dtype=torch.bool)
        if not live.any():
            break
        feed(nxt)
    return ids, lps
