"""Compiled FSDP (``parallel.fsdp_impl: compiled``) on 2 and 4 gloo ranks against one process (the
shared reference, which the fsdp2 layouts also match) and against fsdp2 itself.

Two compiled jobs: 2 ranks without the communication passes, and 4 ranks with tensor parallelism
(dp 2 × tp 2) and the passes (small buckets and a small in-flight bound, so that several buckets and
a real schedule form, over FSDP's all-gathers and reduce-scatters and TP's all-reduces alike). The compiled graphs run on the aten executor (no C++
builds: the passes and the sharding are under test here, not the code generators). Tolerance as for
the other layouts: fp32, relative 1e-5 per step's loss (reductions sum in another order).
"""

from __future__ import annotations

import json

import pytest

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import FSDP2, LOSS_RTOL, jobs_once, losses, train_job

STEPS = 4
COMPILED = ["compile.backend=accelrun", "parallel.fsdp_impl=compiled", "compile.executors=[aten]"]
PASSES = ("compile.passes=[fuse_rmsnorm, fuse_swiglu, dce, cse, {bucket_collectives: {bucket_mb: 0.02}}, "
          "{schedule_overlap: {max_inflight_mb: 0.1}}, partition_regions]")
JOBS = {
    "compiled_plain": [*FSDP2, *COMPILED, "compile.passes=[dce, cse]", "checkpoint.every=2"],
    "compiled_tp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2",
                     *COMPILED, PASSES, "compile.dump=true", "checkpoint.enabled=false"],
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return jobs_once(tmp_path_factory.mktemp("compiled_fsdp"), STEPS, JOBS)


@pytest.mark.parametrize("name", list(JOBS))
def test_compiled_fsdp_matches_one_process(name, job, reference):
    d = job(name)
    assert losses(d) == pytest.approx(reference(STEPS).losses, rel=LOSS_RTOL)
    report = json.loads((d / "report.json").read_text())
    assert "compiled FSDP" in report["compiled"]
    # Exposed and in-flight communication are measured for the graph's collectives.
    ov = report["comm_overlap"]
    assert ov["busy_s"] > 0 and 0 <= ov["exposed_s"] <= ov["busy_s"] + 1e-6
    assert all("comm_exposed_s" in m for m in read_metrics(d / "metrics.jsonl"))


def test_passes_bucket_and_schedule_and_tp_collectives_are_graph_nodes(job):
    tp = job("compiled_tp2")
    fired = json.loads((tp / "report.json").read_text())["compiler"]["passes_fired"]
    assert fired.get("bucket_collectives") == 2 and fired.get("schedule_overlap") == 2  # forward and backward
    (forward,) = (tp / "compile" / "g0.forward").glob("*_schedule_overlap.py")
    text = forward.read_text()
    assert "all_gather_into_tensor" in text and "_c10d_functional.all_reduce" in text  # FSDP's and TP's


def test_compiled_checkpoint_resumes_in_one_process(job, reference, tmp_path):
    """The sharded parameters are the DTensors fsdp2 would hold: one process resumes from them."""
    ckpt = job("compiled_plain") / "checkpoints" / "step-000002"
    one = train_job(tmp_path / "runs", STEPS, "name=one-from-compiled", "checkpoint.enabled=false",
                    f"checkpoint.resume={ckpt}")
    assert losses(one.run_dir) == pytest.approx(reference(STEPS).losses[2:], rel=LOSS_RTOL)


def test_compiled_matches_fsdp2_step_for_step(job, tmp_path):
    fsdp2 = train_job(tmp_path / "runs", STEPS, "name=fsdp2", *FSDP2, "checkpoint.enabled=false").run_dir
    assert losses(job("compiled_plain")) == pytest.approx(losses(fsdp2), rel=LOSS_RTOL)


def test_compiled_fsdp_needs_the_accelrun_backend(tiny):
    from click.testing import CliRunner

    from accelrun.cli.main import cli
    from tests.conftest import DEFAULT_CONFIG

    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), *tiny(2), *FSDP2, "parallel.fsdp_impl=compiled"])
    assert r.exit_code == 2, r.output
    assert "parallel.fsdp_impl = compiled" in r.output and "compile.backend = eager" in r.output, r.output
