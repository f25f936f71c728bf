"""A checkpoint damaged after it was completed (a copy cut short, a full disk): resuming falls back to
the previous complete checkpoint with a warning, instead of failing as if the recipe had changed."""

from __future__ import annotations

import errno
import io
import re

import pytest
import torch
from rich.console import Console

from accelrun.config import ConfigError, load_config
from accelrun.report.metrics import read_metrics
from accelrun.report.rundir import RunFolderError
from accelrun.train.checkpoint import damage, save_checkpoint
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG


def run(overrides, **kw):
    return train(load_config(DEFAULT_CONFIG, overrides), command="test", **kw)


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]


def test_truncated_newest_checkpoint_falls_back_to_the_previous_complete_one(tiny):
    every = ["checkpoint.every=2", "checkpoint.keep=5"]
    full = run(tiny(8, *every, "name=whole"))
    cut = run(tiny(8, *every, "name=cut"), stop_after_step=6)
    newest = cut.run_dir / "checkpoints" / "step-000006"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert "truncated" in damage(newest) and damage(cut.run_dir / "checkpoints" / "step-000004") is None

    out = io.StringIO()
    resumed = run(tiny(8, *every, "name=cut"), console=Console(file=out, width=1000))
    text = out.getvalue()
    assert resumed.report["resumed_from"] == str(cut.run_dir / "checkpoints" / "step-000004"), text
    assert f"warning: {newest} is damaged: {shard.name} is {size // 2:,} bytes" in text, text
    assert "the previous complete checkpoint is used instead" in text
    assert losses(resumed.run_dir) == losses(full.run_dir)[4:]  # fp32 on the CPU: bit-identical

    # Asked for by path, the damaged checkpoint is an error that names the one before it.
    with pytest.raises(ConfigError, match=r"damaged: .* \(truncated\); the newest complete one before it is .*step-000004"):
        run(tiny(8, *every, "name=other", f"checkpoint.resume={newest}"))


@pytest.mark.parametrize("blocked", ["checkpoints folder is a file", "shard write refused"])
def test_a_checkpoint_that_cannot_be_written_is_one_message(blocked, tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    run_dir = tmp_path / "runs" / "x" / "20250101-000000-abcdef"
    run_dir.mkdir(parents=True)
    ckpt_dir = run_dir / "checkpoints"
    if blocked == "checkpoints folder is a file":
        ckpt_dir.write_text("")
        why = f"{ckpt_dir} is a file, not a folder"
    else:
        import torch.distributed.checkpoint.filesystem as fs

        def refuse(*a, **kw):
            raise OSError(errno.EROFS, "Read-only file system", str(ckpt_dir))

        monkeypatch.setattr(fs, "_write_item", refuse)
        why = "the file system is read-only"
    with pytest.raises(RunFolderError, match=re.escape(why)):
        save_checkpoint(ckpt_dir, 1, model, opt, {}, keep=1)
