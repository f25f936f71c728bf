"""train.activation_checkpoint.mode = selective: the same losses and gradients as no checkpointing, and
backward really reruns only the matmuls the policy did not keep (3 of a Llama block's 7: wk, wo, w3;
2 of 5 under accelrun's compiler, which merges q/k/v), eager, under accelrun's compiler and Inductor,
and with FSDP on 2 ranks.

The rerun is counted where it happens: every matmul that runs during ``loss.backward()`` (a dispatch
mode sees the compiled graphs' matmuls too). Without checkpointing backward runs two per linear
(input and weight gradients); full checkpointing adds the block's forward matmuls again (6 of 7), selective 3.
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from accelrun.config.schema import ActivationCheckpointConfig
from accelrun.dist.activation_checkpoint import apply_activation_checkpointing
from accelrun.dist.selective_checkpoint import SelectivePolicy
from accelrun.models.families.llama.model import Llama, LlamaArgs
from tests.dist.jobs import FSDP2, losses
from tests.dist.rank_harness import run_ranks

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64)
# Full: the forward's 7 but the last (w2): non-reentrant checkpointing stops its rerun once backward has
# every tensor it needs, and nothing needs w2's output.
RERUN_PER_BLOCK = {"none": 0, "selective": 3, "full": 6}
RTOL = 1e-5

aten = torch.ops.aten


class MatmulsRun(TorchDispatchMode):
    """Matmuls dispatched while active (mm, addmm, bmm, any overload: compiled code calls ``mm.out``; and
    oneDNN's linear, what accelrun's cpu_gemm runs an fp32 product through where it is faster)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def matmuls(self) -> int:
        return self.ops["mm"] + self.ops["addmm"] + self.ops["bmm"] + self.ops["_linear_pointwise"]


def test_policy_keeps_every_second_matmul_and_attention_in_forward_and_rerun_alike():
    policy = SelectivePolicy()
    forward, rerun = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    # A Llama block's forward: wq wk wv (attention) wo w1 w3 w2, with pointwise ops between.
    ops = [aten.mm.default] * 3 + [aten.mul.Tensor, aten._scaled_dot_product_flash_attention_for_cpu.default] \
        + [aten.mm.default] * 4
    want = [save, again, save, again, save, again, save, again, save]
    assert [policy(forward, op) for op in ops] == want
    assert [policy(rerun, op) for op in ops] == want  # the rerun counts its own matmuls from 1
    # addmm (q, k, v biases) and bmm count as matmuls too: the forward's 8th and 9th.
    assert [policy(forward, aten.addmm.default), policy(forward, aten.bmm.default)] == [again, save]
    assert policy(forward, torch.ops._c10d_functional.reduce_scatter_tensor.default) == save
    assert policy(forward, aten.silu.default) == again


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ARGS)
    model.init_weights(seed=0)
    return model


def _step(model: Llama, mode: str, backend: str) -> tuple[torch.Tensor, list[torch.Tensor], MatmulsRun]:
    model = copy.deepcopy(model)
    assert apply_activation_checkpointing(model.layers, ActivationCheckpointConfig(mode=mode)) == (
        0 if mode == "none" else ARGS.n_layers)
    record = None
    if backend == "accelrun":
        from accelrun.compile.backend import AccelrunBackend

        compiler = AccelrunBackend()
        record = compiler.record
    else:
        compiler = backend
    if backend != "eager":
        torch._dynamo.reset()
        for block in model.layers:
            block.compile(backend=compiler)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, ARGS.vocab_size, (2, 32), generator=g) for _ in range(2))
    loss = model(tokens, targets)
    with MatmulsRun() as backward:
        loss.backward()
    if record is not None:
        assert record.dynamo_graphs >= 1 and record.graphs, "accelrun compiled nothing"
        if mode != "none":  # the pre-grad passes entered the checkpointed block's body
            inside = {p.name: p.counts.get("matched", 0) for p in record.passes if "wrap_body" in p.graph}
            assert inside.get("fuse_rmsnorm") == 2 and inside.get("fuse_swiglu") == 1, inside
    return loss.detach(), [p.grad for p in model.parameters()], backward


@pytest.fixture(scope="module")
def eager_none():
    return _step(_model(), "none", "eager")


def _assert_same(got, want) -> None:
    (loss, grads, _), (loss0, grads0, _) = got, want
    torch.testing.assert_close(loss, loss0, rtol=RTOL, atol=0)
    for g, g0 in zip(grads, grads0, strict=True):
        torch.testing.assert_close(g, g0, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_eager_checkpointing_reruns_the_matmuls_it_did_not_keep(mode, eager_none):
    got = _step(_model(), mode, "eager")
    _assert_same(got, eager_none)
    assert got[2].matmuls == eager_none[2].matmuls + RERUN_PER_BLOCK[mode] * ARGS.n_layers


# Under accelrun's compiler the pre-grad passes enter the checkpointed block, and q/k/v (grouped-query:
# k and v are narrow) become one matmul: the forward's matmuls are wq+wk+wv wo w1 w3 w2, the policy keeps
# the 1st, 3rd and 5th, backward reruns wo and w3. The merged projection's backward is 2 matmuls, not 6.
ACCELRUN_RERUN_PER_BLOCK = 2
MERGED_QKV_SAVES_PER_BLOCK = 4


@pytest.mark.parametrize("backend", ["accelrun", "inductor"])
def test_compiled_selective_applies_the_policy(backend, eager_none):
    """Dynamo traces the checkpoint into a tagged region and the partitioner cuts along the policy's tags:
    backward reruns the matmuls the policy did not keep, not 0 (tags lost: everything saved) nor all."""
    got = _step(_model(), "selective", backend)
    _assert_same(got, eager_none)
    if backend == "accelrun":
        want = eager_none[2].matmuls + (ACCELRUN_RERUN_PER_BLOCK - MERGED_QKV_SAVES_PER_BLOCK) * ARGS.n_layers
    else:
        want = eager_none[2].matmuls + RERUN_PER_BLOCK["selective"] * ARGS.n_layers
    assert got[2].matmuls == want, got[2].ops
    # Compiled: backward runs far fewer ops than eager's (fused regions, no per-op autograd).
    assert sum(got[2].ops.values()) < sum(eager_none[2].ops.values())


def test_selective_with_fsdp_on_two_ranks_matches_one_process(tmp_path, reference):
    run_dir, ranks = run_ranks(tmp_path, 2, 3, [*FSDP2[1:], "checkpoint.enabled=false",
                                                "train.activation_checkpoint.mode=selective"], "selective_policy")
    blocks = 3 * 2  # steps x layers, each block's forward once per step
    for rank, r in enumerate(ranks):
        assert r["code"] == 0 and r["exitcode"] == 0, (rank, r)
        # Each rank decided for every matmul of every block's forward: 4 of 7 kept, and attention's output.
        # (torch replays the forward's decisions in backward's rerun rather than asking again.)
        assert r.get("forward MUST_SAVE mm") == 4 * blocks, sorted(r.items())
        assert r.get("forward PREFER_RECOMPUTE mm") == 3 * blocks, sorted(r.items())
        assert r.get("forward MUST_SAVE _scaled_dot_product_flash_attention_for_cpu") == blocks, sorted(r.items())
    assert losses(run_dir) == pytest.approx(reference(3).losses, rel=RTOL)


def test_selective_checkpointing_leaves_torchs_context_fn_notice_off_the_console_and_the_cache_says_why():
    """A new user's run of the README's selective example printed four raw torch log lines about the
    context_fn accelrun passed, and its report said the block was "wrapped (activation checkpointing?)"."""
    import logging

    from accelrun.compile.graph_cache import decline_reason
    from accelrun.config.schema import ActivationCheckpointConfig, CompileConfig
    from accelrun.dist.activation_checkpoint import apply_activation_checkpointing
    from tests.logs import logged

    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    apply_activation_checkpointing(blocks, ActivationCheckpointConfig(mode="selective"))
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    with logged("torch._higher_order_ops.wrap") as seen:
        logger.warning("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\n")
        logger.warning("another")
    assert seen == ["another"]
    said = decline_reason(CompileConfig(backend="accelrun"), [(blocks[0], "forward")])
    assert said == "Linear.forward is checkpointed (train.activation_checkpoint): a checkpointed block is compiled afresh"
