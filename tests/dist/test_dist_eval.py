"""eval.every under data parallelism: each rank evaluates its shard of the held-out windows and the
mean is all-reduced; 2 ranks (FSDP) give the one-process validation loss."""

from __future__ import annotations

import pytest

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import FSDP2, train_job

EVAL = ["eval.every=2", "eval.steps=2", "eval.split=0.1", "checkpoint.enabled=false"]


def test_two_ranks_val_loss_equals_one_process(tmp_path):
    one = train_job(tmp_path / "runs", 4, "name=one", *EVAL)
    two = train_job(tmp_path / "runs", 4, "name=two", *FSDP2, *EVAL)
    assert one.status == two.status == "finished"
    rows1 = read_metrics(one.run_dir / "metrics.jsonl")
    rows2 = read_metrics(two.run_dir / "metrics.jsonl")
    v1 = [r["val_loss"] for r in rows1 if "val_loss" in r]
    v2 = [r["val_loss"] for r in rows2 if "val_loss" in r]
    assert len(v1) == len(v2) == 2
    # Rank r evaluates micro-batches r, r + 2 of 2 windows: together the 4 × 2 windows one process reads
    # as 2 micro-batches of 4. Training agrees to fp32 reduction order, so the val losses do too.
    assert v2 == pytest.approx(v1, rel=1e-4)
    assert two.report["final_val_loss"] == pytest.approx(v1[-1], rel=1e-4)
