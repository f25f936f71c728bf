"""The README's example inputs, written on this machine with nothing downloaded (``accelrun data examples``).

Documents come from the running Python's standard library (as ``data.source: builtin`` reads it), in
every record format ``data.source: documents`` reads; chats are built from the same modules' names; the
chat model is a tiny random Llama saved as transformers saves one, with a byte-level BPE trained on the
chats and a chat template whose ``{% generation %}`` blocks mark what the assistant says. Each format a
missing package cannot write is skipped with the extra that installs it.

    >>> report = write_examples(Path("."))  # doctest: +SKIP
    >>> [w.path for w in report.written]     # doctest: +SKIP
    ['corpus/a.txt', 'corpus/docs.jsonl', ...]
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from accelrun.data.builtin import stdlib_files

N_DOCUMENTS = 64
DOCUMENT_CHARS = 2000  # each document: the start of one module's source (a corpus of about 128 KiB)
N_CHATS = 256
# The special tokens the chat template writes; <s> and </s> are the tokenizer's BOS and EOS.
CHAT_SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# ChatML-like; {% generation %} marks the assistant's words, which data.loss_on: assistant keeps in the
# loss (transformers' apply_chat_template(..., return_assistant_tokens_mask=True) reads the same marks).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}{{ message['content'] | trim }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The chat model: small enough to write in a second and fine-tune on a laptop CPU; configs/hf-chat.yaml
# trains 128-token windows.
CHAT_MODEL_SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192, "max_seq_len": 256}
CHAT_VOCAB = 512


@dataclass(frozen=True)
class Written:
    path: str
    what: str


@dataclass
class ExamplesReport:
    written: list[Written] = field(default_factory=list)
    skipped: list[Written] = field(default_factory=list)  # what: the package that writes it


# What write_examples writes under its root (files, and folders it replaces whole), and the record of them
# it leaves: a file there that is not in it, or differs from it, is someone's own.
TARGETS = ("corpus/a.txt", "corpus/docs.jsonl", "corpus/docs.json", "corpus/docs.csv", "corpus/docs.parquet",
           "corpus/docs.arrow", "corpus/saved", "chats.jsonl", "models/my-chat-model")
RECORD = ".accelrun-examples.json"


def not_ours(root: Path) -> list[str]:
    """The example paths under ``root`` that an earlier ``write_examples`` did not leave as they are: a
    team's own corpus/a.txt or chats.jsonl, which the command replaced without a word (a trial's)."""
    try:
        written = json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        written = {}
    theirs = []
    for name in TARGETS:
        path = root / name
        if not path.exists():
            continue
        if name not in written or (path.is_file() and _digest(path) != written[name]):
            theirs.append(name)
    return theirs


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(root: Path) -> None:
    written = {name: _digest(p) if p.is_file() else "folder" for name in TARGETS if (p := root / name).exists()}
    (root / RECORD).write_text(json.dumps(written, indent=1) + "\n")


def write_examples(root: Path) -> ExamplesReport:
    """Write corpus/ (a.txt, docs.jsonl/.json/.csv/.parquet/.arrow, saved/), chats.jsonl and
    models/my-chat-model under ``root``, replacing earlier copies (``not_ours`` says which files are not
    such copies: the command asks first); return what was written and skipped."""
    report = ExamplesReport()
    docs = _documents()
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    _write_records(corpus, docs, report)
    chats = _chats()
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    report.written.append(Written("chats.jsonl", f"{len(chats)} chats ({{role, content}} messages)"))
    _write_chat_model(root / "models" / "my-chat-model", chats, report)
    _record(root)
    return report


def _documents() -> list[dict]:
    files = stdlib_files()[:N_DOCUMENTS]
    return [{"id": i, "text": f.read_text(encoding="utf-8", errors="replace")[:DOCUMENT_CHARS]}
            for i, f in enumerate(files)]


def _write_records(corpus: Path, docs: list[dict], report: ExamplesReport) -> None:
    (corpus / "a.txt").write_text("\n".join(d["text"] for d in docs[:8]))
    report.written.append(Written("corpus/a.txt", "plain text (data.source: text)"))
    (corpus / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (corpus / "docs.json").write_text(json.dumps(docs))
    with open(corpus / "docs.csv", "w", newline="") as fh:  # the column is body: data.text_field=body
        writer = csv.writer(fh)
        writer.writerow(["id", "body"])
        writer.writerows([d["id"], d["text"]] for d in docs)
    for name in ("docs.jsonl", "docs.json", "docs.csv"):
        report.written.append(Written(f"corpus/{name}", f"{len(docs)} documents"))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        for name in ("docs.parquet", "docs.arrow"):
            report.skipped.append(Written(f"corpus/{name}", "pip install 'accelrun[data]' (pyarrow)"))
    else:
        table = pa.Table.from_pylist(docs)
        pq.write_table(table, corpus / "docs.parquet")
        with pa.ipc.new_file(corpus / "docs.arrow", table.schema) as writer:
            writer.write_table(table)
        for name in ("docs.parquet", "docs.arrow"):
            report.written.append(Written(f"corpus/{name}", f"{len(docs)} documents"))
    try:
        import datasets
    except ImportError:
        report.skipped.append(Written("corpus/saved", "pip install datasets (save_to_disk writes it)"))
    else:
        import shutil

        shutil.rmtree(corpus / "saved", ignore_errors=True)  # save_to_disk refuses to write over itself
        datasets.disable_progress_bars()  # 64 rows: a bar is noise in this command's list of files
        datasets.Dataset.from_list(docs).save_to_disk(str(corpus / "saved"))
        report.written.append(Written("corpus/saved", f"{len(docs)} documents (a save_to_disk folder)"))


def _chats() -> list[list[dict]]:
    """Questions about standard library modules, answered with the names they define: varied lengths,
    some with a system turn and two exchanges, every one with an assistant turn."""
    out = []
    for i, f in enumerate(stdlib_files()[:N_CHATS]):
        module = f.stem
        names = [line.split("(")[0].split()[1] for line in f.read_text(encoding="utf-8", errors="replace")
                 .splitlines() if line.startswith("def ") and "(" in line][:6] or ["nothing at the top level"]
        chat = [{"role": "system", "content": "You answer briefly."}] if i % 3 == 0 else []
        chat += [{"role": "user", "content": f"Which functions does {module} define?"},
                 {"role": "assistant", "content": f"{module} defines {', '.join(names)}."}]
        if i % 4 == 1:
            chat += [{"role": "user", "content": f"How many did you name for {module}?"},
                     {"role": "assistant", "content": f"{len(names)}."}]
        out.append(chat)
    return out


def _write_chat_model(folder: Path, chats: list[list[dict]], report: ExamplesReport) -> None:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        report.skipped.append(Written(str(Path("models") / folder.name), "pip install 'accelrun[hf]' (tokenizers)"))
        return
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for chat in chats for m in chat]
    # show_progress=False: the library's bar writes blank lines to stdout, above this command's list of files.
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=CHAT_VOCAB, special_tokens=CHAT_SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    # What transformers' save_pretrained writes for such a tokenizer: AutoTokenizer loads the folder.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "model_max_length": CHAT_MODEL_SHAPE["max_seq_len"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_tiny_llama(folder, tok.get_vocab_size())
    report.written.append(Written(str(Path("models") / folder.name),
                                  "a tiny random Llama (config.json, model.safetensors) with a BPE tokenizer "
                                  "and a chat template with {% generation %} blocks"))


def _write_tiny_llama(folder: Path, vocab_size: int) -> None:
    from accelrun.config.schema import ModelConfig
    from accelrun.models.build import build_model
    from accelrun.models.families import get_family
    from accelrun.models.hf_io import export_hf

    cfg = ModelConfig(arch="llama", vocab_size=vocab_size, **CHAT_MODEL_SHAPE)
    spec = get_family(cfg.arch)
    model = build_model(cfg, "cpu", seed=0)
    export_hf(model.state_dict(), spec, spec.args_from_config(cfg), folder)
