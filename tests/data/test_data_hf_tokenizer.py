"""data.tokenizer = a tokenizer.json or a Hugging Face folder: the tokens are the tokenizers library's own,
token files record the tokenizer, and a vocabulary larger than the model's is an exit-2 error naming both
numbers and where each came from. Tokenizers are trained here on a few strings (nothing downloads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.config.errors import ConfigError
from accelrun.config.schema import DataConfig
from accelrun.config.tokenizer_file import read_tokenizer_info
from accelrun.data import DataError, get_tokenizer, load_stream, load_text, open_tokens, prepare_tokens
from tests.conftest import DEFAULT_CONFIG, TINY

tokenizers = pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")

DOCS = {
    "a.txt": "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "sub/b.txt": "the quick brown fox jumps over the lazy dog; caf\u00e9 \u00fcber na\u00efve\n" * 3,
    "sub/c.txt": "x = [i * i for i in range(10)]  # squares\n",
}


def _train_bpe(vocab_size: int = 300):
    """A byte-level BPE with a Llama-like post-processor (BOS before each text): its own specials must survive."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(DOCS.values()) * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _save_folder(tok, folder: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-tok")
    corpus = root / "corpus"
    for name, text in DOCS.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text)
    (corpus / "bad.bin").write_bytes(b"ok \xff\xfe end")  # not UTF-8: becomes U+FFFD, as documented
    tok = _train_bpe()
    tok.save(str(root / "tokenizer.json"))  # a bare file: no tokenizer_config.json, so no end-of-text
    (root / "bare").mkdir()
    tok.save(str(root / "bare" / "tokenizer.json"))
    return {"root": root, "corpus": corpus, "bare": root / "bare" / "tokenizer.json",
            "folder": _save_folder(tok, root / "hf-folder")}


def _doc_texts(corpus: Path) -> list[str]:
    paths = [corpus / "a.txt", corpus / "bad.bin", corpus / "sub" / "b.txt", corpus / "sub" / "c.txt"]
    return [p.read_bytes().decode("utf-8", errors="replace") for p in paths]


def test_text_source_ids_are_the_tokenizers_library_own(files):
    lib = tokenizers.Tokenizer.from_file(str(files["folder"] / "tokenizer.json"))
    eos = lib.token_to_id("</s>")
    texts = _doc_texts(files["corpus"])
    patterns = [str(files["corpus"] / "*"), str(files["corpus"] / "sub" / "*.txt")]

    folder_tok = get_tokenizer(str(files["folder"]))
    stream = load_text(patterns, max_bytes=None, tokenizer=folder_tok)
    expected = [i for t in texts for i in lib.encode(t).ids + [eos]]
    assert stream.tokens.tolist() == expected
    assert expected[0] == lib.token_to_id("<s>") and "\ufffd" in texts[1]  # its BOS kept; bad bytes replaced
    assert stream.tokens.dtype == torch.uint16 and stream.vocab_size == lib.get_vocab_size(with_added_tokens=True)
    assert stream.fingerprint["tokenizer"] == folder_tok.name == read_tokenizer_info(str(files["folder"])).name
    assert stream.fingerprint["tokens"] == len(expected) and stream.fingerprint["files"] == 4

    # A bare tokenizer.json names no end-of-text token: documents are joined as encoded.
    bare = load_text(patterns, max_bytes=None, tokenizer=get_tokenizer(str(files["bare"])))
    assert bare.tokens.tolist() == [i for t in texts for i in lib.encode(t).ids]
    assert bare.fingerprint["tokenizer"] != stream.fingerprint["tokenizer"]  # same file, other separator

    # Batches of documents give the same tokens as one batch.
    from accelrun.data.hf_documents import encode_files
    from accelrun.data.read_plan import plan_reads
    from accelrun.data.text import expand_paths

    plan = plan_reads(expand_paths(patterns), None)
    parts = list(encode_files(plan, folder_tok, batch_bytes=1))
    assert len(parts) == 4 and torch.cat([p for p, _ in parts]).tolist() == expected


def test_prepare_records_the_tokenizer_and_runs_need_the_same_one(files, tmp_path):
    out = tmp_path / "corpus.tok"
    runner = CliRunner()
    result = runner.invoke(cli, ["data", "prepare", str(files["corpus"] / "**" / "*.txt"), "-o", str(out),
                                 "--tokenizer", str(files["folder"])])
    assert result.exit_code == 0, result.output
    assert "between documents" in result.output and "</s>" in result.output
    header, tokens = open_tokens(out, verify=True)
    info = read_tokenizer_info(str(files["folder"]))
    assert header.tokenizer == info.name and header.vocab_size == info.vocab_size and header.token_bytes == 2
    text = load_text([str(files["corpus"] / "**" / "*.txt")], max_bytes=None,
                     tokenizer=get_tokenizer(str(files["folder"])))
    assert tokens.tolist() == text.tokens.tolist()

    # validate reads the headers (without torch): the same tokenizer, and ids the model's embedding covers
    from accelrun.config.tokenizer_file import TOKEN_FILE_MAGIC, token_file_tokenizer
    from accelrun.data import tokfile

    assert token_file_tokenizer(out) == (header.tokenizer, header.vocab_size) and TOKEN_FILE_MAGIC == tokfile.MAGIC
    tokens_source = ["data.source=tokens", f"data.paths=[{out}]", "train.seq_len=8", "train.global_batch=4"]
    shown = runner.invoke(cli, ["validate", str(DEFAULT_CONFIG), *tokens_source, f"data.tokenizer={files['folder']}"])
    assert shown.exit_code == 0 and (f"data: tokens ({out}); tokenizer {files['folder'] / 'tokenizer.json'}: "
                                     "300 ids, '</s>' (id 1) after each document") in shown.output, shown.output
    with pytest.raises(ConfigError, match=rf"{out} was prepared with tokenizer '{info.name}', but "
                                          r"data.tokenizer = byte \(.*stdlib.yaml:\d+\) is 'byte'"):
        load_config(DEFAULT_CONFIG, tokens_source)
    # a prepared folder (shards) is read as the loader reads it: validate had passed it (a trial's)
    folder, records = tmp_path / "prepared", tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"text": f"record {i} of some text"}) + "\n" for i in range(50)))
    done = runner.invoke(cli, ["data", "prepare", str(records), "-o", str(folder), "--tokenizer", str(files["folder"])])
    assert done.exit_code == 0 and (folder / "prepared.json").is_file(), done.output
    with pytest.raises(ConfigError, match=rf"{folder}/shard-\d+\.tok was prepared with tokenizer '{info.name}'"):
        load_config(DEFAULT_CONFIG, [*tokens_source[:1], f"data.paths=[{folder}]", *tokens_source[2:]])
    with pytest.raises(ConfigError, match=rf"{out} holds ids up to 299 .* but model.vocab_size = 200 \(override"):
        load_config(DEFAULT_CONFIG, [*tokens_source, f"data.tokenizer={files['folder']}", "model.vocab_size=200"])
    # fewer tokens than one step reads: exit 2 at validation, before a run folder exists
    n = header.n_tokens
    with pytest.raises(ConfigError, match=rf"{out} holds {n:,} tokens, but one step needs {4 * n + 1:,} "
                                          rf"\(4 sequences of train.seq_len {n}, \+ 1\)"):
        load_config(DEFAULT_CONFIG, [*tokens_source, f"data.tokenizer={files['folder']}", f"train.seq_len={n}",
                                     "train.global_batch=4", "model.max_seq_len=100000"])

    cfg = DataConfig(source="tokens", paths=[str(out)], tokenizer=str(files["folder"] / "tokenizer.json"))
    assert load_stream(cfg, vocab_size=320, seed=0).fingerprint["tokenizer"] == info.name
    for other in ("byte", str(files["bare"])):
        with pytest.raises(DataError, match=f"made by tokenizer '{info.name}'"):
            load_stream(DataConfig(source="tokens", paths=[str(out)], tokenizer=other), vocab_size=320, seed=0)


def test_prepare_writes_4_byte_tokens_for_a_vocabulary_past_65536(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w1 w65535 w65536 w69999 nope")
    summary = prepare_tokens([str(tmp_path / "doc.txt")], tmp_path / "big.tok", tokenizer=str(tmp_path))
    header, tokens = open_tokens(tmp_path / "big.tok", verify=True)
    assert summary["token_bytes"] == header.token_bytes == 4 and header.vocab_size == 70_000
    assert tokens.tolist() == [1, 65535, 65536, 69999, 0]
    # The text source encodes them as int32 and reads back its cached copy (4-byte tokens, memory-mapped),
    # the first run as the second.
    fresh, cached = (load_text([str(tmp_path / "doc.txt")], max_bytes=None, tokenizer=get_tokenizer(str(tmp_path)))
                     for _ in range(2))
    assert fresh.tokens.dtype == cached.tokens.dtype == torch.uint32
    assert fresh.read(0, 5).tolist() == cached.read(0, 5).tolist() == [1, 65535, 65536, 69999, 0]


def test_a_tokenizer_that_ends_with_its_eos_gets_no_second_one(tmp_path):
    from tokenizers import processors

    tok = _train_bpe()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    _save_folder(tok, tmp_path)
    docs = get_tokenizer(str(tmp_path)).encode_documents(["x = 1", ""])
    assert docs == [tok.encode("x = 1").ids, [1]] and docs[0][-1] == 1 and docs[0].count(1) == 1


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"extends: [{DEFAULT_CONFIG}]\n{body}")
    return path


def test_vocabulary_larger_than_the_model_is_exit_2_naming_both(files, tmp_path):
    folder = files["folder"]
    recipe = _recipe(tmp_path, f"data:\n  source: text\n  paths: ['{files['corpus']}/*.txt']\n"
                               f"  tokenizer: {folder}\nmodel:\n  vocab_size: 200\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    (msg,) = e.value.messages
    assert f"{folder / 'tokenizer.json'} has 300 token ids" in msg
    assert f"but model.vocab_size = 200 ({recipe}:7)" in msg and "at least 300" in msg

    runs = tmp_path / "runs"
    result = CliRunner().invoke(cli, ["train", str(recipe), f"report.runs_dir={runs}"])
    assert result.exit_code == 2 and "300 token ids" in result.output and not runs.exists()


def test_model_hf_folder_tokenizer_too_large_names_config_json(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tests.models.hf_helpers import save_tiny_hf

    save_tiny_hf(tmp_path / "model")  # vocab_size 320
    with pytest.raises(ConfigError, match="has no tokenizer.json .*data.tokenizer=byte trains on byte-level"):
        load_config(DEFAULT_CONFIG, [f"model.hf={tmp_path / 'model'}", "data.tokenizer=hf", "train.seq_len=32"])
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(400)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [f"model.hf={tmp_path / 'model'}", "data.tokenizer=hf", "train.seq_len=32"])
    (msg,) = e.value.messages
    config_json = tmp_path / "model" / "config.json"
    line = next(n for n, text in enumerate(config_json.read_text().splitlines(), 1) if '"vocab_size"' in text)
    assert "has 400 token ids" in msg and f"model.vocab_size = 320 ({config_json}:{line} (vocab_size))" in msg
    assert "tokenizer.json and config.json disagree" in msg


def _bad_tokenizers(root: Path) -> dict[str, tuple[Path, str]]:
    (root / "empty-folder").mkdir()
    (root / "broken.json").write_text('{"model": ')
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        "missing": (root / "nope.json", "no such file or folder"),
        "folder without tokenizer.json": (root / "empty-folder", "has no tokenizer.json"),
        "unreadable JSON": (root / "broken.json", "is not readable JSON"),
        "not a tokenizer": (root / "config.json", "is not a tokenizer.json"),
    }


def test_bad_tokenizer_paths_are_one_line_exit_2(tmp_path):
    runner = CliRunner()
    (tmp_path / "doc.txt").write_text("hello")
    for what, (path, says) in _bad_tokenizers(tmp_path).items():
        out = tmp_path / f"{what}.tok"
        result = runner.invoke(cli, ["data", "prepare", str(tmp_path / "doc.txt"), "-o", str(out),
                                     "--tokenizer", str(path)])
        assert result.exit_code == 2 and says in result.output and str(path) in result.output, (what, result.output)
        assert result.output.strip().startswith("error: --tokenizer"), result.output  # the option typed
        assert len(result.output.strip().splitlines()) == 1 and not out.exists(), what
        with pytest.raises(ConfigError, match=says):
            load_config(DEFAULT_CONFIG, [f"data.tokenizer={path}"])
    with pytest.raises(ConfigError, match=r"data.tokenizer = hf \(override 'data.tokenizer=hf'\): hf means the "
                                          "model.hf folder's tokenizer, but model.hf is not set"):
        load_config(DEFAULT_CONFIG, ["data.tokenizer=hf"])
    with pytest.raises(ConfigError, match="did you mean 'byte'"):
        load_config(DEFAULT_CONFIG, ["data.tokenizer=bytes"])


def test_vocabulary_size_read_from_json_equals_the_librarys_for_each_model_kind(tmp_path):
    """Validation reads tokenizer.json without the library: its size (largest id + 1, added tokens
    included) must be the library's own for every model kind (Unigram's vocabulary is a list)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    kinds = {
        "bpe": (models.BPE(unk_token="[UNK]"), trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])),
        "wordpiece": (models.WordPiece(unk_token="[UNK]"),
                      trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]"])),
        "wordlevel": (models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer(special_tokens=["[UNK]"])),
        "unigram": (models.Unigram(), trainers.UnigramTrainer(vocab_size=60, special_tokens=["[UNK]"],
                                                               unk_token="[UNK]")),
    }
    for kind, (model, trainer) in kinds.items():
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(list(DOCS.values()) * 3, trainer)
        tok.add_special_tokens([AddedToken("<|extra|>", special=True)])  # an added id past the model's
        path = tmp_path / f"{kind}.json"
        tok.save(str(path))
        assert read_tokenizer_info(str(path)).vocab_size == tok.get_vocab_size(with_added_tokens=True), kind
        assert tok.token_to_id("<|extra|>") == tok.get_vocab_size(with_added_tokens=True) - 1, kind


def test_no_eos_warns_and_a_missing_tokenizers_package_says_what_to_install(files, monkeypatch):
    warnings = load_config(DEFAULT_CONFIG, [f"data.tokenizer={files['bare']}"]).warnings
    assert any("names no end-of-text token" in w and str(files["bare"]) in w for w in warnings)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails, find_spec finds nothing
    with pytest.raises(ConfigError, match=r"pip install 'accelrun\[hf\]'"):
        load_config(DEFAULT_CONFIG, [f"data.tokenizer={files['folder']}", "model.vocab_size=320"])
    with pytest.raises(DataError, match=r"pip install 'accelrun\[hf\]'"):
        get_tokenizer(str(files["folder"]))


def test_train_on_text_with_the_model_hf_folders_tokenizer(files, tmp_path):
    """A transformers checkpoint and its tokenizer in one folder (data.tokenizer = hf), 2 steps on text."""
    from accelrun.report.metrics import read_metrics
    from accelrun.train.entry import train
    from tests.models.hf_helpers import save_tiny_hf

    model = tmp_path / "model"
    save_tiny_hf(model)  # vocab_size 320 >= the tokenizer's 300
    _save_folder(_train_bpe(), model)
    resolved = load_config(DEFAULT_CONFIG, [*TINY, "train.steps=2", f"report.runs_dir={tmp_path / 'runs'}",
                                            f"model.hf={model}", "data.tokenizer=hf", "data.source=text",
                                            f"data.paths=[{files['corpus']}/**/*.txt]", "train.seq_len=16",
                                            "eval.every=0", "checkpoint.hf_on_finish=true"])
    assert resolved.config.data.tokenizer == str(model.resolve())  # hf: the folder, stored absolute
    result = train(resolved, command="test")
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["status"] == "finished", report.get("error")
    info = read_tokenizer_info(str(model))
    lib = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = [(files["corpus"] / n).read_text() for n in sorted(DOCS)]
    stream = load_stream(resolved.config.data, vocab_size=320, seed=0)
    assert report["data"] == stream.fingerprint["sha256"]  # the run read this stream:
    assert stream.fingerprint["tokenizer"] == info.name  # the folder's tokenizer's tokens, EOS after each file
    assert stream.fingerprint["tokens"] == sum(len(lib.encode(t).ids) + 1 for t in texts)
    losses = [m["loss"] for m in read_metrics(result.run_dir / "metrics.jsonl")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # The export at the end is a whole transformers folder: the weights and the tokenizer they were trained with.
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(result.run_dir / "hf")
    assert exported("def add(").input_ids == lib.encode("def add(").ids and exported.eos_token == "</s>"

    # generate samples in the run's own tokens: the prompt round-trips through the folder's tokenizer ...
    runner = CliRunner()
    args = ["generate", str(result.run_dir), "--prompt", "def add(", "--max-new-tokens", "5", "--seed", "1"]
    sample = runner.invoke(cli, args)
    assert sample.exit_code == 0 and sample.stdout.startswith("def add("), sample.output  # stderr: run, step
    # ... and without that tokenizer it stops, naming the file, rather than falling back to bytes.
    (model / "tokenizer.json").rename(model / "moved.json")
    gone = runner.invoke(cli, args)
    assert gone.exit_code == 2 and f"{model.resolve()} has no tokenizer.json" in gone.output
    export = runner.invoke(cli, ["export", str(result.run_dir), "--hf", str(tmp_path / "out")])
    assert export.exit_code == 2 and "has no tokenizer.json" in export.output and not (tmp_path / "out").exists()


def test_encoded_text_is_cached_once_per_tokenizer_and_file_version(files, tmp_path, monkeypatch):
    """Ranks starting together encode once (the others wait on the lock and map the file); an edited
    file is encoded again."""
    import threading

    from accelrun.data.encoded_cache import cache_root
    from accelrun.data.hf_tokenizer import HFTokenizer

    corpus = tmp_path / "c"
    corpus.mkdir()
    for name in ("a.txt", "c.txt"):
        (corpus / name).write_text(DOCS[name if name == "a.txt" else "sub/c.txt"])
    tok = get_tokenizer(str(files["folder"]))
    calls = []
    real = HFTokenizer.encode_documents

    def counted(self, texts):
        calls.append(len(texts))
        return real(self, texts)

    monkeypatch.setattr(HFTokenizer, "encode_documents", counted)
    streams = [None, None]

    def rank(i: int) -> None:
        streams[i] = load_text([str(corpus / "*.txt")], max_bytes=None, tokenizer=tok)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [2]  # one encoding of the two files, whichever thread got the lock first
    a, b = streams
    assert a.tokens.tolist() == b.tokens.tolist() and a.fingerprint == b.fingerprint
    assert len(list(cache_root().glob("*.tok"))) == 1

    (corpus / "c.txt").write_text(DOCS["sub/c.txt"] + "y = 2\n")
    edited = load_text([str(corpus / "*.txt")], max_bytes=None, tokenizer=tok)
    assert calls == [2, 2] and edited.fingerprint["sha256"] != a.fingerprint["sha256"]
    lib = tokenizers.Tokenizer.from_file(str(files["folder"] / "tokenizer.json"))
    eos = lib.token_to_id("</s>")
    texts = [(corpus / n).read_text() for n in ("a.txt", "c.txt")]
    assert edited.tokens.tolist() == [i for t in texts for i in lib.encode(t).ids + [eos]]

    (tmp_path / "not-a-folder").write_text("")  # a cache that cannot be written costs only the time
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "not-a-folder"))
    uncached = load_text([str(corpus / "*.txt")], max_bytes=None, tokenizer=tok)
    assert calls == [2, 2, 2] and uncached.fingerprint == edited.fingerprint
