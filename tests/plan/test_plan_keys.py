"""One test per recipe key that changes a step's memory or time: the plan moves the right way, by the
amount the formula gives (worked out here from the model's shape, not read back from the planner).

The model is tests/plan/test_plan_memory.py's (dim 64, 4 layers, SwiGLU 128, vocabulary 320, 32-token
sequences) on conftest's test cluster (4 devices a node, 1000 GB/s memory, 100 GB/s NVLink-like link).
"""

from __future__ import annotations

import pytest

from accelrun.plan import load_plan_config, predict
from accelrun.plan.comm import all_gather_s, all_reduce_s, reduce_scatter_s
from accelrun.plan.coverage import MODELLED, NO_EFFECT, UNMODELLED, schema_leaves
from accelrun.plan.memory import _stage_memory, stage_params
from accelrun.plan.timing import _chunk_time
from accelrun.plan.traffic import CLIP_BYTES_PER_PARAM, EAGER, EAGER_HEAD
from tests.conftest import DEFAULT_CONFIG
from tests.plan.test_plan_memory import BLOCK, EMB, MODEL, OUT, SAVED_FP32, D, F, H, L, V

SEQ = 32
TP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2", "train.micro_batch=4",
       "train.global_batch=4"]


def plan(cluster_file, *overrides: str):
    loaded = load_plan_config(DEFAULT_CONFIG, [*MODEL, *overrides], cluster=str(cluster_file))
    return predict(loaded.resolved.config)


def terms(p) -> dict[str, float]:
    return {t.name: t.bytes for t in p.memory.terms}


def test_every_schema_key_is_classified_once():
    leaves = set(schema_leaves())
    assert not (MODELLED & NO_EFFECT) and not (MODELLED & UNMODELLED) and not (NO_EFFECT & UNMODELLED)
    assert leaves - (MODELLED | NO_EFFECT | UNMODELLED) == set(), "classify new keys in accelrun/plan/coverage.py"
    assert (MODELLED | NO_EFFECT | UNMODELLED) - leaves == set()


def test_sequence_parallel_splits_norms_and_stream(cluster_file):
    plain = plan(cluster_file, *TP2)
    sp = plan(cluster_file, *TP2, "parallel.sequence_parallel=true")
    tokens, tp = 4 * SEQ, 2
    # fp32 eager, per token and block: replicated 24·D + 8, of which the two normalised fp32 inputs of
    # the column-parallel projections (2 × 4·D) stay whole; the rest (16·D + 8) is split 2 ways. The
    # head's final norm (8·D) is split; the output layer's input (4·D) stays whole.
    saved_less = L * (16 * D + 8) * (1 - 1 / tp) + 8 * D * (1 - 1 / tp)
    assert terms(plain)["activations"] - terms(sp)["activations"] == pytest.approx(tokens * saved_less)
    # Elementwise: two norms and the residual adds (forward + backward) and the head's D and constant
    # terms are split 2 ways.
    norm = 2 * sum(part.bytes(D, 0, F, False) for part in EAGER["fp32"]["norm"])
    rest = sum(part.bytes(D, 0, F, False) for part in EAGER["fp32"]["rest"])
    (fd, _, fc), (bd, _, bc) = EAGER_HEAD["fp32"]
    head = (fd + bd) * D + fc + bc
    mem_rate = sp.time.rates.memory_gbs * 1e9
    expected = tokens * (L * (norm + rest) + head) * (1 - 1 / tp) / mem_rate
    assert plain.time.parts["elementwise"] - sp.time.parts["elementwise"] == pytest.approx(expected)
    # All-reduces become reduce-scatter + all-gather (the same ring bytes); the embedding's all-reduce a
    # reduce-scatter.
    link = sp.cluster.intra
    act = tokens * D * 4
    per_block = 4 * (all_gather_s(act, tp, link) + reduce_scatter_s(act, tp, link))
    expected_tp = (L * per_block + reduce_scatter_s(act, tp, link) + all_gather_s(tokens * V * 4, tp, link)
                   + all_gather_s(act, tp, link) + reduce_scatter_s(act, tp, link))
    assert sp.time.parts["tensor parallel"] == pytest.approx(expected_tp)
    assert sp.time.parts["tensor parallel"] < plain.time.parts["tensor parallel"]


def test_loss_parallel_keeps_a_slice_of_the_logits(cluster_file):
    vocab = 3200  # large enough that the loss's backward is the peak either way
    plain = plan(cluster_file, *TP2, f"model.vocab_size={vocab}")
    lp = plan(cluster_file, *TP2, f"model.vocab_size={vocab}", "parallel.loss_parallel=true")
    tokens, tp = 4 * SEQ, 2
    t_plain, t_lp = terms(plain), terms(lp)
    # 16 bytes per logit without pipelining (log-softmax output, two gradients, the loop's fp32 logits)
    assert t_plain["loss: logits and gradients"] == 16 * tokens * vocab
    assert t_lp["loss: logits and gradients"] == 16 * tokens * vocab / tp
    link = lp.cluster.intra
    # No gather of the logits; three fp32 all-reduces per token instead.
    expected = all_gather_s(tokens * vocab * 4, tp, link) - 3 * all_reduce_s(4 * tokens, tp, link)
    assert plain.time.parts["tensor parallel"] - lp.time.parts["tensor parallel"] == pytest.approx(expected)
    (_, fv, _), (_, bv, _) = EAGER_HEAD["fp32"]
    mem_rate = lp.time.rates.memory_gbs * 1e9
    assert plain.time.parts["elementwise"] - lp.time.parts["elementwise"] == pytest.approx(
        tokens * (fv + bv) * vocab * (1 - 1 / tp) / mem_rate)


PP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=2",
       "train.micro_batch=4", "train.global_batch=4"]


def test_pp_layers_sets_each_stage_s_blocks(cluster_file):
    balanced = plan(cluster_file, *PP2)
    skewed = plan(cluster_file, *PP2, "parallel.pp_layers=[[0],[1,2,3]]")
    assert skewed.layout_summary()["pp_rank_layers"] == [1, 3]
    assert balanced.layout_summary()["pp_rank_layers"] == [2, 2]
    chunk = 2 * SEQ
    w_b, w_s = balanced.workload, skewed.workload
    last_b, last_s = ({t.name: t.bytes for t in _stage_memory(w, balanced.cluster, "last").terms}
                      for w in (w_b, w_s))
    assert last_s["activations"] - last_b["activations"] == chunk * SAVED_FP32  # one more block on the last stage
    assert last_s["parameters (fp32)"] - last_b["parameters (fp32)"] == 4 * BLOCK
    # The last stage (3 blocks and the output layer) sets the pace: one more block's forward and
    # backward matmuls, per chunk, for the step's 2 chunks.
    rates = skewed.time.rates
    fwd = sum(2.0 * chunk * k * o / (rates.matmul_tflops((k * o) ** 0.5) * 1e12)
              for k, o in ((D, D), (D, 32), (D, 32), (D, D), (D, F), (D, F), (F, D)))
    assert skewed.time.parts["matmuls"] - balanced.time.parts["matmuls"] == pytest.approx(2 * 3 * fwd)


PP_FSDP = ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.pp=2", "train.precision=bf16-mixed",
           "train.micro_batch=4", "train.global_batch=8"]


def test_pipeline_fsdp_accumulates_unsharded_gradients_and_reduces_once_per_flush(cluster_file):
    p = plan(cluster_file, *PP_FSDP, "parallel.microbatches=4")
    w = p.workload
    for stage in ("first", "last"):
        sp = stage_params(w, stage)
        t = {x.name: x.bytes for x in _stage_memory(w, p.cluster, stage).terms}
        assert t["accumulated gradients (FSDP, unsharded)"] == 4 * sp.local
        assert t["gathered parameters (FSDP)"] == 2 * sp.local  # nothing resharded after backward
    # Collectives of one chunk on the first stage (2 blocks + embedding), 4 micro-batches per flush:
    # gathers before min(pp, m) = 2 forwards and before all 4 backwards of a flush, one reduce-scatter
    # of each block and of the root per flush.
    first = stage_params(w, "first")
    link, m = p.cluster.intra, 4
    ag = all_gather_s(2 * first.block, 2, link)
    rs = reduce_scatter_s(4 * first.block, 2, link)
    expected = (all_gather_s(2 * first.root, 2, link) + reduce_scatter_s(4 * first.root, 2, link)) / m \
        + first.layers * ((2 + m) / m * ag + rs / m)
    c = _chunk_time(w, p.cluster, p.time.rates, "first")
    assert c.fsdp_total == pytest.approx(expected)
    # More micro-batches per flush: the reduce-scatters per step stay one per block.
    p2 = plan(cluster_file, *PP_FSDP, "parallel.microbatches=2")
    c2 = _chunk_time(p2.workload, p2.cluster, p2.time.rates, "first")
    assert c2.fsdp_total == pytest.approx(
        (all_gather_s(2 * first.root, 2, link) + reduce_scatter_s(4 * first.root, 2, link)) / 2
        + first.layers * ((2 + 2) / 2 * ag + rs / 2))
    # Per step (chunks × per chunk): one reduce-scatter per block whatever the micro-batch count.
    assert 4 * c.fsdp_total - 2 * c2.fsdp_total == pytest.approx(first.layers * 2 * ag)


def test_gradient_accumulation_repeats_the_micro_batch(cluster_file):
    base = ["parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.precision=bf16-mixed", "train.micro_batch=4"]
    one = plan(cluster_file, *base, "train.global_batch=8")
    two = plan(cluster_file, *base, "train.global_batch=16")
    assert (one.workload.grad_accum, two.workload.grad_accum) == (1, 2)
    assert two.memory.total == one.memory.total  # accumulation adds no memory: FSDP2 accumulates shards
    # Every part but the optimizer runs once per micro-batch (FSDP2 reduce-scatters after each one).
    for name, s in one.time.parts.items():
        assert two.time.parts[name] == pytest.approx(s if name == "optimizer" else 2 * s), name


def test_grad_clip_off_drops_the_clipping_pass(cluster_file):
    on = plan(cluster_file, "train.micro_batch=4", "train.global_batch=4")
    off = plan(cluster_file, "train.micro_batch=4", "train.global_batch=4", "train.grad_clip=null")
    params = L * BLOCK + D + EMB + OUT
    assert on.time.parts["optimizer"] - off.time.parts["optimizer"] == pytest.approx(
        CLIP_BYTES_PER_PARAM * params / (on.time.rates.memory_gbs * 1e9))


def test_compiled_fsdp_keeps_gathered_parameters(cluster_file):
    base = ["parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=4", "train.global_batch=8",
            "compile.backend=accelrun"]
    fsdp2 = plan(cluster_file, *base)
    compiled = plan(cluster_file, *base, "parallel.fsdp_impl=compiled")
    kept = plan(cluster_file, *base, "parallel.reshard_after_forward=false")
    assert terms(compiled)["gathered parameters (FSDP)"] == terms(kept)["gathered parameters (FSDP)"] == \
        4 * (EMB + OUT + D + L * BLOCK)
    assert terms(fsdp2)["gathered parameters (FSDP)"] == 4 * (EMB + OUT + D + 2 * BLOCK)
    assert any("fsdp_impl = compiled" in n for n in compiled.notes)


def test_keys_not_modelled_are_named(cluster_file):
    p = plan(cluster_file, "compile.backend=accelrun", "compile.scope=model", "compile.debug_numerics=true",
             "report.profile_steps=[3,4]")
    text = "\n".join(p.unmodelled)
    for key in ("compile.passes", "compile.executors", "compile.scope = model", "compile.debug_numerics",
                "report.profile_steps", "checkpoint.every"):
        assert key in text, key
    quiet = plan(cluster_file, "checkpoint.enabled=false")
    assert quiet.unmodelled == ()


def test_h_is_the_test_model_s_heads():
    assert H == 4  # the SAVED_FP32 figures above assume it


def test_gpipe_gathers_for_every_forward_and_the_first_backward(cluster_file):
    p = plan(cluster_file, *PP_FSDP, "parallel.microbatches=4", "parallel.pp_schedule=gpipe")
    first = stage_params(p.workload, "first")
    link, m = p.cluster.intra, 4
    ag = all_gather_s(2 * first.block, 2, link)
    rs = reduce_scatter_s(4 * first.block, 2, link)
    expected = (all_gather_s(2 * first.root, 2, link) + reduce_scatter_s(4 * first.root, 2, link)) / m \
        + first.layers * ((m + 1) / m * ag + rs / m)
    assert _chunk_time(p.workload, p.cluster, p.time.rates, "first").fsdp_total == pytest.approx(expected)
    kept = plan(cluster_file, *PP_FSDP, "parallel.microbatches=4", "parallel.reshard_after_forward=false")
    expected_kept = (all_gather_s(2 * first.root, 2, link) + reduce_scatter_s(4 * first.root, 2, link)) / m \
        + first.layers * (ag + rs) / m  # one gather and one reduce-scatter per flush
    assert _chunk_time(kept.workload, kept.cluster, kept.time.rates, "first").fsdp_total == pytest.approx(expected_kept)
