"""data.packing = document on 2 ranks (gloo): under FSDP (compiled by accelrun's backend: the blocks' graph and
the loss head's, no graph break), under TP, and under FSDP x TP on 4 ranks (compiled), every token's loss equals transformers' ``LlamaForCausalLM`` on
its document alone (fp32, 1e-5), and the training loss is their mean; under pipeline stages (compiled), the
schedule's loss is the mean of those rows' means. TP without data parallelism runs eager: validate refuses to
compile that layout with this torch, whatever the packing."""

from __future__ import annotations

import pytest

from tests.dist.document_ranks import run_ranks
from tests.models.hf_helpers import save_tiny_hf
from tests.train.test_document_packing import LENGTHS, RTOL

LAYOUTS = {
    "fsdp2": ["parallel.dp_shard=2", "train.micro_batch=2", "train.global_batch=4"],
    "tp2": ["parallel.dp_shard=1", "parallel.tp=2", "train.micro_batch=2", "train.global_batch=2",
            "compile.backend=eager"],
    # One row per micro-batch, so the schedule's mean loss is the mean of the rows' own means.
    "pp2": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=2",
            "train.micro_batch=2", "train.global_batch=2"],
    # TP compiles where FSDP shards the same blocks: 4 ranks, 2 x 2.
    "fsdp2_tp2": ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2", "train.global_batch=4"],
}
DEGREES = {"fsdp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2), "fsdp2_tp2": (2, 2, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_losses_equal_transformers_per_document_on_ranks(layout, tmp_path):
    hf_dir = tmp_path / "hf"
    save_tiny_hf(hf_dir, "llama")
    dp, tp, pp = DEGREES[layout]
    records = run_ranks(tmp_path, hf_dir, LAYOUTS[layout], LENGTHS, world=dp * tp * pp)
    assert len(records) == dp * tp * pp
    for rank, r in enumerate(records):
        assert r["exitcode"] == 0, (rank, r)
        assert (r["dp_size"], r["tp_size"], r["pp_size"]) == DEGREES[layout]
        assert r["worst_rel"] <= RTOL, (rank, r["worst_rel"])
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=RTOL)
        if layout != "tp2":  # the blocks' graph, and the loss head's where the rank has it
            graphs = 1 if layout == "pp2" else 2
            assert r["dynamo_graphs"] == graphs and not r["graph_breaks"] and not r["fallbacks"], (rank, r)


def test_fsdp_job_through_the_launcher_trains_as_one_process(tmp_path):
    """`accelrun train`'s own path (the elastic agent, the loop) on text files with data.packing=document: two
    FSDP ranks give one process's losses (which equal transformers' per document:
    tests/train/test_document_packing.py), compiled with no graph break."""
    import json

    from tests.dist.jobs import FSDP2, LOSS_RTOL, losses, train_job

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, n in enumerate(LENGTHS * 3):
        (docs / f"{i:02d}.txt").write_text("ab" * (n // 2) + "c")
    data = ["data.source=text", f"data.paths=[{docs}/*.txt]", "data.packing=document", "compile.backend=accelrun",
            "train.seq_len=32", "train.global_batch=4"]
    one = train_job(tmp_path / "one", 2, *data, "name=one").run_dir
    two = train_job(tmp_path / "two", 2, *data, *FSDP2, "name=two").run_dir
    assert losses(two) == pytest.approx(losses(one), rel=LOSS_RTOL)
    compiler = json.loads((two / "report.json").read_text())["compiler"]
    assert compiler["dynamo_graphs"] == 2 and not compiler["graph_breaks"] and not compiler["warnings"], compiler
