"""A byte-level BPE tokenizer folder trained here on the benches' own text (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def train_bpe(texts: Iterable[str], vocab: int, folder: Path) -> Path:
    """A Hugging Face tokenizer folder of a ``vocab``-token BPE trained on ``texts``, EOS <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder
