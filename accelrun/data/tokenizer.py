"""Byte-level tokenizer: every byte is its own token, plus two specials.

Ids 0..255 are the byte values; ``BOS`` = 256 and ``EOS`` = 257, so ``vocab_size`` is 258. A
model's embedding table must have at least that many rows (``model.vocab_size >= 258``).
Byte-level means one token per byte, so the size of a stream is known before reading a file:
sources rely on that to fill a preallocated buffer.

>>> tok = ByteTokenizer()
>>> tok.encode("hi", eos=True)
[104, 105, 257]
>>> tok.decode([256, 104, 105, 257])
'hi'
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer

BytesLike = str | bytes | bytearray | memoryview


def _as_bytes(text: BytesLike) -> bytes | bytearray | memoryview:
    return text.encode("utf-8") if isinstance(text, str) else text


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS/EOS above the byte range."""

    name = "byte"
    BOS = 256
    EOS = 257

    @property
    def vocab_size(self) -> int:
        """258: the 256 byte values plus BOS and EOS."""
        return 258

    def encode(self, text: BytesLike, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids as a Python list (``str`` is encoded as UTF-8 first)."""
        ids = list(_as_bytes(text))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def encode_tensor(
        self, text: BytesLike, *, bos: bool = False, eos: bool = False, dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """Token ids as a 1-D tensor of ``dtype``, without a Python loop over the bytes."""
        data = _as_bytes(text)
        n = len(data)
        out = torch.empty(n + int(bos) + int(eos), dtype=dtype)
        if bos:
            out[0] = self.BOS
        if eos:
            out[-1] = self.EOS
        if n:
            # frombuffer views the bytes without copying; a bytearray copy keeps torch from warning
            # about a read-only buffer (the copy into ``out`` happens anyway).
            buf = data if isinstance(data, bytearray) else bytearray(data)
            out[int(bos) : int(bos) + n].copy_(torch.frombuffer(buf, dtype=torch.uint8))
        return out

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text from ids. Specials, and ids beyond the byte range (a larger model vocab), are skipped;
        invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            flat = ids.reshape(-1).to(torch.int64)
            data = bytes(flat[(flat >= 0) & (flat < 256)].tolist())
        else:
            data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


def get_tokenizer(name: str, *, key: str = "data.tokenizer") -> ByteTokenizer | HFTokenizer:
    """The tokenizer a recipe's ``data.tokenizer`` names: ``byte`` (built in), or a tokenizer.json file
    or a folder holding one (``hf`` is replaced by the model.hf folder when the recipe is validated).
    ``key`` is what errors call the setting (``--tokenizer`` for ``accelrun data prepare``)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "hf":
        raise DataError(f"{key} = 'hf' means the model.hf folder's tokenizer; here give the folder itself")
    return HFTokenizer.load(name, key=key)
