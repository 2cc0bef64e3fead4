"""Replay scoring: one teacher-forced forward of whole turns (with gradients when enabled) giving the answer
tokens' log-probs and the thoughts' log-densities under the current weights."""

from __future__ import annotations

import torch

from engine.latent import gaussian_logq, thought_mean
from engine.model import Tokens, _parts, left_pad


def turn_hidden(model, prefixes: list[list[int]], thoughts: list[torch.Tensor], answers: list[list[int]],
                toks: Tokens) -> torch.Tensor:
    """Last hidden states (B, S, d) of the left-padded teacher-forced turn inputs
    embed(prefix ⊕ <think>) ⊕ z_1..z_K ⊕ embed(</think> ⊕ a_1..a_{L-1}) (one full forward, no cache)."""
    text, _, emb = _parts(model)
    K = thoughts[0].shape[0] if thoughts else 0
    dev = emb.weight.device
    seqs = []
    for p, z, a in zip(prefixes, thoughts, answers):
        if z.shape[0] != K:
            raise ValueError("all turns of one scoring batch need the same number of thoughts")
        head_ids = torch.tensor(p + [toks.think], device=dev)
        tail_ids = torch.tensor([toks.answer_open] + a[:-1], device=dev)
        e_head, e_tail = emb(head_ids), emb(tail_ids)
        seqs.append(torch.cat([e_head, z.to(device=dev, dtype=e_head.dtype), e_tail], 0))
    x, mask, pos = left_pad(seqs)
    return text(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state


def score_turns(model, prefixes: list[list[int]], thoughts: list[torch.Tensor], answers: list[list[int]],
                temperature: float, sigma: float, scale: float, toks: Tokens, logprob_chunk: int | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Re-score turns: input = embed(prefix ⊕ <think>) ⊕ z_1..z_K ⊕ embed(</think> ⊕ a_1..a_{L-1}).

    Returns per-turn answer-token log-probs [(L_i,)] (post-temperature, fp32) and thought log-densities (B, K)
    under the current weights; saved thoughts are inputs, so gradients reach the adapter through mu_k(theta).
    logprob_chunk: compute the answer log-probs from vocabulary chunks of this many rows (engine.logprobs; the LM
    head must be frozen); None: the full FP32 log-softmax (the bootstrap, which trains the head).
    """
    _, head, _ = _parts(model)
    B = len(prefixes)
    K = thoughts[0].shape[0] if B else 0
    hid = turn_hidden(model, prefixes, thoughts, answers, toks)  # (B, S, d)
    S = hid.shape[1]
    # thoughts: mu_1 from the <think> position, mu_k from z_{k-1}'s position
    logq = []
    ans_lp = []
    for i, (z, a) in enumerate(zip(thoughts, answers)):
        L = len(a)
        start_ans = S - L  # position of </think> is S - L - 0 ... positions predicting a_1..a_L: [S-L, S)
        if K:
            t0 = S - L - 1 - K  # index of <think>
            mu = thought_mean(hid[i, t0:t0 + K], scale)  # (K, d)
            logq.append(gaussian_logq(z.to(mu.device).float(), mu, sigma))
        tgt = torch.tensor(a, device=hid.device)
        if logprob_chunk is None:
            logits = head(hid[i, start_ans:]).float() / temperature  # (L, V)
            lp = torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0]
        else:
            from engine.logprobs import selected_logprobs

            lp = selected_logprobs(hid[i, start_ans:], head.weight, tgt, temperature, logprob_chunk)  # (L,)
        ans_lp.append(lp)
    lq = torch.stack(logq) if K else torch.zeros(B, 0, device=hid.device)
    return ans_lp, lq
