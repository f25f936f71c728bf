"""eval.every: validation loss on the held-out tail, equal to an independent eager computation."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from rich.console import Console

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.data.build import load_stream
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from accelrun.train.generate import load_run_model
from tests.conftest import DEFAULT_CONFIG


def test_val_loss_matches_eager_on_heldout_windows(tiny):
    overrides = tiny(6, "eval.every=3", "eval.steps=3", "eval.split=0.1", "checkpoint.every=6", "report.progress=lines")
    resolved = load_config(DEFAULT_CONFIG, overrides)
    out = io.StringIO()
    result = train(resolved, command="test", console=Console(file=out, width=300))
    assert result.status == "finished"
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    # on the console too (a new user found it in metrics.jsonl and the report only)
    assert f"eval loss {rows[2]['val_loss']:8.4f} (held out)" in out.getvalue(), out.getvalue()
    assert f"; eval loss {rows[-1]['val_loss']:.3f} (held out);" in out.getvalue()
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["final_val_loss"] == rows[-1]["val_loss"]
    val_text = f"{report['final_val_loss']:.4g}"
    md = (result.run_dir / "report.md").read_text()
    assert "validation loss (held-out data, eval.every)" in md and val_text in md
    html = (result.run_dir / "report.html").read_text()
    assert "validation loss" in html
    if "<svg" in html:  # matplotlib installed: the loss plot has the validation series
        assert ">validation<" in html

    # compare: a column for it (n/a for a run without evaluation).
    other = train(load_config(DEFAULT_CONFIG, tiny(2, "name=noeval", "checkpoint.enabled=false")), command="test")
    r = CliRunner().invoke(cli, ["compare", str(result.run_dir), str(other.run_dir), "--json"])
    assert r.exit_code == 0, r.output
    got = [row["final_val_loss"] for row in json.loads(r.output)["rows"]]
    assert got == [report["final_val_loss"], None]
    r = CliRunner().invoke(cli, ["compare", str(result.run_dir), str(other.run_dir)])
    assert r.exit_code == 0 and "final val loss" in r.output and val_text in r.output, r.output

    # Independently: the stream's last round(n * 0.1) windows, the first 3 micro-batches of them, in
    # fp32 eager with the weights of the step-6 checkpoint (saved after the same optimizer step).
    cfg = resolved.config
    stream = load_stream(cfg.data, vocab_size=cfg.model.vocab_size, seed=cfg.train.seed)
    T, B = cfg.train.seq_len, cfg.train.micro_batch
    n = (len(stream) - 1) // T
    first = n - round(n * 0.1)
    model = load_run_model(result.run_dir)
    losses = []
    with torch.no_grad():
        for j in range(3):
            w = torch.stack([stream.read(i * T, i * T + T + 1) for i in range(first + j * B, first + j * B + B)])
            logits = model(w[:, :-1])
            losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)))
    expected = float(torch.stack(losses).mean())
    assert rows[-1]["val_loss"] == pytest.approx(expected, abs=1e-5, rel=1e-5)


def test_training_never_reads_the_heldout_windows(tiny):
    cfg = load_config(DEFAULT_CONFIG, tiny(2, "eval.every=1", "eval.split=0.2")).config
    from accelrun.data.build import build_data, build_eval_data

    kw = dict(seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch, seed=0, vocab_size=cfg.model.vocab_size)
    train_it = build_data(cfg.data, eval_cfg=cfg.eval, **kw)
    held = build_eval_data(cfg.data, cfg.eval, **kw)
    assert train_it.n_windows == held.first  # windows [0, first) train, [first, n) are held out
    # Its last target is the first held-out window's first input token; no held-out target is read.
    assert len(train_it.stream) == held.first * cfg.train.seq_len + 1
    with pytest.raises(IndexError):
        train_it.stream.read(0, held.first * cfg.train.seq_len + 2)


def test_fewer_held_out_batches_than_eval_steps_are_said(tiny):
    """A trial's eval.steps=10 evaluated 1 batch without a word (only 4 sequences were held out)."""
    out = io.StringIO()
    result = train(load_config(DEFAULT_CONFIG, tiny(2, "eval.every=2", "eval.steps=1000", "eval.split=0.01",
                                                    "checkpoint.enabled=false", "name=fewer")),
                   command="test", console=Console(file=out, width=300))
    said = " ".join(out.getvalue().split())
    assert result.status == "finished" and "fewer than eval.steps = 1000: each evaluation runs those" in said, said


def test_eval_paths_evaluate_on_files_of_ones_own_and_training_reads_all_of_its_data(tiny, tmp_path):
    """A trial: no way to evaluate on one's own validation file (only a tail of the training data).
    eval.paths: read as data.paths is; every window of it is evaluated, training reads all of data.paths,
    and the loss equals an eager computation on those windows."""
    from accelrun.data.build import build_data, build_eval_data

    (tmp_path / "train.txt").write_text("the training text, which is long enough. " * 400)
    (tmp_path / "val.txt").write_text("held apart: another text to evaluate on! " * 40)
    own = ["data.source=text", f"data.paths=[{tmp_path / 'train.txt'}]", f"eval.paths=[{tmp_path / 'val.txt'}]"]
    resolved = load_config(DEFAULT_CONFIG, tiny(2, *own, "eval.every=2", "eval.steps=2", "checkpoint.every=2"))
    cfg = resolved.config
    kw = dict(seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch, seed=0, vocab_size=cfg.model.vocab_size)
    whole = load_stream(cfg.data, vocab_size=cfg.model.vocab_size, seed=0)
    assert len(build_data(cfg.data, eval_cfg=cfg.eval, **kw).stream) == len(whole)  # nothing held out of it
    held = build_eval_data(cfg.data, cfg.eval, **kw)
    val = load_stream(cfg.data.model_copy(update={"paths": [str(tmp_path / "val.txt")]}),
                      vocab_size=cfg.model.vocab_size, seed=0)
    T = cfg.train.seq_len
    assert held.first == 0 and held.n_heldout == (len(val) - 1) // T

    result = train(resolved, command="test")
    (last,) = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] == 2]
    model = load_run_model(result.run_dir)
    B, losses = cfg.train.micro_batch, []
    with torch.no_grad():
        for j in range(2):
            w = torch.stack([val.read(i * T, i * T + T + 1) for i in range(j * B, j * B + B)])
            logits = model(w[:, :-1])
            losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)))
    assert last["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), abs=1e-5, rel=1e-5)


def test_eval_paths_are_checked_before_a_run(tiny, tmp_path):
    from accelrun.config import ConfigError

    (tmp_path / "train.txt").write_text("text " * 100)
    with pytest.raises(ConfigError, match=r"eval.paths = .*: nothing at '.*nothere.txt'"):
        load_config(DEFAULT_CONFIG, tiny(2, "data.source=text", f"data.paths=[{tmp_path / 'train.txt'}]",
                                         f"eval.paths=[{tmp_path / 'nothere.txt'}]"))
    # found as data.paths are: ** matches files in the folder itself too (a review's)
    load_config(DEFAULT_CONFIG, tiny(2, "data.source=text", f"data.paths=[{tmp_path / 'train.txt'}]",
                                     f"eval.paths=[{tmp_path}/**/*.txt]"))
    with pytest.raises(ConfigError, match=r"eval.paths = .* is read as data.paths is, and data.source = builtin"):
        load_config(DEFAULT_CONFIG, tiny(2, f"eval.paths=[{tmp_path / 'train.txt'}]"))
