"""Data: tokenizers (byte-level built in, or a tokenizer.json), token sources, packing into windows,
per-rank sharding, resumable state.

Flow: ``build_data(cfg.data, ...)`` → ``load_stream`` picks a source (builtin / text / tokens /
synthetic / documents) → a ``TokenStream`` (1-D token ids + a fingerprint + where documents start) →
``TokenBatchIterator`` cuts it into ``seq_len + 1`` windows, shuffles them per epoch, gives each rank
its share, and yields ``Batch(inputs, targets)``; with ``data.mix``, ``MixedBatchIterator`` draws the
windows from several streams by weight.

Record files (jsonl, json, csv, parquet, Arrow, save_to_disk folders) are read by ``records``
(``iter_records``), tokenized into memory-mapped shards by ``prepare_records.prepare_records``
(``accelrun data prepare``, and the ``documents`` source's cache; not re-exported here, where the
function would hide its module of the same name).
"""

from accelrun.data.build import build_data, load_stream
from accelrun.data.builtin import load_builtin, stdlib_files
from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.loader import Batch, TokenBatchIterator
from accelrun.data.mix import MixedBatchIterator
from accelrun.data.prepare import prepare_tokens
from accelrun.data.prepare_records import PreparedCorpus
from accelrun.data.records import Record, iter_records
from accelrun.data.stream import TensorStream, TokenStream
from accelrun.data.synthetic import SyntheticStream, synthetic_length
from accelrun.data.text import expand_paths, load_text, read_documents
from accelrun.data.tokenizer import ByteTokenizer, get_tokenizer
from accelrun.data.tokfile import TokenFileHeader, load_tokens, open_tokens, read_header

__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "MixedBatchIterator",
    "PreparedCorpus",
    "Record",
    "SyntheticStream",
    "TensorStream",
    "TokenBatchIterator",
    "TokenFileHeader",
    "TokenStream",
    "build_data",
    "expand_paths",
    "get_tokenizer",
    "iter_records",
    "load_builtin",
    "load_stream",
    "load_text",
    "load_tokens",
    "open_tokens",
    "prepare_tokens",
    "read_documents",
    "read_header",
    "stdlib_files",
    "synthetic_length",
]
