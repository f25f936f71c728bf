"""Expert parallelism against one process: a 2-rank job with parallel.ep = 2 (each rank holds half of
every layer's experts, tokens travel by all-to-all) trains the same losses, step for step, as one
process with all experts, with capacity dropping and a shared expert on.

Tolerance: fp32, relative 1e-5 per step's loss (LOSS_RTOL). That the exchange ran: every step's
metrics count the all-to-alls rank 0 made and the experts it holds; the checkpoint holds the
experts' whole tensors (each rank wrote its half)."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import LOSS_RTOL, losses, train_job

STEPS = 3
MOE = ["model.arch=moe", "model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_dim=48",
       "model.shared_expert_ffn_dim=32", "model.capacity_factor=1.0", "model.aux_loss_coef=0.05"]
EP2 = ["parallel.nproc_per_node=2", "parallel.ep=2", "train.micro_batch=2"]


def test_expert_parallel_equals_one_process(tmp_path, reference):
    job = train_job(tmp_path, STEPS, "checkpoint.every=3", "name=ep2", *MOE, *EP2)
    one = reference(STEPS, *MOE)
    assert losses(job.run_dir) == pytest.approx(one.losses, rel=LOSS_RTOL)

    got, want = read_metrics(job.run_dir / "metrics.jsonl"), read_metrics(one.run_dir / "metrics.jsonl")
    layers = 2
    for g, w in zip(got, want, strict=True):
        # Per step and layer: counts, tokens there, tokens back; the two token exchanges again in backward.
        assert g["ep_all_to_all"] == 5 * layers and g["ep_local_experts"] == 2
        # The router saw the same tokens and dropped the same ones (per-sequence capacity).
        assert g["moe_tokens_per_expert"] == w["moe_tokens_per_expert"]
        assert g["moe_dropped_tokens"] == w["moe_dropped_tokens"] > 0
        assert g["moe_aux_loss"] == pytest.approx(w["moe_aux_loss"], rel=LOSS_RTOL)
    assert "ep_all_to_all" not in want[0]

    (ckpt,) = sorted((job.run_dir / "checkpoints").glob("step-*"))
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    (w1,) = [k for k in meta if k.endswith("layers.0.feed_forward.experts.w1")]
    assert tuple(meta[w1].size) == (4, 64, 48)  # all four experts, from two ranks' halves
    assert "## Experts (router)" in (job.run_dir / "report.md").read_text()


def test_expert_parallel_with_replicated_experts_equals_one_process(tmp_path, reference):
    """4 ranks, HSDP 2 × 2 with ep = 2: ranks {0, 1} and {2, 3} each spread the experts, so every expert
    has two holders whose gradients are summed (ExpertParallel.reduce_gradients' replica path)."""
    job = train_job(tmp_path, STEPS, "checkpoint.enabled=false", "name=ep2x2", *MOE, "parallel.nproc_per_node=4",
                    "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2", "train.micro_batch=1")
    assert losses(job.run_dir) == pytest.approx(reference(STEPS, *MOE).losses, rel=LOSS_RTOL)
    got = read_metrics(job.run_dir / "metrics.jsonl")
    assert all(m["ep_local_experts"] == 2 and m["ep_all_to_all"] == 10 for m in got)


@pytest.mark.parametrize(("name", "overrides", "at_breaks"), [
    ("auto", [], False),  # the blocks and the loss head through the graph cache's whole-graph trace
    ("block", ["compile.scope=block"], False),
    ("fullgraph", ["compile.scope=model", "compile.fullgraph=true"], False),
    ("model", ["compile.scope=model"], True),  # the model declines the graph cache: a break per layer
])  # fmt: skip
def test_moe_compiles_with_accelrun(tmp_path, reference, name, overrides, at_breaks):
    """compile.backend = accelrun on the MoE, one process, losses equal eager's (fp32, 1e-5). On the CPU
    each expert's rows are counted on the host. In a whole-graph trace (the graph cache's, or
    compile.fullgraph) the counts are sizes read at run time: one graph for any routing, no break.
    Elsewhere the experts run eagerly at a graph break of the model's own making (traced after a break,
    the counts would be constants, compiled again for every new set): routing, attention, the
    load-balancing loss and the code after the experts are compiled, and the break says what it is."""
    job = train_job(tmp_path, STEPS, f"name=moe-compiled-{name}", "compile.backend=accelrun", *overrides,
                    "checkpoint.enabled=false", *MOE)
    assert losses(job.run_dir) == pytest.approx(reference(STEPS, *MOE).losses, rel=LOSS_RTOL)
    compiler = job.report["compiler"]
    assert compiler["dynamo_graphs"] >= 1 and compiler["regions_per_executor"].get("cpp", 0) > 0, compiler
    if not at_breaks:
        assert compiler["graph_breaks"] == 0 and not compiler["warnings"], compiler
        if name != "fullgraph":  # the graph cache saved what it compiled
            assert compiler["graph_cache"]["saved"] >= 1, compiler["graph_cache"]
        return
    assert compiler["graph_breaks"] >= 2, compiler  # a layer's experts each
    assert all("torch.compiler.disable" in why for why in compiler["dynamo"]["unsupported"]), compiler
    sites = compiler["dynamo"]["break_sites"]
    assert sites and all("experts run eagerly there" in site for site in sites), sites
