"""Chat format of one episode, as token ids (never re-tokenized: prefixes grow by concatenation).

    c_0     = <|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n
    turn t  : c_t ⊕ <think> ⊕ z_1..z_K ⊕ </think> ⊕ a_1..a_L          (a_L = <|im_end|> unless truncated)
    c_{t+1} = c_t ⊕ a_1..a_L ⊕ \n<|im_start|>user\n<tool_response>{obs}</tool_response><|im_end|>\n<|im_start|>assistant\n

Thoughts of earlier turns are not in later prefixes, so every prefix is pure tokens. `</think>` is the
answer-open token: the sampler's prompt embeddings are embed(c_t ⊕ <think>) ⊕ z ⊕ embed(</think>).

That is the project's built-in format (the tokenizers it trains carry no chat template). A tokenizer with a chat
template (a checkpoint's own: Qwen3.5/3.6 and the like) writes the same pieces through its template instead
(`ChatFormat`): c_0 is the template's generation prompt for the user question, with the gym's tools in the
template's tool section, up to where the template opens thinking; the latent thoughts sit in the thinking slot
(<think> z </think>, the tokenizer's own tokens); the observation block is what the template writes between an
assistant answer's end-of-message token and the next generation prompt's thinking slot, tool result included.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, eq=False)
class ChatFormat:
    """The chat format of a tokenizer: its chat template when it has one, else the built-in format above.

    `first_prompt(question, tools)` and `observation_block(observation)` give text that is tokenized and
    concatenated exactly as the module functions' (prefixes grow by concatenation, never re-tokenized)."""

    tok: Any
    template: bool

    @classmethod
    def of(cls, tok) -> "ChatFormat":
        fmt = _FORMATS.get(tok)
        if fmt is None:
            fmt = cls(tok, bool(getattr(tok, "chat_template", None)))
            if fmt.template:
                fmt._check()
            _FORMATS[tok] = fmt
        return fmt

    def first_prompt(self, question: str, tools: list[dict] | None = None) -> str:
        if not self.template:
            return first_prompt(question)
        text = self._render([{"role": "user", "content": question}], tools, generation=True)
        return self._before_thinking(text)

    def observation_block(self, observation: str) -> str:
        if not self.template:
            return observation_block(observation)
        answer = "\x00answer\x00"
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
                {"role": "tool", "content": observation}]
        text = self._render(msgs, None, generation=True)
        end = answer + IM_END
        at = text.find(end)
        if at < 0:
            raise ValueError(f"the chat template does not end an assistant message with {IM_END} right after its "
                             f"content; the trainer's answers end with {IM_END} (the end-of-message token)")
        return self._before_thinking(text[at + len(end):])

    # -- template plumbing --------------------------------------------------------------------------------------

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                            tokenize=False)

    def _before_thinking(self, text: str) -> str:
        """Text up to the template's thinking slot: a trailing `<think>` (and the whitespace after it) is left to the
        trainer, which writes <think> z </think> there."""
        stripped = text.rstrip()
        if stripped.endswith(THINK):
            return stripped[: -len(THINK)]
        return text

    def _check(self) -> None:
        missing = [t for t in (IM_END, THINK, ANSWER_OPEN) if _token_id(self.tok, t) is None]
        if missing:
            raise ValueError(f"the tokenizer has a chat template but no single token for {missing}: the latent "
                             f"thoughts need {THINK} ... {ANSWER_OPEN} and answers end with {IM_END}; use a Qwen3.5/3.6 "
                             f"style tokenizer or train the project's own (leave tokenizer.path unset)")
        try:
            self.first_prompt("q")
            self.observation_block("o")
        except Exception as e:  # a template that cannot render a plain tool exchange: say so at start-up
            raise ValueError(f"the tokenizer's chat template cannot render a user question, an assistant answer and "
                             f"a tool result: {e}") from e


_FORMATS: "weakref.WeakKeyDictionary[Any, ChatFormat]" = weakref.WeakKeyDictionary()


def _token_id(tok, token: str) -> int | None:
    """The id of `token` when the tokenizer has it as one token, else None."""
    i = tok.convert_tokens_to_ids(token)
    if i is None or (getattr(tok, "unk_token_id", None) is not None and i == tok.unk_token_id):
        return None
    return int(i)


def tool_specs(env) -> list[dict] | None:
    """The gym's tools as chat-template tool specs ({"type": "function", "function": {name, description,
    parameters}}): `env.tool_specs()` when the gym defines it, else from `env.tools` (gyms.tools.Tool)."""
    fn = getattr(env, "tool_specs", None)
    if callable(fn):
        return fn()
    tools = getattr(env, "tools", None)
    if not tools:
        return None
    try:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in tools]
    except AttributeError:
        return None
