"""The two published Llama 3 405B layouts dry-run at full size through ``accelrun train --dry-run``: their
real layout (pipeline stages, TP with sequence and loss parallelism, FSDP) built on meta tensors for a
representative subset of the ranks, each rank's bytes beside the planner's, exit 0.

- configs/llama3-405b-torchtitan.yaml: TP 8 × PP 8 (interleaved, 2 stages per rank) × FSDP 8, 512 ranks;
- configs/llama3-405b-meta.yaml: TP 8 × PP 16 (interleaved, 4 stages per rank, the first and last stage a
  layer short by the automatic split, as Meta's) × FSDP 128, 16,384 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.dist.dry_run import distinct_pipeline_ranks
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _no_process_group_left_by_earlier_tests():
    if dist.is_initialized():  # a dry run refuses to replace a process group (see test_dry_run.py)
        dist.destroy_process_group()


@dataclass(frozen=True)
class Published:
    recipe: str
    world: int
    pp: int
    stages_per_rank: int
    pipeline_kinds: tuple[int, ...]  # the first pipeline rank of each kind
    stage_layers: tuple[int, ...]  # layers per stage


PUBLISHED = (
    # 126 layers in 16 stages (the automatic split): 8 each, the first and the last 7 (the embedding and
    # the output layer are each about 2/3 of a block); ranks 1..6 are alike.
    Published("llama3-405b-torchtitan.yaml", 512, 8, 2, (0, 1, 7), (7,) + (8,) * 14 + (7,)),
    # 64 stages of 2 layers, the first and the last of 1 (Meta's split, made automatically): ranks 1..14 are alike.
    Published("llama3-405b-meta.yaml", 16_384, 16, 4, (0, 1, 15), (1,) + (2,) * 62 + (1,)),
)


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: c.recipe)
def test_published_405b_layout_dry_runs_at_full_size(case: Published):
    path = REPO / "configs" / case.recipe
    resolved = load_config(path)
    par = resolved.config.parallel
    assert par.world_size == case.world and par.degrees()["pp"] == case.pp and par.degrees()["tp"] == 8
    assert par.sequence_parallel and par.loss_parallel and par.stages_per_rank == case.stages_per_rank
    assert distinct_pipeline_ranks(resolved) == list(case.pipeline_kinds)

    r = CliRunner().invoke(cli, ["train", str(path), "--dry-run"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    (header,) = [line for line in lines if line.split()[:2] == ["rank", "pp"]]
    assert header.split()[6] == "stages" and header.split()[-2:] == ["params", "ratio"]
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    # Each kind of pipeline rank × the first and last TP rank × the first and last data-parallel rank.
    assert len(rows) == len(case.pipeline_kinds) * 2 * 2, r.output
    assert sorted({int(row[1]) for row in rows}) == list(case.pipeline_kinds)
    assert {int(row[5]) for row in rows} == {0, 7}
    n_stages = case.pp * case.stages_per_rank
    for row in rows:
        pp_rank = int(row[1])
        stages = range(pp_rank, n_stages, case.pp)
        assert row[6] == ",".join(str(s) for s in stages), row
        # Each stage's layers, as the split gives them: stage s runs from the sum of the earlier stages' counts.
        first = [sum(case.stage_layers[:s]) for s in stages]
        assert row[7] == ",".join(f"{a}-{a + case.stage_layers[s] - 1}" if case.stage_layers[s] > 1 else str(a)
                                  for a, s in zip(first, stages, strict=True)), row
        # Bytes beside the plan: the first data-parallel rank holds what the planner counts; the last one
        # less where rows do not divide evenly over FSDP's shards (the vocabulary over 128).
        ratio = float(row[-1])
        assert (0.999 <= ratio <= 1.002) if int(row[3]) == 0 else (0.9 <= ratio <= 1.002), row
    assert "ranks built in" in r.output and f"of {case.world} ranks" in r.output
    split = ",".join(map(str, case.stage_layers))
    assert f"layers per stage (automatic: balanced, the embedding and the output layer counted in blocks): {split}" \
        in r.output
