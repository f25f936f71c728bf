"""The layout search proposes only layouts the recipe rules accept, that fit, fastest first."""

from __future__ import annotations

from accelrun.config import load_config
from accelrun.plan import load_plan_config, resolve_cluster, search_layouts
from accelrun.plan.search import candidate_overrides
from tests.conftest import DEFAULT_CONFIG

BASE = ["train.global_batch=16", "train.micro_batch=16", "model.n_heads=6", "model.n_kv_heads=2"]


def search(cluster_file, *overrides: str, top: int = 50):
    loaded = load_plan_config(DEFAULT_CONFIG, [*BASE, *overrides], cluster=str(cluster_file))
    cluster = resolve_cluster(loaded.resolved.config.cluster)
    return loaded, cluster, search_layouts(loaded.composed, cluster, top=top)


def test_every_proposal_validates_as_a_recipe_and_fits(cluster_file, tmp_path):
    loaded, cluster, result = search(cluster_file)
    assert result.best and result.fitting >= len(result.best)
    assert result.considered > result.valid > 0  # the rules rejected some candidates
    speeds = [c.plan.tokens_per_s for c in result.best]
    assert speeds == sorted(speeds, reverse=True)
    cluster_recipe = tmp_path / "recipe.yaml"
    cluster_recipe.write_text(f"extends: [{DEFAULT_CONFIG}, {cluster_file}]\n")
    for c in result.best:
        # The line as a user would paste it, through the same loader `accelrun train` uses.
        cfg = load_config(cluster_recipe, [*BASE, *c.overrides]).config
        deg = cfg.parallel.degrees()
        assert deg["pp"] * deg["dp_replicate"] * deg["dp_shard"] * deg["cp"] * deg["tp"] == cluster.size
        assert cfg.train.seq_len % (2 * deg["cp"]) == 0
        assert cfg.model.n_heads % deg["tp"] == 0 and cfg.model.kv_heads % deg["tp"] == 0
        assert cfg.train.global_batch % (cfg.train.micro_batch * cfg.parallel.dp) == 0
        assert c.plan.fits and c.plan.memory.total <= c.plan.memory.capacity


def test_candidates_that_break_the_rules_are_never_returned(cluster_file):
    # 6 heads, 2 key/value heads: tp=4 and tp=8 must never appear, though candidates include them.
    loaded, cluster, result = search(cluster_file, top=10_000)
    tried = candidate_overrides(loaded.resolved.config, cluster)
    assert any(c["parallel.tp"] == 4 for c in tried)
    assert all("parallel.tp=4" not in c.overrides and "parallel.tp=8" not in c.overrides for c in result.best)
    assert len(result.best) == result.fitting


def test_explicit_grad_accum_is_released(cluster_file):
    _, _, result = search(cluster_file, "train.grad_accum=1", top=1)
    assert "train.grad_accum=null" in result.best[0].overrides


def test_nothing_fits_gives_an_empty_result(cluster_file):
    _, _, result = search(cluster_file, "model.dim=8192", "model.n_heads=64", "model.n_kv_heads=8",
                          "model.n_layers=80", "model.ffn_dim=28672", "train.seq_len=2048", "model.vocab_size=128256")
    assert result.best == [] and result.valid > 0


def test_sequence_and_loss_parallelism_are_searched_and_a_recipe_with_them_still_finds_tp_1(cluster_file):
    loaded, cluster, result = search(cluster_file, top=10_000)
    sharded = [c for c in result.best if c.plan.workload.layout.sequence_parallel]
    assert sharded and all(c.plan.workload.layout.tp > 1 for c in sharded)
    assert all("parallel.sequence_parallel=true" in c.line and "parallel.loss_parallel=true" in c.line
               for c in sharded)
    # A recipe that asks for sequence parallelism is not limited to tp > 1 layouts (tp=1 turns it off).
    _, _, with_sp = search(cluster_file, "parallel.nproc_per_node=2", "parallel.tp=2", "parallel.dp_shard=1", "compile.backend=eager",
                           "parallel.sequence_parallel=true", top=10_000)
    assert any(c.plan.workload.layout.tp == 1 for c in with_sp.best)
