"""Chat format of one episode, as token ids (never re-tokenized: prefixes grow by concatenation).

    c_0     = <|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n
    turn t  : c_t ⊕ <think> ⊕ z_1..z_K ⊕ </think> ⊕ a_1..a_L          (a_L = <|im_end|> unless truncated)
    c_{t+1} = c_t ⊕ a_1..a_L ⊕ \n<|im_start|>user\n<tool_response>{obs}</tool_response><|im_end|>\n<|im_start|>assistant\n

Thoughts of earlier turns are not in later prefixes, so every prefix is pure tokens. `</think>` is the
answer-open token: the sampler's prompt embeddings are embed(c_t ⊕ <think>) ⊕ z ⊕ embed(</think>).
"""

from __future__ import annotations

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
ANSWER_OPEN = "</think>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = [
    PAD, EOS, IM_START, IM_END, THINK, ANSWER_OPEN,
    TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END,
]


def first_prompt(question: str) -> str:
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"


def observation_block(observation: str) -> str:
    """What follows a model answer (which ends with <|im_end|>) when the gym returns an observation."""
    return f"\n{IM_START}user\n{TOOL_RESPONSE}{observation}{TOOL_RESPONSE_END}{IM_END}\n{IM_START}assistant\n"


def episode_text(question: str, answers: list[str], observations: list[str]) -> str:
    """Full text of an episode without thoughts (tokenizer training corpus, bootstrap data)."""
    text = first_prompt(question)
    for i, a in enumerate(answers):
        text += a + IM_END
        if i < len(observations):
            text += observation_block(observations[i])
    return text
