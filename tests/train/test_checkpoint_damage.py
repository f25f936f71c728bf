"""A checkpoint damaged after it was completed (a copy cut short, a full disk): resuming falls back to
the previous complete checkpoint with a warning, instead of failing as if the recipe had changed."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from accelrun.config import ConfigError, load_config
from accelrun.report.metrics import read_metrics
from accelrun.train.checkpoint import damage
from accelrun.train.run import train
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
