"""Context parallelism (``parallel.cp``) on gloo ranks against one process: same losses, step for step.

Two jobs (the one-process reference is the session's shared one): cp 2 × FSDP 2 on 4 ranks in eager
mode, and cp 2 alone on 2 ranks compiled by accelrun (block scope), whose attention's all-gather and
its backward's reduce-scatter must be nodes of the compiled graph, with no graph break. Tolerance:
fp32, relative 1e-5 per step's loss (the sharded sums run in another order than one process's).
"""

from __future__ import annotations

import json

import pytest

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import LOSS_RTOL, jobs_once, losses

STEPS = 4
JOBS = {
    "cp2_fsdp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.cp=2", "train.micro_batch=2",
                  "checkpoint.enabled=false"],
    "cp2_compiled": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.cp=2",
                     "compile.backend=accelrun", "compile.executors=[aten]", "compile.dump=true",
                     "checkpoint.enabled=false"],
}
# The tiny recipe (tests/conftest.py TINY): seq_len 32, 2 layers, 2 kv heads of dim 16, fp32.
SEQ_LEN, LAYERS, KV_HEADS, HEAD_DIM = 32, 2, 2, 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return jobs_once(tmp_path_factory.mktemp("context_parallel"), STEPS, JOBS)


@pytest.mark.parametrize("name", list(JOBS))
def test_context_parallel_matches_one_process(name, job, reference):
    d = job(name)
    assert losses(d) == pytest.approx(reference(STEPS).losses, rel=LOSS_RTOL)
    report = json.loads((d / "report.json").read_text())
    assert report["parallel"]["cp"] == 2


def test_each_rank_gathers_the_other_half_of_every_sequence(job):
    """Eager: one key/value all-gather per layer and micro-batch, and its bytes are those of a rank that
    holds seq_len / cp tokens of each of its 2 sequences (and receives the other rank's as many)."""
    d = job("cp2_fsdp2")
    local_tokens = SEQ_LEN // 2
    per_call = 2 * 2 * KV_HEADS * local_tokens * HEAD_DIM * 4  # (k, v) × micro-batch 2 × heads × tokens × dim × fp32
    for m in read_metrics(d / "metrics.jsonl"):
        assert m["cp_gathers"] == LAYERS and m["cp_bytes"] == LAYERS * per_call
        assert m["cp_comm_s"] > 0
    report = json.loads((d / "report.json").read_text())
    assert report["cp_comm"]["gathers"] == LAYERS
    assert "of which context parallel K/V all-gathers" in (d / "report.md").read_text()


def test_compiled_attention_collectives_are_graph_nodes(job):
    d = job("cp2_compiled")
    compiler = json.loads((d / "report.json").read_text())["compiler"]
    assert compiler["graph_breaks"] == 0 and compiler["dynamo"]["frames_skipped"] == []
    graphs = list((d / "compile").rglob("*.py"))
    text = "\n".join(p.read_text() for p in graphs)
    assert "all_gather_into_tensor" in text and "reduce_scatter_tensor" in text
    # The gathers cannot count themselves inside the graph: counted from the forwards (micro-batch 4,
    # the same bytes an eager gather counts), not timed.
    per_call = 2 * 4 * KV_HEADS * (SEQ_LEN // 2) * HEAD_DIM * 4
    for m in read_metrics(d / "metrics.jsonl"):
        assert m["cp_gathers"] == LAYERS and m["cp_bytes"] == LAYERS * per_call and "cp_comm_s" not in m
    assert "context parallel K/V all-gathers untimed (in compiled blocks)" in (d / "report.md").read_text()
