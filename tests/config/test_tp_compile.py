"""Tensor parallelism alone does not train compiled with torch 2.13 (Inductor, aot_eager and accelrun
alike: a gradient reaches DTensor's Redistribute.backward as a plain tensor), so the default recipe,
which compiles, refuses it before a process starts, naming the two ways out; FSDP x TP compiles."""

from __future__ import annotations

import pytest

from accelrun.config import ConfigError, load_config
from tests.conftest import DEFAULT_CONFIG

TP_ALONE = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"]


def test_tp_alone_with_the_default_compiler_is_refused_with_the_ways_out():
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, TP_ALONE)
    message = str(e.value)
    assert "parallel.tp = 2" in message and "compile.backend = accelrun (recipes/compile/accelrun.yaml" in message
    assert "compile.backend=eager" in message and "parallel.dp_shard=2" in message


@pytest.mark.parametrize("overrides", [
    [*TP_ALONE, "compile.backend=eager"],
    ["parallel.nproc_per_node=4", "parallel.tp=2", "train.micro_batch=8"],  # FSDP x TP: compiles
    ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2", "compile.backend=accelrun",
     "parallel.fsdp_impl=compiled"],  # refused for its own reason (compiled FSDP needs dp), not this one
])
def test_tp_with_eager_or_with_fsdp_is_not_refused_for_compiling(overrides):
    try:
        load_config(DEFAULT_CONFIG, overrides)
    except ConfigError as e:
        assert "does not train compiled" not in str(e)
