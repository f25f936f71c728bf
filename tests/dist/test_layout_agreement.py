"""validate, plan --search and train accept exactly the same layouts.

Every layout of 8 ranks (each ordered split of 8 into pp × dp_replicate × dp_shard × cp × tp, each pipeline
schedule kind, with and without sequence + loss parallelism; with pipelining, every schedule and 4 stages per
rank with sequence + loss parallelism too) is put to the three:
- ``accelrun validate``: ``load_config``;
- ``accelrun plan --search``: the search's own candidate path (``_candidate`` + ``validate``);
- ``accelrun train``: the trainer's setup code building every rank's layout (``--dry-run``: the real
  mesh, pipeline stages, TP/SP plans and FSDP on a fake process group and meta tensors).
A layout validate accepts must build on every rank (with pipelining, each rank its stages); one it refuses
is refused by the search with the same messages, and ``accelrun train --dry-run`` exits 2 with them.
"""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import ConfigError, load_config
from accelrun.config.compose import apply_override, compose_file
from accelrun.config.resolve import resolve_config_path
from accelrun.config.search import search_path
from accelrun.config.validate import validate
from accelrun.dist.dry_run import dry_run
from accelrun.plan.search import _candidate
from tests.conftest import DEFAULT_CONFIG

WORLD = 8
# A tiny model every degree up to 8 can split: 8 heads (no grouping), 8 layers, vocabulary 512.
MODEL = ["model.dim=64", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=128",
         "model.vocab_size=512", "train.seq_len=32", "train.global_batch=16", "data.source=synthetic",
         "train.device=cpu", f"parallel.nproc_per_node={WORLD}"]


def layouts():
    for pp, rep, shard, cp in itertools.product((1, 2, 4, 8), repeat=4):
        if WORLD % (pp * rep * shard * cp):
            continue
        tp = WORLD // (pp * rep * shard * cp)
        # Context parallelism: one schedule kind (pipelining with cp is refused whatever the schedule).
        degrees = {"parallel.pp": pp, "parallel.dp_replicate": rep, "parallel.dp_shard": shard, "parallel.cp": cp,
                   "parallel.tp": tp}
        for schedule in (("1f1b", "interleaved_1f1b") if pp > 1 and cp == 1 else ("1f1b",)):
            for sharded in (False, True):
                yield {**degrees, "parallel.pp_schedule": schedule,
                       "parallel.sequence_parallel": sharded, "parallel.loss_parallel": sharded}
        if pp > 1 and cp == 1:  # the published runs' kind: pipelining × TP with sequence and loss parallelism
            for more in PIPELINE_VARIANTS:
                yield {**degrees, **more, "parallel.sequence_parallel": True, "parallel.loss_parallel": True}


# Schedules beyond the two above, and more than two stages per rank (8 layers: 2 pipeline ranks only).
PIPELINE_VARIANTS = ({"parallel.pp_schedule": "gpipe"}, {"parallel.pp_schedule": "zero_bubble"},
                     {"parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_stages_per_rank": 4})


LAYOUTS = list(layouts())


def _text(values: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def test_every_split_of_eight_ranks_is_enumerated():
    # Without cp: 10 splits without pp × 2, and 10 with pp > 1 × (2 schedules × 2 + 3 variants); with
    # cp > 1: 15 splits × 2.
    assert len(LAYOUTS) == 10 * 2 + 10 * (2 * 2 + len(PIPELINE_VARIANTS)) + 15 * 2


@pytest.mark.parametrize("values", LAYOUTS, ids=[" ".join(_text(v)).replace("parallel.", "") for v in LAYOUTS])
def test_validate_search_and_train_agree(values):
    overrides = [*MODEL, *_text(values)]
    try:
        resolved = load_config(DEFAULT_CONFIG, overrides)
        accepted, refusal = True, ""
    except ConfigError as e:
        accepted, refusal = False, e.messages
    # The search builds its candidates on the composed recipe and validates each.
    dirs = search_path()
    base = compose_file(resolve_config_path(DEFAULT_CONFIG, dirs), dirs)
    for text in MODEL:
        apply_override(base, text)
    candidate = _candidate(base, values)
    try:
        validate(candidate.data, candidate.sources)
        searched, search_refusal = True, ""
    except ConfigError as e:
        searched, search_refusal = False, e.messages
    assert searched == accepted, refusal
    assert search_refusal == refusal  # refused: the same messages (one per problem, each naming its keys)
    if not accepted:  # and `accelrun train --dry-run` exits 2 with them before building anything
        r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *overrides, "--dry-run"])
        assert r.exit_code == 2 and all(m.split(" (")[0] in r.output for m in refusal), r.output
    if accepted:  # train's own setup builds every rank's layout (each distinct shard shape)
        rows = dry_run(resolved)
        assert rows and all(r.params > 0 for r in rows)
        if values["parallel.pp"] > 1:  # each rank runs the stages its schedule gives it
            stages = resolved.config.parallel.stages_per_rank
            assert all(len(r.stages) == stages for r in rows), [r.stages for r in rows]
