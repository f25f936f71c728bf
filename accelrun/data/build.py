"""From a recipe's ``data`` section to a rank's batch iterator."""

from __future__ import annotations

from accelrun.config.schema import DataConfig, EvalConfig
from accelrun.config.tokenizer_file import TokenizerFileError, read_tokenizer_info
from accelrun.data.builtin import load_builtin
from accelrun.data.chat import ChatEncoder, LossOn, load_chat
from accelrun.data.documents import load_documents
from accelrun.data.errors import DataError, as_data_error
from accelrun.data.heldout import HeldOutBatches
from accelrun.data.loader import TokenBatchIterator
from accelrun.data.mix import MixedBatchIterator
from accelrun.data.stream import TokenStream
from accelrun.data.synthetic import SyntheticStream, synthetic_length
from accelrun.data.text import load_text
from accelrun.data.tokenizer import get_tokenizer
from accelrun.data.tokfile import load_tokens


def check_vocab(data_vocab: int, model_vocab: int, what: str, custom: str | None = None) -> None:
    """The data's token ids fit the model: ``model.vocab_size``, or for a user's model (``custom``, its
    model.custom) the rows of its token embedding."""
    if data_vocab <= model_vocab:
        return
    if custom is None:
        raise DataError(
            f"model.vocab_size is {model_vocab}, but {what} has ids up to {data_vocab - 1} "
            f"(vocab {data_vocab}): set model.vocab_size to at least {data_vocab}"
        )
    raise DataError(
        f"model.custom = {custom!r} embeds token ids below {model_vocab} (its token table), but {what} "
        f"has ids up to {data_vocab - 1} (vocab {data_vocab}): build its token embedding and output with at "
        f"least {data_vocab} rows (through model.kwargs, if the factory takes the size)"
    )


def _check_token_files_tokenizer(recorded: str, configured: str) -> None:
    """Token files record the tokenizer that made them (``byte``, or ``hf-`` + a hash of the
    tokenizer.json); the recipe's data.tokenizer must be that one, so what the run records is true."""
    if configured == "byte":
        expected = "byte"
    else:
        with as_data_error(TokenizerFileError):
            expected = read_tokenizer_info(configured).name
    if recorded != expected:
        named = repr(configured) if configured == expected else f"{configured!r} ({expected!r})"
        raise DataError(
            f"data.paths: the token files were made by tokenizer {recorded!r}, but data.tokenizer = {named}: "
            "set data.tokenizer to the tokenizer they were prepared with (accelrun data prepare --tokenizer), "
            "or prepare them again"
        )


def load_stream(cfg: DataConfig, *, vocab_size: int, seed: int, min_tokens: int | None = None,
                custom: str | None = None) -> TokenStream:
    """The token stream ``cfg`` describes. ``vocab_size`` is the model's (``custom``: a user's model, named
    by its model.custom, whose vocabulary is its embedding's rows); ``min_tokens`` sizes the synthetic
    stream (other sources have the length their data has)."""
    if cfg.source == "synthetic":
        return SyntheticStream(vocab_size=vocab_size, length=synthetic_length(min_tokens), seed=seed)
    if cfg.source == "tokens":
        # verify: a changed file or a stray id is exit 2, not a crash
        stream = load_tokens(cfg.paths, verify=True, random_access=cfg.shuffle)
        _check_token_files_tokenizer(stream.fingerprint["tokenizer"], cfg.tokenizer)
        check_vocab(
            stream.vocab_size,
            vocab_size,
            f"the token files in data.paths ({stream.fingerprint['tokenizer']})",
            custom,
        )
        return stream
    if cfg.source == "documents" and cfg.format == "chat":  # rendered with the tokenizer folder's chat template
        encoder = ChatEncoder.for_tokenizer(cfg.tokenizer, LossOn(cfg.loss_on))
        check_vocab(encoder.tokenizer.vocab_size, vocab_size, f"data.tokenizer {cfg.tokenizer!r}", custom)
        return load_chat(cfg.paths, encoder, messages_field=cfg.messages_field)
    tokenizer = get_tokenizer(cfg.tokenizer)
    # Checked before reading anything: the tokenizer's vocabulary is known up front.
    check_vocab(tokenizer.vocab_size, vocab_size, f"data.tokenizer {cfg.tokenizer!r}", custom)
    if cfg.source == "builtin":
        return load_builtin(cfg.builtin, max_bytes=cfg.max_bytes, tokenizer=tokenizer)
    if cfg.source == "text":
        return load_text(cfg.paths, max_bytes=cfg.max_bytes, tokenizer=tokenizer)
    if cfg.source == "documents" and cfg.format == "text":
        return load_documents(cfg.paths, tokenizer=tokenizer, tokenizer_spec=cfg.tokenizer, text_field=cfg.text_field,
                              random_access=cfg.shuffle)
    raise DataError(f"data.source: unknown source {cfg.source!r}")


def mix_source_config(data_cfg: DataConfig, i: int) -> DataConfig:
    """The ``data`` section that reads ``data.mix[i]`` alone (the tokenizer and the rest shared)."""
    entry = data_cfg.mix[i]
    return data_cfg.model_copy(update={"source": entry.source, "paths": list(entry.paths),
                                       "text_field": entry.text_field, "mix": []})


def build_data(
    data_cfg: DataConfig,
    *,
    seq_len: int,
    micro_batch: int,
    seed: int,
    vocab_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    min_tokens: int | None = None,
    eval_cfg: EvalConfig | None = None,
    custom: str | None = None,
) -> TokenBatchIterator | MixedBatchIterator:
    """The batch iterator of one data-parallel rank (of a ``data.mix``'s sources when it has any).

    ``seed`` is ``train.seed``; ``data.seed`` overrides it when set. ``min_tokens`` is how many
    tokens the run will read (only the synthetic source uses it). ``custom``: ``vocab_size`` is a user's
    model's (its model.custom; see ``load_stream``). There are no loader workers:
    a batch is a few slices of an in-memory or memory-mapped stream, cheaper than a worker hand-off.

    >>> it = build_data(cfg.data, seq_len=256, micro_batch=8, seed=0, vocab_size=512)  # doctest: +SKIP
    >>> inputs_BT, targets_BT = next(it)
    """
    seed = data_cfg.seed if data_cfg.seed is not None else seed
    if data_cfg.mix:
        if eval_cfg is not None and eval_cfg.every > 0:
            raise DataError("data.mix with eval.every is not supported yet: set eval.every = 0")
        streams = [load_stream(mix_source_config(data_cfg, i), vocab_size=vocab_size, seed=seed, min_tokens=min_tokens,
                               custom=custom)
                   for i in range(len(data_cfg.mix))]
        return MixedBatchIterator(streams, [e.weight for e in data_cfg.mix], seq_len=seq_len, micro_batch=micro_batch,
                                  seed=seed, shuffle=data_cfg.shuffle, dp_rank=dp_rank, dp_size=dp_size,
                                  packing=data_cfg.packing)
    stream = load_stream(data_cfg, vocab_size=vocab_size, seed=seed, min_tokens=min_tokens, custom=custom)
    if eval_cfg is not None and eval_cfg.every > 0 and not eval_cfg.paths:  # training reads what precedes the tail
        heldout = HeldOutBatches(stream, seq_len=seq_len, micro_batch=micro_batch, split=eval_cfg.split,
                                 max_batches=eval_cfg.steps, dp_rank=dp_rank, dp_size=dp_size,
                                 packing=data_cfg.packing)
        stream = heldout.train_stream()
    return TokenBatchIterator(
        stream,
        seq_len=seq_len,
        micro_batch=micro_batch,
        seed=seed,
        shuffle=data_cfg.shuffle,
        dp_rank=dp_rank,
        dp_size=dp_size,
        packing=data_cfg.packing,
    )


def build_eval_data(
    data_cfg: DataConfig, eval_cfg: EvalConfig, *, seq_len: int, micro_batch: int, seed: int, vocab_size: int,
    dp_rank: int = 0, dp_size: int = 1, min_tokens: int | None = None, custom: str | None = None,
) -> HeldOutBatches:
    """This rank's evaluation batches: the held-out tail that ``build_data(..., eval_cfg=...)`` leaves out, or
    every window of ``eval.paths`` (read as data.paths is: the same source, format and tokenizer)."""
    seed = data_cfg.seed if data_cfg.seed is not None else seed
    if eval_cfg.paths:
        data_cfg = data_cfg.model_copy(update={"paths": list(eval_cfg.paths)})
    stream = load_stream(data_cfg, vocab_size=vocab_size, seed=seed, min_tokens=min_tokens, custom=custom)
    return HeldOutBatches(stream, seq_len=seq_len, micro_batch=micro_batch,
                          split=None if eval_cfg.paths else eval_cfg.split,
                          max_batches=eval_cfg.steps, dp_rank=dp_rank, dp_size=dp_size, packing=data_cfg.packing)
