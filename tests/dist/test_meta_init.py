"""Each rank allocates only what it holds: the model is built on the meta device, the layout applied,
and only the local shards (or the rank's pipeline stage) materialised and initialised.

Watched inside real 2-rank runs (``tests.dist.rank_harness``, probe ``allocations``): during the
rank's whole setup, no floating-point tensor larger than the largest parameter shard the rank holds
is ever created (the old way allocated the whole model on every rank, then cut it), and the bytes of
all tensors created stay within a small multiple of the rank's own parameter bytes (the shards, plus
the draws they are initialised from, one band of rows at a time; the old pipeline setup also copied
the whole model per stage). The dry run (``accelrun.dist.dry_run``) must count what these ranks held. That the values are those
of one process is what the layout tests
(test_dist_layouts, test_compiled_fsdp) check: their losses equal the one-process run's.

The model's vocabulary is wide enough that its embedding shard is much larger than one draw
(``shard_init.TILE_ELEMENTS``), and its rotary tables are short, so they do not hide anything.
"""

from __future__ import annotations

import math

import pytest
import torch

from accelrun.config import load_config
from accelrun.dist.dry_run import dry_run
from accelrun.models.shard_init import TILE_ELEMENTS
from tests.conftest import DEFAULT_CONFIG
from tests.dist.jobs import FSDP2, tiny_overrides
from tests.dist.rank_harness import run_ranks

MODEL = ["model.vocab_size=4096", "model.max_seq_len=32", "checkpoint.enabled=false"]
LAYOUTS = {
    "fsdp2": FSDP2,
    "tp2_sp": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "compiled_fsdp2": [*FSDP2, "compile.backend=accelrun", "parallel.fsdp_impl=compiled", "compile.executors=[aten]",
                       "compile.passes=[dce]"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_materialises_only_its_shard(layout, tmp_path):
    _, ranks = run_ranks(tmp_path, 2, 1, [*MODEL, *LAYOUTS[layout]], "allocations")
    for rank, r in enumerate(ranks):
        assert r.get("code") == 0 and r["exitcode"] == 0, (rank, r)
        local = r["local_params"]
        assert local and all(dev == "cpu" for _, _, dev in local.values()), (rank, local)
        local_bytes = sum(n * size for n, size, _ in local.values())
        largest_local = max(n for n, _, _ in local.values())
        # Nothing larger than the rank's largest shard was ever created (one draw is smaller still).
        assert r["largest_alloc_numel"] <= max(largest_local, TILE_ELEMENTS), (rank, r["largest_alloc_op"], r)
        # The shards, the draws (at most a band of rows more than the shard per parameter) and the
        # rotary tables: within 3x the rank's own bytes; a whole model and its stage copy are 4x.
        assert r["new_float_bytes"] <= 3 * local_bytes + 64 * 1024, (rank, r["new_float_bytes"], local_bytes)
        if layout != "pp2":  # a sharded layout holds about half the model
            whole = sum(math.prod(s) for s in _whole_model_shapes())
            assert sum(n for n, _, _ in local.values()) < 0.6 * whole, (rank, local)
    # The dry run (a fake process group in this process) counts what these ranks held.
    resolved = load_config(DEFAULT_CONFIG, tiny_overrides(tmp_path, 1, "parallel.nproc_per_node=2", *MODEL,
                                                          *LAYOUTS[layout]))
    dry = dry_run(resolved)
    assert [d.params for d in dry] == [sum(n for n, _, _ in r["local_params"].values()) for r in ranks]


def _whole_model_shapes() -> list[tuple[int, ...]]:
    from accelrun.models import build_model
    from tests.conftest import TINY

    cfg = load_config(DEFAULT_CONFIG, [*TINY, *MODEL]).config
    return [tuple(p.shape) for p in build_model(cfg.model, "meta").parameters()]


def test_a_rank_materialises_only_its_shard_is_not_vacuous():
    # The whole tiny model is several draws wide: the bound above is not one that anything passes.
    whole = sum(math.prod(s) for s in _whole_model_shapes())
    assert whole > 4 * TILE_ELEMENTS and torch.Size(_whole_model_shapes()[0]).numel() > 2 * TILE_ELEMENTS
