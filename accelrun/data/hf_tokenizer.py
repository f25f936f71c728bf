"""A ``tokenizer.json`` tokenizer (the Hugging Face ``tokenizers`` library), read from a local file.

A document becomes the tokenizer's own encoding of its text (``Tokenizer.encode(text).ids``: the
special tokens its post-processor adds, e.g. a Llama tokenizer's BOS, included) followed by the
end-of-text id that ``tokenizer_config.json`` beside the file names, unless the encoding already ends
with it. A tokenizer without one joins documents without a separator (``validate`` warns). Text is
UTF-8; bytes that are not valid UTF-8 become U+FFFD before encoding.

>>> tok = HFTokenizer.load("models/my-llama")  # doctest: +SKIP
>>> tok.encode_documents(["def f():", "x = 1"])  # doctest: +SKIP
[[1, 822, 285, 7295, 2], [1, 921, 353, 29871, 29896, 2]]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from accelrun.config.tokenizer_file import (
    INSTALL_HINT,
    TokenizerFileError,
    TokenizerInfo,
    read_tokenizer_info,
)
from accelrun.data.errors import DataError, as_data_error


class HFTokenizer:
    """Encode and decode with a tokenizer.json; ``name`` is the id a token file's header records."""

    def __init__(self, info: TokenizerInfo, tokenizer) -> None:
        self.info = info
        self._tok = tokenizer
        self.name = info.name
        self.EOS = info.eos_id  # None: documents are joined without a separator

    @classmethod
    def load(cls, value: str, *, key: str = "data.tokenizer") -> HFTokenizer:
        """The tokenizer ``value`` (a tokenizer.json or a folder holding one) names; errors call it ``key``."""
        with as_data_error(TokenizerFileError):
            info = read_tokenizer_info(value, key=key)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{key} = {value!r} needs the tokenizers package: {INSTALL_HINT}") from None
        try:
            tokenizer = Tokenizer.from_file(str(info.path))
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            raise DataError(f"{key}: {info.path} is not a tokenizer the tokenizers library reads: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return cls(info, tokenizer)

    @property
    def vocab_size(self) -> int:
        """The largest id + 1: the embedding rows a model needs."""
        return self.info.vocab_size

    @property
    def token_dtype(self) -> torch.dtype:
        """The smallest dtype holding every id (uint16 up to 65,536 ids)."""
        return torch.uint16 if self.vocab_size <= 1 << 16 else torch.int32

    def encode(self, text: str) -> list[int]:
        """The tokenizer's own ids for ``text`` (its special tokens included), no end-of-text."""
        return self._tok.encode(text).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` without the tokenizer's own special tokens (as ``apply_chat_template`` encodes a
        rendered chat: the template writes them), and each token's ``[start, end)`` character offsets."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, end-of-text appended; the library encodes a batch on all its threads
        (``encode_batch_fast``, where there is one, skips the character offsets nobody here reads)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        out = []
        for enc in encode(list(texts)):
            ids = enc.ids
            if self.EOS is not None and (not ids or ids[-1] != self.EOS):
                ids.append(self.EOS)
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int] | torch.Tensor, *, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
