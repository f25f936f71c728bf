"""The planner's context parallelism: tokens per rank, the gathered keys/values it keeps, its
all-gathers' bytes and time, and FSDP over dp_shard × cp."""

from __future__ import annotations

import pytest

from accelrun.plan import load_plan_config, predict
from accelrun.plan.context_parallel import held_kv_bytes, sequence_kv_bytes
from tests.conftest import DEFAULT_CONFIG

# 8 heads over 2 key/value heads of 32: the held (repeated) keys are 4× the exchanged ones.
BASE = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=2", "model.n_layers=4", "train.seq_len=8192",
        "model.max_seq_len=8192", "train.global_batch=2", "train.micro_batch=1", "parallel.nproc_per_node=2"]


def plan(*overrides: str):
    return predict(load_plan_config(DEFAULT_CONFIG, [*BASE, *overrides], cluster="h100-8x").resolved.config)


def term(p, name: str) -> float:
    return sum(t.bytes for t in p.memory.terms if t.name == name)


def test_cp2_divides_tokens_and_keeps_the_other_halfs_keys_and_values():
    one, cp2 = plan("parallel.dp_shard=2"), plan("parallel.dp_shard=1", "parallel.cp=2")
    w = cp2.workload
    assert w.chunk_tokens == 8192 // 2 and one.workload.chunk_tokens == 8192
    assert term(cp2, "activations") == pytest.approx(term(one, "activations") / 2)
    # Per layer, on a GPU: the other rank's 4096 tokens × (k, v) × 8 heads (repeated) × 32 × fp32, and the
    # float masks of the rank's two chunks of c = 2048 (c² · (2·cp + 1) numbers); on a CPU 2 kv heads, no mask.
    assert held_kv_bytes(w, on_cpu=False) == 4096 * 2 * 8 * 32 * 4 + 4 * 2048**2 * 5
    assert held_kv_bytes(w, on_cpu=True) == 4096 * 2 * 2 * 32 * 4
    assert term(cp2, "gathered keys/values (context parallel)") == pytest.approx(4 * held_kv_bytes(w, False))
    assert sequence_kv_bytes(w) == 8192 * 2 * 2 * 32 * 4  # what the all-gather carries: 2 kv heads
    # FSDP shards over dp_shard × cp: the same parameter bytes per rank as dp_shard = 2.
    assert term(cp2, "parameters (fp32)") == pytest.approx(term(one, "parameters (fp32)"))
    assert cp2.time.comm_time["context parallel"] > 0 and cp2.time.parts["context parallel"] > 0
    assert "context parallel" not in one.time.parts
    assert any("context parallel 2" in n for n in cp2.notes)


def test_the_plans_layout_line_multiplies_to_its_world():
    """A trial's plan of dp_shard 4 × cp 2 printed "world 8 = pp 1 × dp_replicate 1 × dp_shard 4 × tp 1"."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    r = CliRunner().invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", "h100-8x", *BASE, "parallel.dp_shard=1",
                                 "parallel.cp=2"])
    assert r.exit_code == 0, r.output
    assert "layout: world 2 = pp 1 × dp_replicate 1 × dp_shard 1 × cp 2 × tp 1;" in r.output, r.output
