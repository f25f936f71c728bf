"""An allocation that cannot succeed is the recipe's problem, told as such: exit 2, one message with the
failed size, the device's memory, the planner's estimate and the keys that lower it."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.train.oom import is_oom
from tests.conftest import DEFAULT_CONFIG, TINY


def test_an_impossible_allocation_exits_2_with_the_planners_estimate(tmp_path):
    # An embedding table of 2e9 × 64 fp32 values (477 GiB): more than any test machine has.
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=1", "model.vocab_size=2000000000",
                                 f"report.runs_dir={tmp_path / 'runs'}"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "Traceback" not in out and out.count("error:") == 1, out
    assert "error: out of memory on cpu in training (an allocation of 476.84 GiB failed); the device has" in out
    assert "the planner expects" in out and "lower train.micro_batch" in out, out


def test_what_counts_as_out_of_memory():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
