"""What a recipe's ``data.tokenizer`` names, read without torch or the ``tokenizers`` library.

``data.tokenizer`` is ``byte`` (the built-in byte-level tokenizer), ``hf`` (the tokenizer in the
``model.hf`` folder), a ``tokenizer.json`` file, or a folder holding one. Validation needs only the
vocabulary size (the largest id + 1, which the model's embedding table must cover) and the end-of-text
token that separates documents, so the JSON is read here directly; the data layer encodes with the
``tokenizers`` library (``accelrun.data.hf_tokenizer``).

The end-of-text token comes from ``tokenizer_config.json`` beside ``tokenizer.json`` (its
``eos_token``, as transformers writes it). A bare ``tokenizer.json`` names none: documents are then
joined without a separator, and ``validate`` says so.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelrun.config.errors import ConfigError, nearest

BYTE = "byte"
MODEL_HF = "hf"  # the model.hf folder's own tokenizer
BYTE_VOCAB = 258  # accelrun.data.tokenizer.ByteTokenizer().vocab_size (a test keeps them in step)
INSTALL_HINT = "pip install 'accelrun[hf]'"


class TokenizerFileError(ConfigError):
    """A ``data.tokenizer`` that is not a readable tokenizer; the message names the file."""


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer.json file as validation sees it."""

    path: Path  # the tokenizer.json file
    vocab_size: int  # largest id + 1 (added tokens included)
    eos_token: str | None  # tokenizer_config.json's eos_token, if there is one
    eos_id: int | None
    sha256: str  # of the file's bytes and the end-of-text id: what decides the tokens

    @property
    def name(self) -> str:
        """16 ASCII characters naming this tokenizer in a token file's header (``hf-`` + hash)."""
        return "hf-" + self.sha256[:13]


def tokenizer_json_path(value: str, *, key: str = "data.tokenizer") -> Path:
    """The tokenizer.json that ``value`` (a file, or a folder holding one) names."""
    path = Path(value).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        if not inside.is_file():
            raise TokenizerFileError(
                f"{key}: {path} has no tokenizer.json (the tokenizers library's format; a sentencepiece "
                "tokenizer.model or vocab.json + merges.txt alone is not read)"
            )
        return inside
    if not path.exists():
        hint = nearest(value, [BYTE, MODEL_HF])
        also = f"; did you mean '{hint}'?" if hint else ""
        raise TokenizerFileError(
            f"{key} = {value!r}: no such file or folder (expected 'byte', 'hf', a tokenizer.json or a folder "
            f"holding one){also}"
        )
    return path


def read_tokenizer_info(value: str, *, key: str = "data.tokenizer") -> TokenizerInfo:
    """Vocabulary size and end-of-text token of the tokenizer ``value`` names (cached per file version)."""
    path = tokenizer_json_path(value, key=key)
    try:
        st = path.stat()
    except OSError as e:
        raise TokenizerFileError(f"{key}: cannot read {path}: {e.strerror}") from None
    return _read_info(str(path.resolve()), st.st_mtime_ns, st.st_size, key)


@functools.lru_cache(maxsize=8)
def _read_info(path_str: str, _mtime_ns: int, _size: int, key: str) -> TokenizerInfo:
    path = Path(path_str)
    try:
        raw = path.read_bytes()
        spec = json.loads(raw)
    except OSError as e:
        raise TokenizerFileError(f"{key}: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise TokenizerFileError(f"{key}: {path} is not readable JSON: {e}") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict | list):
        raise TokenizerFileError(
            f"{key}: {path} is not a tokenizer.json (no model.vocab; the tokenizers library writes one "
            "with Tokenizer.save, transformers with save_pretrained)"
        )
    ids = _token_ids(spec)
    if not ids:
        raise TokenizerFileError(f"{key}: {path} has an empty vocabulary")
    eos_token = _eos_token(path.parent / "tokenizer_config.json", key)
    eos_id = None
    if eos_token is not None:
        eos_id = ids.get(eos_token)
        if eos_id is None:
            raise TokenizerFileError(
                f"{key}: {path.parent / 'tokenizer_config.json'} names eos_token {eos_token!r}, "
                f"which is not in {path.name}'s vocabulary"
            )
    digest = hashlib.sha256(raw)
    digest.update(f"|eos={eos_id}".encode())
    return TokenizerInfo(path, max(ids.values()) + 1, eos_token, eos_id, digest.hexdigest())


def _token_ids(spec: dict[str, Any]) -> dict[str, int]:
    """Every token's id: the model's vocabulary (a mapping for BPE / WordPiece / WordLevel, a list of
    [piece, score] for Unigram) and the added tokens."""
    vocab = spec["model"]["vocab"]
    if isinstance(vocab, dict):
        ids = {str(t): int(i) for t, i in vocab.items()}
    else:
        ids = {str(entry[0]): i for i, entry in enumerate(vocab)}
    for added in spec.get("added_tokens") or []:
        ids[str(added["content"])] = int(added["id"])
    return ids


def _eos_token(config_path: Path, key: str) -> str | None:
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerFileError(f"{key}: {config_path} is not readable JSON: {e}") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # older transformers wrote an AddedToken as a mapping
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def tokenizers_installed() -> bool:
    return importlib.util.find_spec("tokenizers") is not None


def resolve_model_hf(value: str, model_hf: str | None, where: str) -> str:
    """``hf`` -> the model.hf folder (absolute, as model.hf is stored); other values unchanged."""
    if value != MODEL_HF:
        return value
    if model_hf is None:
        raise TokenizerFileError(
            f"{where}: hf means the model.hf folder's tokenizer, but model.hf is not set "
            "(give a tokenizer.json or a folder holding one instead)"
        )
    return os.fspath(model_hf)


def tokenizer_problems(cfg: Any, v: Any) -> list[str]:
    """Validation of ``data.tokenizer`` against the recipe (``cfg`` a RunConfig; ``v("a.b")`` renders a
    key as ``a.b = value (where it was set)``): a readable tokenizer, its package, and a vocabulary the
    model's embedding table covers."""
    data, model = cfg.data, cfg.model
    if data.source == "synthetic":
        return []
    if data.tokenizer == BYTE:
        if data.source in ("builtin", "text") and model.custom is None and model.vocab_size < BYTE_VOCAB:
            return [f"{v('model.vocab_size')} is smaller than the byte tokenizer's {BYTE_VOCAB} ids "
                    f"(data.tokenizer = byte)"]
        return _token_file_problems(cfg, v, BYTE) if data.source == "tokens" else []
    try:
        info = read_tokenizer_info(resolve_model_hf(data.tokenizer, model.hf, v("data.tokenizer")))
    except TokenizerFileError as e:
        if data.tokenizer == MODEL_HF and model.hf is not None:  # the checkpoint came without a tokenizer
            if data.source == "documents" and data.format == "chat":  # byte has no chat template to render
                return [f"{e} ({v('data.tokenizer')}: the model.hf folder's own tokenizer; data.format = chat "
                        "needs a Hugging Face tokenizer with a chat template: put its tokenizer.json and "
                        "tokenizer_config.json in the folder, or name a tokenizer folder in data.tokenizer)"]
            return [f"{e} ({v('data.tokenizer')}: the model.hf folder's own tokenizer; data.tokenizer=byte "
                    "trains on byte-level tokens instead)"]
        return [str(e)]
    out = []
    if data.source != "tokens" and not tokenizers_installed():
        out.append(f"{v('data.tokenizer')} needs the tokenizers package: {INSTALL_HINT}")
    if data.source == "tokens" and (mismatch := _token_file_problems(cfg, v, info.name)):
        return out + mismatch
    if model.custom is None and info.vocab_size > model.vocab_size:  # a custom model's vocabulary is its own
        if model.hf is None:
            fix = f"set model.vocab_size to at least {info.vocab_size}"
        elif data.tokenizer == MODEL_HF:
            fix = "the model.hf folder's tokenizer.json and config.json disagree"
        else:
            fix = "use the checkpoint's own tokenizer (data.tokenizer = hf)"
        out.append(f"data.tokenizer: {info.path} has {info.vocab_size} token ids (0..{info.vocab_size - 1}), but "
                   f"{v('model.vocab_size')}: the model has no embedding row for ids {model.vocab_size} and up; "
                   f"{fix}")
    return out


def tokenizer_warnings(cfg: Any) -> list[str]:
    """A tokenizer that names no end-of-text token: documents run into each other."""
    data = cfg.data
    if data.tokenizer in (BYTE, MODEL_HF) or data.source in ("synthetic", "tokens"):  # tokens: already joined
        return []
    try:
        info = read_tokenizer_info(data.tokenizer)
    except TokenizerFileError:
        return []  # reported by validation
    if info.eos_id is not None:
        return []
    return [f"data.tokenizer: {info.path} names no end-of-text token (no eos_token in a tokenizer_config.json "
            "beside it): documents are joined without a separator"]


def stored_tokenizer(value: str, model_hf: str | None) -> str:
    """The value a validated recipe keeps: ``byte``, or the tokenizer's absolute path (``hf``: the
    model.hf folder), so that ranks, a later ``generate`` and ``export`` find the same file."""
    if value == BYTE:
        return value
    if value == MODEL_HF:
        return os.fspath(model_hf) if model_hf is not None else value
    return str(Path(value).expanduser().resolve())


# Where a token file's header keeps what validation compares (accelrun.data.tokfile owns the layout; a
# test keeps the two in step so that validation reads headers without torch).
TOKEN_FILE_MAGIC = b"ACCTOK01"
_VOCAB_AT, _COUNT_AT, _NAME_AT = slice(12, 16), slice(16, 24), slice(24, 40)


def _token_file_header(path: Path) -> bytes | None:
    """The first 40 bytes of a token file; None for a file that is not one."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(40)
    except OSError:
        return None
    return head if len(head) == 40 and head[:8] == TOKEN_FILE_MAGIC else None


def token_file_tokenizer(path: Path) -> tuple[str, int] | None:
    """(tokenizer name, vocab_size) from a token file's header; None for a file that is not one (the
    data layer reports it with the details)."""
    if (head := _token_file_header(path)) is None:
        return None
    name = head[_NAME_AT].rstrip(b"\0").decode("ascii", errors="replace")
    return name, int.from_bytes(head[_VOCAB_AT], "little")


def token_file_count(path: Path) -> int | None:
    """How many tokens a token file's header says it holds; None for a file that is not one."""
    if (head := _token_file_header(path)) is None:
        return None
    return int.from_bytes(head[_COUNT_AT], "little")


def _token_file_problems(cfg: Any, v: Any, expected: str) -> list[str]:
    """data.source = tokens: each file was prepared with data.tokenizer, its ids fit the model, and
    together they hold one step's windows (else the loader's error came after the run folder was made)."""
    from accelrun.config.data_paths import expand_paths
    from accelrun.errors import UserError

    try:  # (as the loader expands them: a folder `accelrun data prepare` wrote stands for its shards, which
        files = [str(f) for f in expand_paths(cfg.data.paths)]  # a glob of files alone had passed by: a trial's)
    except UserError:
        return []  # data_files says what is wrong with the paths
    for f in files:
        found = token_file_tokenizer(Path(f))
        if found is None:
            continue
        name, vocab = found
        if name != expected:
            return [f"data.paths: {f} was prepared with tokenizer {name!r}, but {v('data.tokenizer')} is "
                    f"{expected!r}: set data.tokenizer to the one given to `accelrun data prepare --tokenizer`, "
                    "or prepare the file again"]
        if cfg.model.custom is None and vocab > cfg.model.vocab_size:
            return [f"data.paths: {f} holds ids up to {vocab - 1} (tokenizer {name!r}, vocab {vocab}), but "
                    f"{v('model.vocab_size')}: the model has no embedding row for ids {cfg.model.vocab_size} "
                    "and up"]
    counts = [token_file_count(Path(f)) for f in files]
    t = cfg.train
    windows = t.micro_batch * cfg.parallel.dp if t.micro_batch else t.global_batch // (t.grad_accum or 1)
    needed = windows * t.seq_len + 1
    if files and None not in counts and sum(counts) < needed:
        held = f"{files[0]} holds" if len(files) == 1 else f"its {len(files)} token files hold"
        return [f"data.paths: {held} {sum(counts):,} tokens, but one step needs {needed:,} ({windows} sequences "
                f"of train.seq_len {t.seq_len}, + 1): add data, or lower train.global_batch or train.seq_len"]
    return []
