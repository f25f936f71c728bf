"""data.mix: each source's share of the tokens within 1% of its weight over 1,000 windows, the same
batches for the same seed, and a resumed iterator (any dp_size) reads what an uninterrupted one reads."""

from __future__ import annotations

import json

import pytest
import torch

from accelrun.config import load_config
from accelrun.config.schema import DataConfig, MixSource
from accelrun.data.build import build_data
from accelrun.data.mix import MixedBatchIterator
from accelrun.data.stream import TensorStream
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG

T = 16


def source(token: int, n_tokens: int) -> TensorStream:
    """A stream whose every token is ``token`` except a running counter in the odd positions, so a batch
    says which source and which window each row came from."""
    tokens = torch.full((n_tokens,), token, dtype=torch.int64)
    tokens[1::2] = torch.arange(n_tokens // 2) % 97 + 10
    return TensorStream([tokens], vocab_size=128, fingerprint={"source": "test", "sha256": f"s{token}"})


def sources() -> list[TensorStream]:
    # Different lengths: the small one runs out and starts a new pass many times.
    return [source(1, 40_000), source(2, 9_000), source(3, 700)]


def share_of_tokens(batches) -> torch.Tensor:
    counts = torch.zeros(4)
    for b in batches:
        counts += torch.bincount(b.inputs[:, 0], minlength=4)[:4].float() * T  # each row is one source's window
    return counts[1:] / counts.sum()


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.9, 0.07, 0.03], [1.0, 1.0, 1.0]])
@pytest.mark.parametrize("seed", [0, 7])
def test_each_share_within_one_percent_over_1000_windows(weights, seed):
    it = MixedBatchIterator(sources(), weights, seq_len=T, micro_batch=8, seed=seed)
    batches = [next(it) for _ in range(125)]  # 1,000 windows
    expected = torch.tensor(weights) / sum(weights)
    assert (share_of_tokens(batches) - expected).abs().max() < 0.01
    # and at every step on the way, not only at the end
    assert (share_of_tokens(batches[:13]) - expected).abs().max() < 0.03


def test_same_seed_same_batches_other_seed_other_order():
    def run(seed):
        it = MixedBatchIterator(sources(), [0.5, 0.3, 0.2], seq_len=T, micro_batch=4, seed=seed)
        return torch.cat([next(it).inputs for _ in range(30)])

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


@pytest.mark.parametrize("resume_dp_size", [1, 2])
def test_resume_mid_pass_reads_what_an_uninterrupted_run_reads(resume_dp_size):
    weights = [0.5, 0.3, 0.2]
    whole = MixedBatchIterator(sources(), weights, seq_len=T, micro_batch=4, seed=1)
    seen = [next(whole) for _ in range(40)]  # past the small source's end (43 windows), mid-pass elsewhere

    first = MixedBatchIterator(sources(), weights, seq_len=T, micro_batch=4, seed=1)
    for _ in range(17):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # plain values: survives a checkpoint as is
    # Resumed on resume_dp_size ranks of micro_batch 4 // resume_dp_size: the ranks' rows, in rank
    # order, are the rows one rank of micro_batch 4 read.
    ranks = []
    for r in range(resume_dp_size):
        it = MixedBatchIterator(sources(), weights, seq_len=T, micro_batch=4 // resume_dp_size, seed=99,
                                dp_rank=r, dp_size=resume_dp_size)
        it.load_state_dict(state)  # the saved seed wins: the order belongs to the run being resumed
        ranks.append(it)
    for step in range(17, 40):
        rows = torch.cat([next(it).inputs for it in ranks])
        assert torch.equal(rows, seen[step].inputs), step


def test_state_from_other_sources_or_weights_is_refused():
    it = MixedBatchIterator(sources(), [0.5, 0.5, 0.0001], seq_len=T, micro_batch=2, seed=0)
    state = it.state_dict()
    other = MixedBatchIterator(sources()[:2] + [source(4, 700)], [0.5, 0.5, 0.0001], seq_len=T, micro_batch=2, seed=0)
    with pytest.raises(ValueError, match="other data.mix sources"):
        other.load_state_dict(state)
    reweighted = MixedBatchIterator(sources(), [0.6, 0.4, 0.0001], seq_len=T, micro_batch=2, seed=0)
    with pytest.raises(ValueError, match="weights"):
        reweighted.load_state_dict(state)


def test_build_data_reads_each_entry_with_the_shared_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 5000)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": "b" * 90}) + "\n" for _ in range(60)))
    cfg = DataConfig(mix=[MixSource(source="text", paths=[str(tmp_path / "a.txt")], weight=3),
                          MixSource(paths=[str(tmp_path / "b.jsonl")], text_field="body", weight=1)])
    it = build_data(cfg, seq_len=T, micro_batch=8, seed=0, vocab_size=320)
    rows = torch.cat([next(it).inputs for _ in range(50)])
    first_byte = rows[:, 0]
    from_a = ((first_byte == ord("a")) | ((rows == ord("a")).sum(1) > T // 2)).float().mean()
    assert abs(float(from_a) - 0.75) < 0.01


def test_train_on_a_mix_resumes_with_identical_losses(tmp_path, tiny):
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": f"web page {i} " * 20}) + "\n" for i in range(40)))
    (tmp_path / "code.txt").write_text("def f(x):\n    return x * 2\n" * 300)
    mix = (f"data.mix=[{{paths: [{tmp_path / 'web.jsonl'}], weight: 0.7}}, "
           f"{{source: text, paths: [{tmp_path / 'code.txt'}], weight: 0.3}}]")

    def run(name: str, **kw):
        return train(load_config(DEFAULT_CONFIG, tiny(6, mix, "checkpoint.every=3", f"name={name}")), command="test", **kw)

    def losses(result) -> list[float]:
        return [m["loss"] for m in read_metrics(result.run_dir / "metrics.jsonl")]

    full = run("ref")
    cut = run("cut", stop_after_step=4)  # "killed" after step 4; the last checkpoint is step 3's
    resumed = run("cut")
    assert resumed.report["first_step"] == 4
    assert losses(resumed) == losses(full)[3:]  # fp32 on the CPU: bit-identical
    assert losses(cut) == losses(full)[:4]


def test_validate_warns_of_data_keys_a_mix_replaces(tmp_path):
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), f"data.mix=[{{paths: [{tmp_path / 'a.jsonl'}], weight: 1}}]",
                                 "data.text_field=body"])
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.output.splitlines() if line.startswith("warning: data.")]
    assert warnings == ["warning: data.text_field (override 'data.text_field=body') has no effect with data.mix: "
                        "each entry names its own source, paths and text_field"], r.output


def test_validate_is_silent_about_keys_a_shared_recipe_set_that_the_users_source_made_moot(tmp_path):
    """configs/llama.yaml extends recipes/data/stdlib.yaml, which sets data.builtin; a user who switches to
    data.source=documents (or compile.backend=eager) did not set the keys that become moot, so no warning.
    The same key set by the user still warns."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    documents = [str(DEFAULT_CONFIG), "data.source=documents", f"data.paths=[{tmp_path / 'a.jsonl'}]"]
    for args in (documents, [str(DEFAULT_CONFIG), "compile.backend=eager"]):
        r = CliRunner().invoke(cli, ["validate", *args])
        assert r.exit_code == 0 and r.output.startswith("valid:"), r.output
        assert "warning:" not in r.output, r.output
    r = CliRunner().invoke(cli, ["validate", *documents, "data.builtin=python-stdlib"])
    assert "warning: data.builtin (override 'data.builtin=python-stdlib') has no effect with data.source = documents" \
        in r.output, r.output


def test_validating_a_runs_own_resolved_config_warns_of_nothing(tmp_path):
    """A new user's `accelrun validate runs/.../config.yaml` warned that five keys accelrun wrote there
    itself (data.text_field, data.format, ... at their defaults) have no effect; a file's key at the
    schema's default is not the user's doing. One set to another value still warns."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    shown = CliRunner().invoke(cli, ["config", "show", str(DEFAULT_CONFIG)])
    assert shown.exit_code == 0, shown.output
    resolved = tmp_path / "config.yaml"
    resolved.write_text(shown.stdout)
    r = CliRunner().invoke(cli, ["validate", str(resolved)])
    assert r.exit_code == 0 and "warning:" not in r.output, r.output
    resolved.write_text(shown.stdout.replace("text_field: text", "text_field: body"))
    r = CliRunner().invoke(cli, ["validate", str(resolved)])
    assert "data.text_field" in r.output and "has no effect with data.source = builtin" in r.output, r.output


def test_weights_that_do_not_sum_to_1_are_normalised_and_the_run_says_so(tmp_path):
    """0.7 and 0.2 train on 78% and 22% of the tokens: validate's data line shows each source's share. Relative
    weights are not a warning (the README's own are 7 and 3: a trial read them printed as one)."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.txt").write_text("b")
    mix = "data.mix=[{{paths: [{a}], weight: 0.7}}, {{source: text, paths: [{b}], weight: {w}}}]"
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix.format(a=tmp_path / "a.jsonl",
                                                                            b=tmp_path / "b.txt", w=0.2)])
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "warning" not in said, r.output
    assert f"data: mix of 2 sources: {tmp_path / 'a.jsonl'} 78% (weight 0.7), {tmp_path / 'b.txt'} 22% (weight 0.2)" \
        in said, r.output
    assert MixedBatchIterator([source(1, 4000), source(2, 4000)], [0.7, 0.2], seq_len=T, micro_batch=1,
                              seed=0).weights == pytest.approx([7 / 9, 2 / 9])
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix.format(a=tmp_path / "a.jsonl",
                                                                            b=tmp_path / "b.txt", w=0.3)])
    assert r.exit_code == 0 and "normalised" not in r.output and "70% (weight 0.7)" in r.output, r.output


def test_report_md_has_a_data_row():
    """report.md's Configuration table says what the run read: source, paths, format, packing, mix shares."""
    from accelrun.config.data_checks import data_description
    from accelrun.report.markdown import render_report_md

    documents = DataConfig(source="documents", paths=["corpus/docs.jsonl"], packing="document")
    assert data_description(documents) == "documents: corpus/docs.jsonl; data.format text; packing document"
    assert data_description(DataConfig()) == "builtin (python-stdlib); packing concat"
    mix = DataConfig(mix=[MixSource(paths=["a.jsonl"], weight=0.7), MixSource(source="text", paths=["b.txt"],
                                                                              weight=0.2)])
    assert data_description(mix) == "mix of 2 sources: a.jsonl 78% (weight 0.7), b.txt 22% (weight 0.2); packing concat"
    md = render_report_md({"steps": 1}, {"name": "x", "data": data_description(documents)})
    assert "| data | documents: corpus/docs.jsonl; data.format text; packing document |" in md


def test_data_max_bytes_cuts_a_mixs_text_entry_and_says_so(tmp_path):
    """A trial's 70 MB text entry was cut at the 64 MiB default without a word, and data.max_bytes=null
    (which then read it whole) was said to have "no effect with data.mix"."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "big.txt").write_text("x" * 5000)
    mix = f"data.mix=[{{paths: [{tmp_path / 'a.jsonl'}], weight: 1}}, {{source: text, paths: [{tmp_path / 'big.txt'}], weight: 1}}]"
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix, "data.max_bytes=4096"])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and "reads 4,096 of the 5,000 bytes that data.mix.1.paths names" in said, r.output
    assert "has no effect with data.mix" not in said, r.output
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix, "data.max_bytes=null"])
    assert "has no effect" not in r.output and "data.mix.1.paths names" not in r.output, r.output


def test_validate_refuses_a_mixs_text_entry_whose_glob_matches_nothing(tmp_path):
    """validate said valid (a documents entry's was caught); train refused it after making its run folder,
    naming data.paths instead of the entry (a trial's)."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    mix = f"data.mix=[{{paths: [{tmp_path / 'a.jsonl'}], weight: 1}}, {{source: text, paths: [{tmp_path}/none/*.txt], weight: 1}}]"
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix])
    assert r.exit_code == 2 and "data.mix.1.paths: " in r.output and "matched no files" in r.output, r.output


def test_chat_keys_on_text_records_are_warned(tmp_path):
    """A trial's data.loss_on=all and data.messages_field with data.format = text passed without a word."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), "data.source=documents",
                                 f"data.paths=[{tmp_path / 'a.jsonl'}]", "data.loss_on=all", "data.messages_field=msgs"])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and "data.loss_on (override 'data.loss_on=all') has no effect with data.format = text" \
        in said and "data.messages_field (override" in said, r.output
