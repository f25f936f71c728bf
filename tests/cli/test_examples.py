"""Every ``accelrun ...`` example in README.md and in each command's ``--help`` works as written.

An example runs through the real command line (click parsing, recipe loading and validation). Cheap
commands run whole; for the ones that would train or measure (train, ab, compile explain, compare,
plan --calibrate), the function that does the work is replaced by one that stops the command once
it is reached, so everything a user could get wrong before that point is checked. An example meant
to fail says so (``# exit 2: ...``, or a README transcript whose next line is ``error: ...``) and
must fail that way.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from tests.conftest import REPO

REDIRECTS = {"|", ">", ">>", "2>", "&&", ";"}


@dataclass(frozen=True)
class Example:
    where: str  # README.md:LINE or "accelrun CMD --help"
    text: str
    comment: str
    expected_error: str | None = None  # the README's transcript line after a `$ accelrun ...`

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.text)
        for i, w in enumerate(words):
            if w in REDIRECTS:
                words = words[:i]
                break
        return words

    @property
    def env(self) -> dict[str, str]:
        env = {}
        for w in self.argv:
            if w == "accelrun":
                break
            key, _, value = w.partition("=")
            env[key] = value
        return env

    @property
    def args(self) -> list[str]:
        argv = self.argv
        return argv[argv.index("accelrun") + 1:]

    @property
    def expected_exit(self) -> int:
        m = re.search(r"\bexit (\d+)", self.comment)
        return int(m.group(1)) if m else (2 if self.expected_error else 0)


def _split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing ``# comment`` (a # inside quotes is part of the command)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _examples_in(lines: list[str], where: str, first_line: int = 1) -> list[Example]:
    found: list[Example] = []
    i = 0
    while i < len(lines):
        raw = lines[i].strip()
        start = i
        transcript = raw.startswith("$ ")
        raw = raw[2:] if transcript else raw
        words = raw.split()
        is_example = any(w == "accelrun" for w in words[:1]) or (
            words and re.fullmatch(r"[A-Z_]+=\S+", words[0]) and "accelrun" in words[1:2])
        if not is_example:
            i += 1
            continue
        command, comment = _split_comment(raw)
        while command.endswith("\\") and i + 1 < len(lines):  # continuation lines
            i += 1
            more, more_comment = _split_comment(lines[i].strip())
            command = command[:-1].rstrip() + " " + more
            comment = comment or more_comment
        expected = None
        if transcript and i + 1 < len(lines) and lines[i + 1].strip().startswith("error:"):
            expected = lines[i + 1].strip()
        found.append(Example(f"{where}:{first_line + start}", command, comment, expected))
        i += 1
    return found


def readme_examples() -> list[Example]:
    lines = (REPO / "README.md").read_text().splitlines()
    examples, block, start = [], None, 0
    for n, line in enumerate(lines):
        if line.startswith("```"):
            if block is None:
                block, start = [], n + 2
            else:
                examples += _examples_in(block, "README.md", start)
                block = None
        elif block is not None:
            block.append(line)
    return examples


def _commands(group: click.Group, prefix: str):
    for name, cmd in sorted(group.commands.items()):
        yield f"{prefix} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")


def help_examples() -> list[Example]:
    examples = _examples_in((cli.help or "").splitlines(), "accelrun --help")
    for path, cmd in _commands(cli, "accelrun"):
        examples += _examples_in((cmd.help or "").splitlines(), f"{path} --help")
    return examples


ALL = readme_examples() + help_examples()


class Reached(Exception):
    """The command got as far as the work itself: everything before it was valid."""


def _stop(*args, **kwargs):
    raise Reached()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project folder: the repo's configs/ and examples/, a small text corpus, and the heavy work stubbed."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "examples", tmp_path / "examples")  # the README's own model (model.custom)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    monkeypatch.chdir(tmp_path)
    import accelrun.cli.ab_cmd as ab_cmd
    import accelrun.cli.compare_cmd as compare_cmd
    import accelrun.cli.plan_cmd as plan_cmd
    import accelrun.train.entry as train_entry
    import accelrun.train.explain_step as explain_step
    import accelrun.train.generate as generate

    monkeypatch.setattr(train_entry, "train", _stop)
    monkeypatch.setattr(ab_cmd, "run_ab", _stop)
    monkeypatch.setattr(explain_step, "explain_step", _stop)
    monkeypatch.setattr(compare_cmd, "load_run", _stop)
    monkeypatch.setattr(plan_cmd, "_calibrate", _stop)
    monkeypatch.setattr(generate, "generate_text", _stop)  # needs a trained run's checkpoint
    return tmp_path


def test_examples_were_found():
    """The extraction itself: the README's headline examples and every command's help are seen."""
    texts = [e.text for e in ALL]
    assert "accelrun train configs/llama.yaml parallel.nproc_per_node=2" in texts
    assert any(e.where.startswith("accelrun slurm --help") for e in ALL)
    assert any("--rdzv-endpoint node0:29500" in t for t in texts)  # a continuation line was joined
    assert len(ALL) > 60


def _save_example_tokenizer(folder: Path) -> None:
    """The README's models/my-tokenizer: a byte-level BPE trained on the example corpus, saved as
    transformers saves one (tokenizer.json + tokenizer_config.json naming its EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([Path("corpus/a.txt").read_text()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


EXAMPLE_INPUTS = ("corpus/docs.", "corpus/saved", "corpus/*.parquet", "data.paths=[data/corpus]",
                  "models/my-chat-model", "chats.jsonl")


@pytest.fixture(scope="module")
def example_inputs(tmp_path_factory) -> Path:
    """What the README's own `accelrun data examples` line writes (corpus/docs.*, corpus/saved, corpus/a.txt,
    chats.jsonl, models/my-chat-model), run once through the command line as a user would."""
    (line,) = [e for e in readme_examples() if e.args[:2] == ["data", "examples"]]
    root = tmp_path_factory.mktemp("example-inputs")
    r = CliRunner().invoke(cli, [*line.args, "-C", str(root)])
    assert r.exit_code == 0 and "skipped" not in r.output, f"{line.where}: {line.text}\n{r.output}"
    return root


def _uses_example_inputs(example: Example) -> bool:
    return any(name in a for a in example.args for name in EXAMPLE_INPUTS)


@pytest.mark.parametrize("example", ALL, ids=[f"{e.where}" for e in ALL])
def test_example_runs_as_written(example: Example, workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                 request: pytest.FixtureRequest):
    tokenizer = [a.partition("=")[2] or a for a in example.args if "models/my-tokenizer" in a]
    if tokenizer:
        _save_example_tokenizer(Path(tokenizer[0]))
    if _uses_example_inputs(example):  # as the README's `accelrun data examples` line wrote them
        shutil.copytree(request.getfixturevalue("example_inputs"), workdir, dirs_exist_ok=True)
    if "data.paths=[data/corpus]" in example.args:  # the folder the README's data prepare line writes
        assert CliRunner().invoke(cli, ["data", "prepare", "corpus/*.parquet", "-o", "data/corpus"]).exit_code == 0
    if example.args[:2] == ["train", "configs/llama.yaml"] and "data.source=tokens" in example.args:
        prepare = ["data", "prepare", "corpus/*.txt", "-o", "data/corpus.tok"]
        assert CliRunner().invoke(cli, prepare + [f"--tokenizer={t}" for t in tokenizer]).exit_code == 0
    if example.args[:2] == ["data", "examples"]:  # run where no file of its names is the user's own (the
        (workdir / "corpus" / "a.txt").unlink()     # stub corpus is: the command refuses to replace it)
    for key, value in example.env.items():
        Path(value.replace("~", str(workdir))).expanduser().mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(key, value.replace("~", str(workdir)))
    result = CliRunner().invoke(cli, example.args)
    reached = isinstance(result.exception, Reached)
    code = 0 if reached else result.exit_code
    detail = f"{example.where}: {example.text}\nexit {code}\n{result.output}"
    if result.exception is not None and not reached and not isinstance(result.exception, SystemExit):
        raise AssertionError(detail) from result.exception
    assert code == example.expected_exit, detail
    if example.expected_error:
        shown = example.expected_error.split("...")[0]
        assert shown in " ".join(result.output.split()), detail


def _section_examples(heading: str) -> list[Example]:
    """The README examples under ``heading`` (a ``## `` line), up to the next such heading."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [e for e in readme_examples() if start < int(e.where.rsplit(":", 1)[1]) <= end]


YOUR_DATA = _section_examples("## Your data")
# What makes a README training line a short one here, appended after the line's own keys (the last wins).
SHORT_RUN = ["train.steps=2", "report.progress=none"]


def _trains(example: Example) -> bool:
    return example.args[:1] == ["train"] and example.expected_exit == 0


@pytest.fixture(scope="module")
def one_machines_cache(tmp_path_factory) -> Path:
    """One cache folder for the lines below, as on a user's machine that runs them one after another: the
    first compiles, the next load its graphs from the graph cache."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("example", [e for e in YOUR_DATA if _trains(e) and "configs/hf-chat.yaml" not in e.args],
                         ids=lambda e: e.where)
def test_your_data_lines_train_for_real(example: Example, example_inputs: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, one_machines_cache: Path):
    """"Your data" for real: each training line reads its data (not stopped at the work, as above) and trains."""
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(one_machines_cache))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(example_inputs, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    if "data.paths=[data/corpus]" in example.args:  # the folder the README's data prepare line writes
        (prepare,) = [e for e in YOUR_DATA if e.args[:2] == ["data", "prepare"]]
        assert CliRunner().invoke(cli, prepare.args).exit_code == 0
    r = CliRunner().invoke(cli, [*example.args, *SHORT_RUN])
    assert r.exit_code == 0, f"{example.where}: {example.text}\n{r.output}"
    (run,) = (tmp_path / "runs").glob("*/*/report.json")
    report = json.loads(run.read_text())
    assert report["status"] == "finished" and report["steps"] == 2, report["status"]
    # compiled by accelrun, or its graphs loaded from the graph cache an earlier line filled
    assert report["compiler"]["dynamo"]["frames_compiled"] > 0, report["compiler"]


def test_your_data_chat_fine_tuning_end_to_end(example_inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               one_machines_cache: Path):
    """The README's chat fine-tuning lines in order, as a user runs them: train (compiled, document packing,
    the assistant's tokens in the loss), export, then transformers loads the export and its chat template."""
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(one_machines_cache))
    transformers = pytest.importorskip("transformers")
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(example_inputs, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    (train,) = [e for e in YOUR_DATA if "configs/hf-chat.yaml" in e.args]
    (export,) = [e for e in YOUR_DATA if e.args[:1] == ["export"]]
    r = CliRunner().invoke(cli, [*train.args, *SHORT_RUN])
    assert r.exit_code == 0, f"{train.where}: {train.text}\n{r.output}"
    r = CliRunner().invoke(cli, export.args)  # exit 0 now that the run exists
    assert r.exit_code == 0, f"{export.where}: {export.text}\n{r.output}"
    (report,) = (tmp_path / "runs" / "hf-chat").glob("*/report.json")
    report = json.loads(report.read_text())
    assert report["compiler"]["dynamo"]["frames_compiled"] > 0, report["compiler"]
    assert 0 < report["loss_tokens_per_step"] < report["tokens_per_step"]  # the assistant's tokens only
    out = Path(export.args[export.args.index("--hf") + 1])
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert model(ids).logits.shape[:2] == ids.shape
