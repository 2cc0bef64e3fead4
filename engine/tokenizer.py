"""A byte-level BPE tokenizer trained offline on text the project generates (no hub access)."""

from __future__ import annotations

from pathlib import Path

from engine.chat import EOS, IM_END, PAD, SPECIAL_TOKENS


def train_tokenizer(corpus: list[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on `corpus` and save it in HF format (tokenizer.json + config) to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, unk_token=None, bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, IM_END)],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def load_tokenizer(path: str | Path):
    from transformers import PreTrainedTokenizerFast

    from artifacts.checkpoint import resolve

    p = resolve(path)  # a run's reference to a checkpoint used in place: its own tokenizer
    if not (p / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer at {p} (expected tokenizer.json); train one with engine.tokenizer.train_tokenizer")
    tok = PreTrainedTokenizerFast.from_pretrained(p)
    assert tok.convert_tokens_to_ids(EOS) is not None
    return tok
