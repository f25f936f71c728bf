"""Every collective accelrun issues takes tensors on its group's device (NCCL: CUDA tensors only).

On CPU ranks the gloo groups declare another device, ``lazy`` (see ``tests.dist.rank_harness``),
and a real 2-rank training run (its setup, loop, checkpoint and report) is watched: a control tensor
built on the CPU by default, as ``torch.tensor([flag])`` is, shows up as a violation with its call
site. FSDP covers the loop's per-step agreement and the loss average; the pipeline covers the
pipeline's loss and the gradient norm's sum over stages.
"""

from __future__ import annotations

import json

import pytest

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import FSDP2
from tests.dist.rank_harness import run_ranks

STEPS = 3
LAYOUTS = {
    "fsdp2": [*FSDP2, "checkpoint.every=2"],
    "pp2": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe", "checkpoint.enabled=false"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_take_tensors_on_the_groups_device(layout, tmp_path):
    run_dir, ranks = run_ranks(tmp_path, 2, STEPS, LAYOUTS[layout], "collective_device")
    for rank, r in enumerate(ranks):
        assert r.get("violations") == [], (rank, r)
        assert r["code"] == 0 and r["exitcode"] == 0, (rank, r)
        # The guard saw the loop's own collectives: at least one per step (the per-step agreement).
        assert r["checked"] >= STEPS, (rank, r)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "finished" and report["world_size"] == 2
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
