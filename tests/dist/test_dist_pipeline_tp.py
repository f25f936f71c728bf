"""Pipeline × tensor parallelism with sequence and loss parallelism (the layout of torchtitan's and Meta's
Llama 3 405B runs, scaled down to CPU ranks) against one process: same losses, step for step.

Each job is checked for the dimensions it was meant to use, not only its losses: every stage ran on the
ranks it belongs to (the report's per-rank pipeline trace), the hidden states one stage sent the next were
sequence shards (T / tp tokens), the last stage's loss saw vocabulary-sharded logits, and the checkpoint's
matrices are stored as tp × dp_shard shards. One 8-rank job (the headline layout: PP 2 × TP 2 × FSDP 2,
1F1B); the other schedules on 4 ranks (PP 2 × TP 2), the interleaved one with 4 stages per rank split
automatically (accelrun/plan/stage_split.py: the first and last stage a layer short), each stage checked
for the layers it ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.dist.jobs import LOSS_RTOL, losses, train_job

STEPS = 3
SEQ, DIM, TP = 32, 64, 2  # the tiny recipe's sequence and width (tests.conftest.TINY)
SHARDED = ["parallel.pp=2", f"parallel.tp={TP}", "parallel.sequence_parallel=true", "parallel.loss_parallel=true"]


@dataclass(frozen=True)
class Layout:
    overrides: tuple[str, ...]
    model: tuple[str, ...] = ()  # the one-process reference trains the same model
    world: int = 4
    dp_shard: int = 1
    stages_per_rank: int = 1
    stage_layers: tuple[int, ...] | None = None  # layers per stage, where the test checks the split

    @property
    def stages(self) -> int:
        return 2 * self.stages_per_rank

    @property
    def microbatch(self) -> int:
        # The tiny recipe's batch of 4 over dp_shard data-parallel ranks, in pp = 2 micro-batches.
        return 4 // self.dp_shard // 2


LAYOUTS = {
    "pp2_tp2_sp_lp_fsdp2_1f1b": Layout(("parallel.nproc_per_node=8", "parallel.dp_shard=2", "train.micro_batch=2",
                                        "parallel.pp_schedule=1f1b"), world=8, dp_shard=2),
    "pp2_tp2_sp_lp_gpipe": Layout(("parallel.nproc_per_node=4", "parallel.dp_shard=1", "parallel.pp_schedule=gpipe")),
    "pp2_tp2_sp_lp_zero_bubble": Layout(("parallel.nproc_per_node=4", "parallel.dp_shard=1",
                                         "parallel.pp_schedule=zero_bubble"), ("model.n_layers=4",),
                                        stages_per_rank=2),
    # 10 layers in 8 stages by the automatic split: the tiny recipe's embedding and output layer are each
    # about half a block (vocabulary 320 × dim 64), so the first and the last stage keep one layer and the
    # two extra layers go to stages 1 and 2 (the layer-balanced split gave them to stages 0 and 1).
    "pp2_tp2_sp_lp_interleaved_4_per_rank": Layout(("parallel.nproc_per_node=4", "parallel.dp_shard=1",
                                                    "parallel.pp_schedule=interleaved_1f1b",
                                                    "parallel.pp_stages_per_rank=4"), ("model.n_layers=10",),
                                                   stages_per_rank=4, stage_layers=(1, 2, 2, 1, 1, 1, 1, 1)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_with_sequence_and_loss_parallel_matches_one_process(name, reference, tmp_path):
    lay = LAYOUTS[name]
    run = train_job(tmp_path / "runs", STEPS, f"name={name}", f"checkpoint.every={STEPS}",
                    *SHARDED, *lay.overrides, *lay.model)
    got, want = losses(run.run_dir), reference(STEPS, *lay.model).losses
    assert len(got) == STEPS and got == pytest.approx(want, rel=LOSS_RTOL), (got, want)

    report = json.loads((run.run_dir / "report.json").read_text())
    assert report["world_size"] == lay.world
    traces = report["pipeline_per_rank"]
    # Mesh order (pp, dp_replicate, dp_shard, cp, tp): the first half of the ranks is pipeline rank 0.
    half = lay.world // 2
    for rank, trace in enumerate(traces):
        pp_rank = rank // half
        assert trace["stages"] == list(range(pp_rank, lay.stages, 2)), (rank, trace)
        # Every stage but the last sent this rank's sequence shard: (micro-batch, seq / tp, dim).
        senders = [s for s in trace["stages"] if s != lay.stages - 1]
        assert trace["sent"] == {str(s): [lay.microbatch, SEQ // TP, DIM] for s in senders}, (rank, trace)
        if lay.stage_layers is not None:  # each stage ran the layers the automatic split gave it
            first = [sum(lay.stage_layers[:s]) for s in range(lay.stages)]
            assert trace["layers"] == {str(s): [first[s], first[s] + lay.stage_layers[s] - 1]
                                       for s in trace["stages"]}, (rank, trace)
        holds_last = lay.stages - 1 in trace["stages"]
        assert trace["logits"] == (f"vocabulary-sharded over {TP} ranks" if holds_last else None), (rank, trace)

    # Tensor (and FSDP) shards: each matrix is stored as tp × dp_shard pieces, the output layer too.
    meta = FileSystemReader(run.run_dir / "checkpoints" / f"step-{STEPS:06d}").read_metadata()
    for fqn in ("model.layers.0.attention.wq.weight", "model.output.weight"):
        assert len(meta.state_dict_metadata[fqn].chunks) == TP * lay.dp_shard, fqn
