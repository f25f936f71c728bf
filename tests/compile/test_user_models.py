"""Every model a user brings gets compiled (issue 31): torch.nn's own modules in the repeated lists, a
mixture of experts routed by boolean masks, convolutions with GroupNorm, no list at all. Each trains
three steps through accelrun's default scope at eager's losses and gradients, and the compile record
shows that compiled code ran (graphs and fusion regions), with no "nothing was compiled" warning."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from accelrun.compile.compile_model import compile_model, repeated_blocks, resolve_scope
from accelrun.config.schema import CompileConfig
from accelrun.models.build import training_loss_fn, transformer_blocks
from tests.compile.user_models import USER_MODELS, VOCAB, CausalMHABlocks

LOSS_TOL, GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}, {"rtol": 1e-5, "atol": 1e-5}


def _train_side_by_side(model, reference, steps=3, lengths=(16,), loss_tol=LOSS_TOL, grad_tol=GRAD_TOL):
    """Losses and gradients of the compiled model and its eager copy, step by step (SGD, same data);
    the batches' sequence lengths go round ``lengths``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = (torch.randint(0, VOCAB, (2, lengths[step % len(lengths)]), generator=gen) for _ in range(2))
        loss, loss_ref = training_loss_fn(model)(x, y), training_loss_fn(reference)(x, y)
        loss.backward()
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref, **loss_tol)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **grad_tol, msg=name)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()


def _compiled_beside_eager(model, tmp_path, steps: int, **side_by_side):
    """``model`` compiled by accelrun (C++ and ATen executors) and trained ``steps`` steps beside an eager
    copy (``_train_side_by_side``, given ``side_by_side``: lengths, tolerances); its compile record."""
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, None, cfg).record
    _train_side_by_side(model, reference, steps=steps, **side_by_side)
    return record


@pytest.mark.parametrize("name", sorted(USER_MODELS))
def test_a_users_model_compiles_under_the_default_scope_at_eagers_losses(name, tmp_path):
    torch.manual_seed(0)
    model = USER_MODELS[name]()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    assert cfg.scope == "auto"
    compiled = compile_model(model, transformer_blocks(model), cfg)
    _train_side_by_side(model, reference)
    record = compiled.record
    assert record.graphs_in_use() > 0, record.compiled_line()
    assert record.regions_per_executor().get("cpp", 0) > 0, record.compiled_line()
    assert not any(w.startswith("nothing was compiled") for w in record.warnings()), record.warnings()


def test_multihead_attention_under_a_causal_mask_runs_the_causal_kernel(tmp_path):
    """``F.multi_head_attention_forward`` reaches the graph whole, its mask a float 0 / -inf one that no
    kernel skips work on: ``fuse_attention`` unfolds it into SDPA with ``is_causal`` (head_dim 16), and
    ``cpu_attention`` gives that to the C++ kernel; eager's losses and gradients over 3 steps."""
    torch.manual_seed(0)
    model = CausalMHABlocks()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, None, cfg).record
    _train_side_by_side(model, reference)
    counts = {p.name: p.counts for p in record.passes if p.graph.endswith("pre_grad")}
    assert counts["fuse_attention"].get("multihead") == 2, counts
    assert counts["cpu_attention"].get("matched") == 2, counts


def test_multihead_attention_given_its_mask_by_the_model_runs_the_kernel_on_it(tmp_path):
    """The mask made once outside the blocks reaches each block's graph as an input: ``fuse_attention``
    unfolds the attention into SDPA with that mask, and ``cpu_attention_masked`` sees it is causal when
    it runs. It had stayed in torch.nn's attention with no word (0 matched; found by a walk)."""
    from accelrun.compile.fused import attention as kernel
    from tests.compile.user_models import MaskedMHALayers

    torch.manual_seed(0)
    model = MaskedMHALayers()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    assert "repeated MaskedMHABlock blocks" in compiled.description
    before = dict(kernel.masked_calls)
    _train_side_by_side(model, reference)
    counts = {p.name: p.counts for p in compiled.record.passes if p.graph.endswith("pre_grad")}
    assert counts["fuse_attention"].get("multihead") == 1 and counts["cpu_attention"].get("matched") == 1, counts
    assert kernel.masked_calls["kernel"] - before["kernel"] == 2 * 3 and kernel.masked_calls["aten"] == before["aten"]


@pytest.mark.parametrize("graph_cache", [True, False])
def test_checkpointed_multihead_attention_blocks_compile_on_their_first_step(graph_cache, tmp_path):
    """Blocks under non-reentrant ``torch.utils.checkpoint``, compiled in the first step's forward: the
    checkpoint counts every tensor saved while the block runs, and the fake values ``fuse_attention``
    gave its new nodes were counted too (30 in the forward, 21 in the recomputation: "A different
    number of tensors was saved"; a later process, loading the saved entry, compiled nothing and ran). Losses and gradients
    equal eager's from the first step, the attention unfolded and in the kernel."""
    from tests.compile.user_models import CheckpointedMHALayers

    torch.manual_seed(0)
    model = CheckpointedMHALayers()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"),
                        graph_cache=graph_cache)  # fmt: skip
    compiled = compile_model(model, transformer_blocks(model), cfg)
    _train_side_by_side(model, reference, steps=2)
    counts = {p.name: p.counts for p in compiled.record.passes if p.graph.endswith("pre_grad")}
    assert counts["fuse_attention"].get("multihead") == 1 and counts["cpu_attention"].get("matched") == 1, counts
    assert compiled.record.graphs_in_use() >= 1 and not compiled.record.graph_breaks


def test_of_two_lists_at_one_depth_the_blocks_are_the_one_with_the_most_parameters():
    class Adapter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.scale

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.adapters = torch.nn.ModuleList([Adapter(), Adapter()])  # declared first, and smaller
            self.layers = torch.nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x):
            for adapter in self.adapters:
                x = adapter(x)
            for layer in self.layers:
                x = layer(x)
            return x

    net = Net()
    assert repeated_blocks(net) == ("layers", list(net.layers))


def test_lists_of_torch_nn_modules_are_not_taken_as_blocks():
    """Dynamo never traces torch.nn's own frames on their own: compiling nn.MultiheadAttention or an
    nn.Sequential by itself compiles nothing, so the whole forward is compiled instead."""
    mha = USER_MODELS["mha"]()
    assert repeated_blocks(mha) is None
    assert repeated_blocks(mha, builtins=True)[0] == "mlps"  # the larger of its two lists at one depth
    cfg = CompileConfig(backend="accelrun")
    assert resolve_scope(cfg, mha, None)[0] == "model"
    # An explicit block scope on such a model compiles the whole forward too, and says so.
    compiled = compile_model(mha, None, CompileConfig(backend="accelrun", scope="block", graph_cache=False,
                                                      executors=["cpp", "aten"]))  # fmt: skip
    assert "the whole model" in compiled.description
    mha(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    assert compiled.record.dynamo_graphs >= 1


def test_a_skipped_forward_falls_back_to_its_repeated_modules(tmp_path):
    """The routed mixture's loop branches on data, so Dynamo skips its whole forward; after the first
    call the experts compile one by one, and the record says so."""
    torch.manual_seed(0)
    model = USER_MODELS["routed_moe"]()
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, None, cfg)
    x = torch.randint(0, VOCAB, (2, 16))
    model(x).sum().backward()
    assert compiled.record.graphs_in_use() == 0  # the first call: eager
    assert "experts" in compiled.record.fallback_scope
    model(x).sum().backward()
    assert compiled.record.graphs_in_use() >= 1
    assert "compile one by one" in compiled.record.compiled_line()


def test_a_users_subclass_that_keeps_torchs_forward_is_compiled_as_torchs_own():
    """``class MyLayer(nn.TransformerEncoderLayer)`` with an ``__init__`` of its own: its forward is torch's
    code, which Dynamo traces only from a frame it traces (precompiled on its own, the module reached
    the graph where a tensor belonged: "native_layer_norm() Expected a value of type 'Tensor'")."""
    from accelrun.compile.compile_model import is_torch_builtin
    from tests.compile.user_models import BuiltEncoderLayer, MixerBlock

    assert is_torch_builtin(BuiltEncoderLayer) and is_torch_builtin(torch.nn.Linear)
    assert not is_torch_builtin(MixerBlock)  # a forward of the user's own


def test_a_model_that_is_a_bare_sequential_compiles_and_loads_from_the_graph_cache(tmp_path):
    """A factory that returns ``nn.Sequential(...)``: the whole forward is torch's own code, traced from a
    frame of accelrun's (precompiled on its own, the model reached the graph where the token ids belonged:
    "embedding() Expected a value of type 'Tensor' ... found type 'Sequential'"). A second compile of a
    new copy loads the saved entry; both train at eager's losses."""
    from tests.compile.user_models import sequential_lm

    torch.manual_seed(0)
    first = sequential_lm()
    second, reference = copy.deepcopy(first), copy.deepcopy(first)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    records = []
    for model in (first, second):
        compiled = compile_model(model, transformer_blocks(model), cfg)
        assert "the whole model" in compiled.description
        _train_side_by_side(model, copy.deepcopy(reference), steps=2)
        records.append(compiled.record)
    assert records[0].graph_cache["compiled"] == 1 and records[0].graph_cache["saved"] == 1
    assert records[1].graph_cache["loaded"] == 1 and records[1].graph_cache["compiled"] == 0
    assert records[1].regions_per_executor().get("cpp", 0) > 0 and not records[1].graph_breaks


def test_a_graph_loaded_from_the_cache_reports_what_its_passes_did(tmp_path, monkeypatch):
    """The attention the passes left to ATen (a window mask), every pass that changed a graph, and a
    pass that failed (skipped for that graph) are saved with the graph: a process that loads it reports
    them as the compiling one did (its report had said nothing of the attention)."""
    import dataclasses

    from accelrun.compile.passes import base
    from tests.compile.user_models import WindowAttentionLM

    def raising(gm, options, ctx):
        raise ValueError("a bug in a pass")

    torch.manual_seed(0)
    first = WindowAttentionLM()
    second = copy.deepcopy(first)
    records = []
    for model in (first, second):
        with monkeypatch.context() as patched:  # the compiling process's simplify fails
            if model is first:
                patched.setitem(base._REGISTRY, "simplify", dataclasses.replace(base._REGISTRY["simplify"], fn=raising))
            cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
            compiled = compile_model(model, transformer_blocks(model), cfg)
            training_loss_fn(model)(*(torch.randint(0, VOCAB, (2, 16)) for _ in range(2))).backward()
        records.append(compiled.record)
    cold, cached = records
    assert cached.graph_cache["loaded"] == 1 and cached.graph_cache["compiled"] == 0
    assert cold.attention_left_to_aten() == {"a mask other than the causal one": 1}
    assert cached.attention_left_to_aten() == cold.attention_left_to_aten()
    assert cached.passes_fired() == cold.passes_fired() and all(p.seconds == 0 for p in cached.passes)
    assert {(f.stage, f.what) for f in cold.fallbacks} == {("pass", "simplify")}
    assert cached.fallbacks == cold.fallbacks
    # which function the graph was traced from, though torch's precompile calls the backend after its trace
    assert cold.traced_functions["g0"].startswith("WindowAttentionLM.forward (compile/user_models.py:")


def test_layers_of_containers_compile_the_whole_forward():
    """A user's ``layers`` of ``nn.ModuleDict``: compiled as blocks, nothing was (the forward reads them,
    never calls them: 0 graphs, "nothing was compiled"); auto compiles the whole forward and says why,
    also where each container holds a list of its own (not taken for the model's blocks)."""
    model = USER_MODELS["dict_layers"]()
    compiled = compile_model(model, transformer_blocks(model), CompileConfig(backend="accelrun", graph_cache=False))
    assert "the whole model" in compiled.description and "ModuleDict containers" in compiled.description
    for layer in model.layers:
        layer["heads"] = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        layer["experts"] = torch.nn.ModuleList(USER_MODELS["plain_mlp"]() for _ in range(2))
    assert repeated_blocks(model) is None  # layers.0.experts is one layer's list
    assert "the whole model" in compile_model(model, transformer_blocks(model),
                                              CompileConfig(backend="accelrun", graph_cache=False)).description


def test_blocks_the_forward_never_calls_fall_back_to_the_whole_forward(tmp_path):
    """Blocks of the user's own class that the forward reaches through another method (``layer.mix``):
    the first step runs eagerly, finds no graph ran, and the whole forward compiles from the second."""
    from tests.compile.user_models import MethodCalledBlocks

    torch.manual_seed(0)
    model = MethodCalledBlocks()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    assert "transformer blocks" in compiled.description
    _train_side_by_side(model, reference, steps=1)
    assert compiled.record.graphs_in_use() == 0 and "whole forward compiles" in compiled.record.fallback_scope
    _train_side_by_side(model, reference, steps=2)
    assert compiled.record.graphs_in_use() >= 1 and compiled.record.regions_per_executor().get("cpp", 0) > 0
    assert "forward" not in model.__dict__  # the first forward's wrapper is gone
    assert not any(w.startswith("nothing was compiled") for w in compiled.record.warnings())


def test_blocks_dynamo_skips_are_said_to_have_run_eagerly_not_to_be_uncalled(tmp_path):
    """A trial's mixture (a branch on the data in the loop over its experts): the report said "no compiled
    block ran in the first forward (a forward that calls another method of the blocks, or none of
    them)" of blocks that ran, whose frame Dynamo skipped. It says that, and why; the losses are eager's."""
    from tests.compile.user_models import SkippedMoELM

    torch.manual_seed(0)
    model = SkippedMoELM()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    torch._dynamo.reset()
    _train_side_by_side(model, reference, steps=1)
    said = compiled.record.fallback_scope
    assert said.startswith("Dynamo skipped the SkippedMoEBlock blocks' forward (Data-dependent branching"), said
    assert said.endswith("so from the next one the whole forward compiles") and "no compiled block ran" not in said
    _train_side_by_side(model, reference, steps=2)
    torch._dynamo.reset()


def test_a_graph_break_in_torch_nn_names_the_users_line_and_the_change_that_avoids_it(tmp_path):
    """torch.nn's TransformerEncoder given a causal mask without is_causal=True reads the mask on the
    host: Dynamo's reason names neither the place nor that fix (it suggests tracing the host read).
    The record's warning names the user's line, torch's function and the change; made, the model
    compiles as one graph at the same losses."""
    import inspect

    from tests.compile import user_models

    line = next(i for i, text in enumerate(inspect.getsource(user_models).splitlines(), 1)
                if "self.encoder(self.embed(tokens), mask=mask" in text)  # fmt: skip
    records = {}
    for hint in (False, True):
        torch.manual_seed(0)
        model = USER_MODELS["encoder"](causal_hint=hint)
        reference = copy.deepcopy(model)
        cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / str(hint)))
        records[hint] = compile_model(model, None, cfg).record
        _train_side_by_side(model, reference, steps=2)
    without, with_hint = records[False], records[True]
    (warning,) = [w for w in without.warnings() if "graph break" in w]
    assert f"at compile/user_models.py:{line} (in torch's modules/transformer.py" in warning, warning
    assert "_detect_is_causal_mask); to avoid it: pass is_causal=True" in warning, warning
    assert sum(without.graph_breaks.values()) >= 1 and without.graphs_in_use() >= 2
    assert not with_hint.graph_breaks and with_hint.graphs_in_use() == 1, with_hint.compiled_line()
    assert not [w for w in with_hint.warnings() if "graph break" in w]


def test_layers_a_graph_break_left_eager_compile_one_by_one_after_the_first_step(tmp_path):
    """Without is_causal=True, TransformerEncoder breaks the graph on the host read of its mask, and the
    rest of its forward (every layer) ran in torch.nn's frames, which Dynamo does not compile: the run
    was eager but for the embedding and the head (0.99x eager at dim 256). After the first step the
    layers no graph took compile one by one, the record says so, and the losses and gradients stay
    eager's over steps that run them compiled."""
    torch.manual_seed(0)
    model = USER_MODELS["encoder"](causal_hint=False)
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, None, cfg).record
    layer_weights = {id(p) for p in model.encoder.layers.parameters()}
    _train_side_by_side(model, reference, steps=1)
    assert not layer_weights & record.parameters_in_graphs  # the first step: the layers ran in no graph
    assert record.fallback_scope == ("the 2 TransformerEncoderLayer modules of `encoder.layers` ran outside every "
                                     "graph after a graph break, so after the first step they compile one by one")
    graphs_after_first = record.graphs_in_use()
    _train_side_by_side(model, reference, steps=3)
    # the layers' graph took the first layer's weights (the second shares its graph)
    assert {id(p) for p in model.encoder.layers[0].parameters()} <= record.parameters_in_graphs
    assert record.graphs_in_use() > graphs_after_first, record.compiled_line()
    assert "compile one by one" in record.compiled_line()


def test_a_graph_break_that_leaves_no_layer_out_compiles_nothing_more(tmp_path):
    """A graph break whose pieces still take every block's weights (a branch on a tensor's value in the
    model's own code, between its blocks) leaves the blocks as they are: no fallback."""

    class BranchBetweenBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, tokens):
            x = self.blocks[0](self.embed(tokens))
            if x.abs().max() > 10:  # a graph break between the blocks
                x = x / 10
            return self.head(self.blocks[1](x))

    torch.manual_seed(0)
    model = BranchBetweenBlocks()
    record = _compiled_beside_eager(model, tmp_path, steps=2)
    assert sum(record.graph_breaks.values()) >= 1 or record.dynamo.get("graph_breaks"), record.compiled_line()
    assert {id(p) for p in model.blocks[0].parameters()} <= record.parameters_in_graphs
    assert record.fallback_scope == ""


def test_a_branch_on_a_tensor_s_value_is_counted_as_a_graph_break_with_its_line(tmp_path):
    """Dynamo counts a break at `if tensor:` only among its "unimplemented" reasons (torch 2.13): the
    record said "graph breaks 0" for a model split in two by one. It is counted, with its line and
    what avoids it, and the losses are eager's."""
    import inspect

    class ClampsLargeEmbeddings(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, tokens):
            x = self.embed(tokens)
            if x.abs().max() > 10:  # the branch
                x = x / x.abs().max()
            return self.head(x + self.mlp(x))

    line = next(i for i, text in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1)
                if "# the branch" in text)  # fmt: skip
    torch.manual_seed(0)
    model = ClampsLargeEmbeddings()
    record = _compiled_beside_eager(model, tmp_path, steps=2)
    record.refresh_dynamo()
    assert sum(record.graph_breaks.values()) == 1 and record.graphs_in_use() == 2, record.compiled_line()
    assert "1 graph break(s)" in record.compiled_line()
    (warning,) = [w for w in record.warnings() if "graph break" in w]
    assert f"at compile/test_user_models.py:{line}; to avoid it: make the branch a computation" in warning, warning


def test_a_host_read_check_in_a_loop_says_what_still_compiled_and_what_avoids_it(tmp_path):
    """A habit of users' (found by a new-user trial): an overflow check with ``.item()`` after each block,
    the blocks in a plain list. Dynamo skips the forward (a break inside a loop) and compiles the blocks
    it calls on their own: the skipped frame's warning said "ran eagerly" beside a run line of compiled
    graphs, and no line said what avoids the break."""
    import inspect

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class CheckedBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)
            self.block_list = [Block(), Block()]  # no nn.ModuleList: registered by name
            for i, block in enumerate(self.block_list):
                self.add_module(f"block{i}", block)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.block_list:
                x = block(x)
                if x.abs().max().item() > 1e4:  # the check
                    print("activation blew up")
            return self.head(x)

    line = next(i for i, text in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1)
                if "# the check" in text)  # fmt: skip
    torch.manual_seed(0)
    record = _compiled_beside_eager(CheckedBlocks(), tmp_path, steps=2)
    record.refresh_dynamo()
    assert record.graphs_in_use() >= 1, record.compiled_line()
    warnings = record.warnings()
    (skipped,) = [w for w in warnings if w.startswith("Dynamo skipped a frame")]
    assert "ran eagerly (what it calls was traced apart, into the run's graphs): Unsupported Tensor.item()" \
        in skipped, skipped
    (breaks,) = [w for w in warnings if "graph break(s)" in w]
    assert f"at compile/test_user_models.py:{line}; to avoid it: keep the value a tensor" in breaks, breaks
    assert "to avoid it" not in skipped  # said once


def test_an_rnn_runs_eagerly_between_compiled_graphs_and_the_break_says_so(tmp_path):
    """A GRU held as an attribute (tests/compile/user_models.py's GRULM): Dynamo does not trace RNN
    modules, and meeting one as it read ``self.rnn`` it skipped the whole forward. Read through an
    ``EagerCall``, the GRU runs eagerly at a graph break and the code around it compiles; the model's
    parameter names and torch.distributed.checkpoint's view of it stay as they were."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from tests.compile.user_models import GRULM

    model = GRULM()
    names = list(model.state_dict())
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", cache_dir=str(tmp_path / "cache"),
                                                        executors=["cpp", "aten"]))  # fmt: skip
    assert compiled.description.endswith("; rnn (GRU) runs eagerly at a graph break"), compiled.description
    assert list(model.state_dict()) == names and list(get_model_state_dict(model)) == names
    saved = GRULM().state_dict()
    set_model_state_dict(model, saved)  # as a resumed run loads its checkpoint
    gru = model._modules["rnn"]
    torch.testing.assert_close(gru.weight_hh_l1, saved["rnn.weight_hh_l1"], rtol=0, atol=0)
    assert isinstance(gru, torch.nn.GRU) and model.rnn.hidden_size == 32
    assert model.get_parameter("rnn.weight_ih_l0") is gru.weight_ih_l0  # paths through the stand-in reach it
    line = GRULM.forward.__code__.co_firstlineno + 1
    model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    record = compiled.record
    record.refresh_dynamo()
    assert record.graphs_in_use() == 2 and sum(record.graph_breaks.values()) == 1, record.compiled_line()
    (warning,) = [w for w in record.warnings() if "graph break" in w]
    assert f"at compile/user_models.py:{line}: an RNN, GRU or LSTM of torch.nn runs eagerly there" in warning, warning
    assert not any(w.startswith("nothing was compiled") for w in record.warnings())
    # what an RNN defines over nn.Module's is the RNN's: its forward, its repr, its _apply (flat weights)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(model.rnn.forward(x)[0], gru(x)[0], rtol=0, atol=0)
    assert model.rnn.extra_repr() == gru.extra_repr() == "32, 32, num_layers=2, batch_first=True"
    assert model.rnn.double() is model.rnn and gru._flat_weights[0].dtype == torch.float64
    model.float()
    assert compile_model(model, None, CompileConfig(backend="accelrun", graph_cache=False)).description.endswith(
        "; rnn (GRU) runs eagerly at a graph break")  # a second compile still says so


def test_fullgraph_over_an_rnn_is_a_recipe_error_before_anything_compiles(tmp_path):
    """compile.fullgraph = true refuses the graph break an RNN must run at: said as the recipe's error
    (exit 2), where a new user's LSTM model met Dynamo's traceback at its first step."""
    from accelrun.config import ConfigError
    from tests.compile.user_models import GRULM

    cfg = CompileConfig(backend="accelrun", fullgraph=True, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"compile.fullgraph = true, but rnn \(GRU\) inside the compiled code "
                                          r"must run eagerly at a graph break .*set compile.fullgraph=false"):
        compile_model(GRULM(), None, cfg)


class _WithInitialState(torch.nn.Module):
    """An LSTM language model that builds its initial state from the LSTM's own settings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.rnn = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        h0 = x.new_zeros(self.rnn.num_layers, x.shape[0], self.rnn.hidden_size)
        return self.head(self.rnn(x, (h0, h0))[0])


def test_an_rnn_whose_settings_the_forward_reads_runs_at_a_graph_break(tmp_path):
    """The settings a forward reads through the attribute (``self.rnn.hidden_size``) are copied onto the
    stand-in, where Dynamo reads them as constants; the first version of the stand-in left this model
    with 0 graphs under a description that claimed the break. A setting changed through the attribute
    reaches the LSTM and the copy."""
    torch.manual_seed(0)
    model = _WithInitialState()
    reference = copy.deepcopy(model)
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", cache_dir=str(tmp_path / "cache"),
                                                        executors=["cpp", "aten"]))  # fmt: skip
    assert compiled.description.endswith("; rnn (LSTM) runs eagerly at a graph break"), compiled.description
    _train_side_by_side(model, reference)
    record = compiled.record
    record.refresh_dynamo()
    assert record.graphs_in_use() == 2 and sum(record.graph_breaks.values()) == 1, record.compiled_line()
    assert model.rnn.__dict__["hidden_size"] == 8 and "dropout" not in model.rnn.__dict__  # only what is read
    model.rnn.hidden_size = 8  # (the same value: the model still computes as before)
    assert model.rnn.__dict__["hidden_size"] == model._modules["rnn"].hidden_size == 8


def test_an_rnn_the_forward_tests_or_reads_weights_of_is_left_as_it_is():
    """Where the model's code does more with the attribute than call it and read its settings (passes
    it to ``isinstance``, reads a weight through it), no stand-in is put there: the test would answer
    otherwise, and Dynamo could not read through it. The model keeps its LSTM and computes what it did."""

    class Branching(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 8, batch_first=True)

        def forward(self, x):
            out, state = self.rnn(x)
            return out + (state[1].sum() if isinstance(self.rnn, torch.nn.LSTM) else 0)

    class ReadsAWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 8, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0] * self.rnn.weight_hh_l0.shape[0]

    for cls in (Branching, ReadsAWeight):
        model = cls()
        x = torch.randn(2, 5, 8)
        expected = model(x)
        compiled = compile_model(model, None, CompileConfig(backend="accelrun", graph_cache=False, executors=["aten"]))
        assert type(model.rnn) is torch.nn.LSTM and "graph break" not in compiled.description, cls.__name__
        torch.testing.assert_close(model(x), expected)


def test_a_model_dynamo_cannot_trace_says_why_and_what_it_means():
    """GRUs in an ``nn.ModuleList`` (torch's container reads them itself, so no ``EagerCall`` stands in):
    Dynamo skips the whole forward. The warning names that reason and what it means, not the advice
    for data-dependent code."""

    class StackedGRU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.rnns = torch.nn.ModuleList(torch.nn.GRU(16, 16, batch_first=True) for _ in range(2))
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, tokens):
            x = self.embed(tokens)
            for rnn in self.rnns:
                x, _ = rnn(x)
            return self.head(x)

    model = StackedGRU()
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", graph_cache=False, executors=["aten"]))
    model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    compiled.record.refresh_dynamo()
    (nothing,) = [w for w in compiled.record.warnings() if w.startswith("nothing was compiled")]
    assert "Dynamo could not trace: Attempted to wrap RNN, GRU, or LSTM" in nothing, nothing
    assert "does not trace torch.nn's RNN, GRU and LSTM" in nothing and "data-dependent" not in nothing
    assert not [w for w in compiled.record.warnings() if "graph break(s):" in w]  # nothing ran as graphs to break


def test_a_break_site_from_dynamo_s_log_message():
    from accelrun.compile.break_sites import break_site

    message = (
        "Graph break in user code at /usr/lib/python3/site-packages/torch/nn/functional.py:100\n"
        "Graph Break Reason: Data-dependent branching\n\nUser code traceback:\n"
        '  File "/home/me/train.py", line 7, in <module>\n    loss = model(x)\n'
        '  File "/home/me/mymodel.py", line 31, in forward\n    if x.sum() > 0:\n'
    )
    site = break_site(message)
    assert site.user_line == "me/mymodel.py:31" and site.inside == ""
    assert site.line().startswith("at me/mymodel.py:31; to avoid it: make the branch a computation")
    other = break_site(message.replace("Data-dependent branching", "Call to `torch._dynamo.graph_break()`"))
    assert other.line() == "at me/mymodel.py:31"  # no known change: only the place
    assert break_site("Graph break (user stack suppressed due to duplicate graph break) in user code at x.py:3") is None


def test_auto_scope_per_family_and_backend():
    from accelrun.config import load_config
    from accelrun.models import build_model
    from tests.conftest import DEFAULT_CONFIG, TINY

    cfg = load_config(DEFAULT_CONFIG, [*TINY, "model.n_layers=1"]).config
    model = build_model(cfg.model, torch.device("meta"), seed=0)
    blocks = transformer_blocks(model)
    accelrun, inductor = CompileConfig(backend="accelrun"), CompileConfig(backend="inductor")
    assert resolve_scope(accelrun, model, blocks)[0] == "loss"
    assert resolve_scope(accelrun, model, blocks, loss_parallel=True)[0] == "block"
    assert resolve_scope(inductor, model, blocks)[0] == "block"
    assert resolve_scope(CompileConfig(backend="accelrun", scope="model"), model, blocks) == ("model", "")


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.relu(self.proj(x))


class _BlocksAndHead(torch.nn.Module):
    """A user's model with a list of blocks of its own class and its output head in its forward."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList([_Block(dim), _Block(dim)])
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _BlocksAndMatrix(_BlocksAndHead):
    """The same with a weight outside the blocks that its forward multiplies by itself."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim)
        self.mix = torch.nn.Parameter(torch.eye(dim))

    def forward(self, tokens):
        x = self.embed(tokens) @ self.mix
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _TiedByHand(_BlocksAndHead):
    """The same with no Linear head: the logits are the embedding's weight times the last state."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim)
        del self.head

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x @ self.embed.weight.T


class _SharedProjection(_BlocksAndHead):
    """The same holding a Linear of its first block as its own too, and calling it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim)
        self.first_proj = self.layers[0].proj

    def forward(self, tokens):
        x = self.first_proj(self.embed(tokens))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_auto_compiles_the_products_outside_a_users_blocks_where_half_products_are_slow_eagerly(
        tmp_path, monkeypatch):  # fmt: skip
    """By its blocks, a user's model runs its output head eagerly: in bf16 on a CPU without bf16 matrix
    kernels that product takes ATen's generic loop (transformers' Llama in bf16-mixed on an AVX2 CPU:
    5.4 s a step). There auto compiles the blocks and each nn.Linear outside them (as fast as the whole
    forward, and a cold step of 2.0 s instead of 3.1), or the whole forward where another weight
    outside the blocks could be multiplied by; elsewhere the blocks alone."""
    from accelrun.compile import compile_model as compile_model_module
    from accelrun.compile.compile_model import half_products_run_slowly, linears_outside
    from accelrun.config import load_config
    from accelrun.models import build_model
    from accelrun.torch_private import cpu_has_half_gemm
    from tests.conftest import DEFAULT_CONFIG, TINY

    model = _BlocksAndHead()
    blocks = transformer_blocks(model)
    accelrun, inductor = CompileConfig(backend="accelrun"), CompileConfig(backend="inductor")
    assert resolve_scope(accelrun, model, blocks)[0] == "block"
    scope, why = resolve_scope(accelrun, model, blocks, slow_half_products=True)
    assert scope == "block" and "nn.Linear layers outside the blocks" in why
    assert linears_outside(model, blocks) == [model.head]
    for other in (_BlocksAndMatrix(), _TiedByHand(), _SharedProjection()):  # a product no Linear of its own runs
        scope, why = resolve_scope(accelrun, other, transformer_blocks(other), slow_half_products=True)
        assert scope == "model" and "fp32 GEMMs" in why, type(other).__name__
    assert resolve_scope(inductor, model, blocks, slow_half_products=True)[0] == "block"  # no such pass there
    family = build_model(load_config(DEFAULT_CONFIG, [*TINY, "model.n_layers=1"]).config.model, torch.device("meta"),
                         seed=0)  # fmt: skip
    # A model family's head is compiled anyway (scope loss), and a meta model has no CPU products.
    assert resolve_scope(accelrun, family, transformer_blocks(family), slow_half_products=True)[0] == "loss"
    assert not half_products_run_slowly("bf16-mixed", family)

    # Compiled so, on any CPU (the rule forced on): the head is a graph of its own, at eager's losses.
    monkeypatch.setattr(compile_model_module, "half_products_run_slowly", lambda precision, model: True)
    torch.manual_seed(0)
    model = _BlocksAndHead()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg, precision="bf16-mixed")
    assert "1 nn.Linear layer outside them" in compiled.description, compiled.description
    _train_side_by_side(model, reference)
    assert compiled.record.dynamo_graphs == 2  # the blocks' graph (shared) and the head's
    assert compiled.record.graphs_in_use() == 2
    assert compiled.record.graph_cache["saved"] == 2, compiled.record.graph_cache
    # The same model again (a new process would do the same): both graphs load from the graph cache.
    again = _BlocksAndHead()
    loaded = compile_model(again, transformer_blocks(again), cfg, precision="bf16-mixed")
    training_loss_fn(again)(torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))).backward()
    assert loaded.record.graph_cache["loaded"] == 2 and loaded.record.graph_cache["compiled"] == 0, loaded.record.graph_cache
    # Blocks found without a `layers` list get the same; an explicit compile.scope = block the blocks alone.
    found = compile_model(_BlocksAndHead(), None, cfg, precision="bf16-mixed")
    assert "1 nn.Linear layer outside them" in found.description, found.description
    explicit = compile_model(_BlocksAndHead(), None, cfg.model_copy(update={"scope": "block"}), precision="bf16-mixed")
    assert "nn.Linear" not in explicit.description, explicit.description

    slow_bf16 = not cpu_has_half_gemm(torch.bfloat16)
    assert half_products_run_slowly("bf16-mixed", model) is slow_bf16
    assert half_products_run_slowly("fp32", model) is False
    assert half_products_run_slowly("fp32", copy.deepcopy(model).to(torch.bfloat16)) is slow_bf16
    assert half_products_run_slowly("fp32", copy.deepcopy(model).to(torch.float16)) is not cpu_has_half_gemm(
        torch.float16)


def test_a_copy_of_a_compiled_torch_nn_module_runs_its_own_weights():
    """compile_module binds the compiled forward to its module: a deep copy's forward is the copy's."""
    from accelrun.compile.compile_model import compile_module

    linear = torch.nn.Linear(16, 8)
    compile_module(linear, "eager")
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.mul_(2)
    h = torch.randn(2, 16)
    torch.testing.assert_close(twin(h), torch.nn.functional.linear(h, twin.weight, twin.bias))
    torch.testing.assert_close(linear(h), torch.nn.functional.linear(h, linear.weight, linear.bias))


def _tiny_transformers_llama_compiled(tmp_path, layers: int, positions: int, compile: bool = True):
    """transformers' Llama at a tiny size (built locally, as a user's code hands it to ``compile_model``:
    no head attached), an eager copy, and the model compiled by accelrun as ``accelrun train`` compiles
    such a model: (model, reference, compiled or None, compile config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)  # fmt: skip
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    return model, reference, compile_model(model, transformer_blocks(model), cfg) if compile else None, cfg


def test_transformers_llamas_decoder_layers_share_one_graph_without_a_kv_cache(tmp_path):
    """transformers' Llama as a user's model (model.custom), under the default scope: its decoder layers
    compile as one graph. With its KV cache on (config.use_cache, what a plain call does) each layer's
    cache state made Dynamo compile the layer anew, and past 8 layers the rest trained eagerly;
    training_loss_fn now calls it with use_cache=False."""
    model, reference, compiled, cfg = _tiny_transformers_llama_compiled(tmp_path, layers=3, positions=32)
    assert "3 repeated LlamaDecoderLayer blocks" in compiled.description, compiled.description
    _train_side_by_side(model, reference, steps=2)
    record = compiled.record
    assert record.dynamo_graphs == 1, record.compiled_line()  # was 3: one per layer
    assert record.regions_per_executor().get("cpp", 0) > 0 and not record.warnings(), record.warnings()
    # The layers go through the graph cache: the next compile of this model loads their graph.
    assert record.graph_cache["saved"] == 1, record.graph_cache
    torch._dynamo.reset()
    model = copy.deepcopy(reference)
    again = compile_model(model, transformer_blocks(model), cfg)
    _train_side_by_side(model, copy.deepcopy(reference), steps=1)
    assert again.record.graph_cache["loaded"] == 1 and again.record.dynamo_graphs == 0, again.record.graph_cache


def test_torch_nn_blocks_keep_a_forward_wrapper_of_their_own_when_compiled(tmp_path):
    """Activation checkpointing wraps each block's forward on the instance; compiling torch.nn's own
    blocks (traced from accelrun's frame) calls that wrapper, rather than the class's forward, which
    would have trained without checkpointing and said nothing (found in review, 2026-12-06)."""
    import functools

    from accelrun.config.schema import ActivationCheckpointConfig
    from accelrun.dist.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    model = USER_MODELS["encoder_layers"]()
    reference = copy.deepcopy(model)
    assert apply_activation_checkpointing(model.layers, ActivationCheckpointConfig(mode="full")) == 2
    calls = []

    def spy(forward, *args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    for layer in model.layers:  # on top of checkpointing's: the wrapper the compiled frame must call
        layer.forward = functools.partial(spy, layer.forward)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, transformer_blocks(model), cfg).record
    _train_side_by_side(model, reference, steps=2)
    assert calls and record.graphs_in_use() > 0, (calls, record.compiled_line())


def test_transformers_llama_built_as_accelrun_train_builds_it_compiles_its_head_and_loss_as_one_graph(tmp_path):
    """transformers' Llama with the head attached as ``model.custom`` builds it (models.causal_lm_head):
    the default scope compiles its decoder layers and, as for a family, its head and cross-entropy as one
    graph, where they fuse (the logits never exist whole). Until 2026-12-06 the head's product and the
    loss ran eagerly. Both graphs go through the graph cache."""
    from accelrun.models.causal_lm_head import attach_loss_head

    model, reference, _, _ = _tiny_transformers_llama_compiled(tmp_path, layers=2, positions=32, compile=False)
    assert attach_loss_head(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    assert "+ the output head and loss as one graph" in compiled.description, compiled.description
    assert "compile.scope = auto: loss" in compiled.description, compiled.description
    _train_side_by_side(model, reference, steps=3)
    record = compiled.record
    assert record.dynamo_graphs == 2 and record.passes_fired().get("fuse_linear_cross_entropy") == 1, (
        record.compiled_line(), record.passes_fired())
    assert record.graph_cache["saved"] == 2 and not record.graph_cache["errors"], record.graph_cache
    torch._dynamo.reset()
    model = copy.deepcopy(reference)
    attach_loss_head(model)
    again = compile_model(model, transformer_blocks(model), cfg)
    _train_side_by_side(model, copy.deepcopy(reference), steps=1)
    assert again.record.graph_cache["loaded"] == 2 and again.record.dynamo_graphs == 0, again.record.graph_cache


def test_transformers_gpt2_compiles_its_blocks_and_its_tied_head_with_the_loss_as_one_graph(tmp_path):
    """transformers' GPT-2 (learned positions, LayerNorm, GELU, Conv1D products, the head tied to the
    token table) as ``model.custom`` builds it: its blocks and, since 2026-12-06 evening, its head with
    the cross-entropy (until then only classes whose base model is ``.model`` had it: GPT-2's is
    ``.transformer``), at eager's losses and gradients."""
    import transformers

    from accelrun.models.causal_lm_head import attach_loss_head

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(reference)
    assert attach_loss_head(model) and model.lm_head.weight is model.transformer.wte.weight
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    assert "2 repeated GPT2Block blocks (transformer.h) + the output head and loss as one graph" in compiled.description
    _train_side_by_side(model, reference, steps=3)
    record = compiled.record
    assert record.dynamo_graphs == 2 and record.passes_fired().get("fuse_linear_cross_entropy") == 1, (
        record.compiled_line(), record.passes_fired())
    assert {r.executor for r in record.regions} >= {"cpp"}, record.compiled_line()


def test_transformers_llama_on_changing_lengths_keeps_its_kernels_for_every_length(tmp_path):
    """transformers' Llama trained on batches of changing length. Its RoPE region reads q and k in
    their transposed layout, which no kernel for any length took until 2026-12-05: the graph for any
    length (a frame's third: the first two read the length as a number, kernels written for it) ran
    RoPE in ATen. Now RoPE's kernels read the length at each call (codegen.linear_sizes), at eager's
    losses and gradients."""
    model, reference, compiled, _ = _tiny_transformers_llama_compiled(tmp_path, layers=2, positions=64)
    _train_side_by_side(model, reference, steps=5, lengths=(16, 24, 40, 9, 33))
    record = compiled.record
    assert record.dynamo_graphs == 3, record.compiled_line()
    second = [r for r in record.regions if r.graph.startswith("g1.")]
    assert second and all(r.executor == "cpp" for r in second), [(r.ops[:3], r.declined) for r in second]
    # The graph for any length: C++ throughout (until 2026-12-06 one region of its backward was ATen's:
    # its kernel divided a row's index by the length, once a row, and was refused as if per element).
    left = [r.declined["cpp"] for r in record.regions if r.graph.startswith("g2.") and r.executor != "cpp"]
    assert left == [], left
    rope = [r for r in record.regions if r.graph == "g2.forward" and "cat" in r.ops]  # rotate_half's cat
    assert rope and all(r.executor == "cpp" and r.runtime_rows for r in rope), rope


def test_a_forward_that_takes_use_cache_is_called_without_one(tmp_path):
    seen = []

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, VOCAB)

        def forward(self, input_ids, use_cache=True):
            seen.append(use_cache)
            return self.emb(input_ids)

    x = torch.randint(0, VOCAB, (2, 4))
    training_loss_fn(Cached())(x, x)
    assert seen == [False]
    # Compiled whole (no ModuleList: scope model), the instance's forward is a (*args, **kwargs) wrapper;
    # the parameters come from the class, so use_cache=False still goes in (it went missing).
    model = Cached()
    torch._dynamo.reset()
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    assert compiled.description.startswith("the whole model"), compiled.description
    training_loss_fn(model)(x, x)
    assert seen[1:] == [False] and compiled.record.graphs_in_use() == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_transformer_encoder_layer_s_causal_attention_unfolds_sequence_first_and_with_dropout(dropout, tmp_path):
    """TransformerEncoderLayer (sequence first, torch.nn's float mask, is_causal=True as its docs advise),
    in training: with dropout the unfolded SDPA draws its own mask while the pass computes shapes (it
    made the pass fail once; strict turns a failed pass into an error) and goes to the kernel that
    drops; without, eager's outputs and gradients."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=dropout)  # head_dim 16
    reference = copy.deepcopy(layer)
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], strict=True, cache_dir=tmp_path / "cache"))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend)
    x = torch.randn(12, 3, 32, requires_grad=True)  # (T, B, E)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(12)
    out = compiled(x, src_mask=mask, is_causal=True)
    out.sum().backward()
    counts = {p.name: p.counts for p in backend.record.passes if p.graph.endswith("pre_grad")}
    assert counts["fuse_attention"].get("multihead") == 1, counts
    assert counts["cpu_attention"].get("matched") == 1, counts  # with dropout: cpu_attention_dropout
    if dropout == 0:
        x_ref = x.detach().clone().requires_grad_()
        ref = reference(x_ref, src_mask=mask, is_causal=True)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def test_a_mixtures_experts_keep_their_kernels_for_every_number_of_tokens(tmp_path):
    """Each expert of the routed mixture meets a different number of tokens on every call. Its graph
    for any number keeps its C++ kernels (the SiLU, its backward, the bias's gradient), which read the
    number at each call: eager's losses and gradients, and no graph per number (until 2026-12-05 the
    regions of that graph ran as ATen calls, the expert's step slower than eager's)."""
    torch.manual_seed(0)
    model = USER_MODELS["routed_moe"]()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, None, cfg)
    _train_side_by_side(model, reference, steps=6)
    record = compiled.record
    rows = [r for r in record.regions if r.runtime_rows]
    assert rows and all(r.executor == "cpp" for r in rows), record.regions
    assert {r.graph.rsplit(".", 1)[1] for r in rows} == {"forward", "backward"}, rows
    assert record.dynamo_graphs <= 2, record.compiled_line()  # the first number of tokens, then any
    assert not record.regions_left_to_aten(), record.regions_left_to_aten()
    from accelrun.report.markdown import _compiler_section

    assert any("read a changing size at each call" in line and f"| {len(rows)} |" in line
               for line in _compiler_section(record.summary()))  # fmt: skip


def test_sequences_of_changing_length_keep_their_kernels_for_every_length(tmp_path):
    """A user's own data rarely comes in one length. nanoGPT's blocks trained on batches of 2
    sequences whose length changes every step: after the first length, one graph for every length
    whose C++ kernels read the rows (2 × length, a [2, length, dim] tensor's leading axes) at each
    call, and its attention through accelrun's kernel, at eager's losses and gradients. Until
    2026-12-05 evening the graph Dynamo traced for any length ran its regions as ATen calls ("a
    changing size past a tensor's leading axis"), after a third graph had been compiled for nothing,
    and its attention as ATen's ("sizes not fixed when compiling")."""
    from tests.compile.user_models import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(vocab=VOCAB, dim=64, layers=2, heads=2, block=64, dropout=0.0)
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    compiled = compile_model(model, transformer_blocks(model), cfg)
    _train_side_by_side(model, reference, steps=6, lengths=(16, 24, 40, 24, 9, 33))
    record = compiled.record
    assert record.dynamo_graphs == 2, record.compiled_line()  # the first length, then any length
    assert not record.regions_left_to_aten(), record.regions_left_to_aten()
    rows = [r for r in record.regions if r.runtime_rows]
    assert {r.graph.rsplit(".", 1)[1] for r in rows} == {"forward", "backward"}, record.regions
    second = [r for r in record.regions if r.graph.startswith("g1.")]
    assert rows == second and len(second) == len(record.regions) - len(second), record.regions  # all of g1's
    # accelrun's attention kernel reads its sizes at each call: both graphs' attention is its
    attention = {p.graph: p.counts.get("matched") for p in record.passes if p.name == "cpu_attention"}
    assert attention == {"g0.pre_grad": 1, "g1.pre_grad": 1}, attention


def test_multihead_attention_on_changing_lengths_runs_the_kernel_in_the_graph_for_any_length(tmp_path):
    """``nn.MultiheadAttention`` under a causal mask the forward makes from the batch's length, on
    batches whose length changes: the graph for any length unfolds it too, and its attention runs the
    kernel on the mask looked at when it runs (it is causal), at eager's losses and gradients. Until
    2026-12-06 that graph kept torch.nn's attention whole (its sizes not fixed when compiling), a step
    at length 160 of the bench's 4-layer model 385 ms against 315 for the graph of that one length."""
    from accelrun.compile.fused import attention as kernel
    from tests.compile.user_models import MHAModel

    torch.manual_seed(0)
    before = dict(kernel.masked_calls)
    record = _compiled_beside_eager(MHAModel(n_layers=2, dim=64), tmp_path, 5, lengths=(16, 24, 40, 9, 33))
    attention = {p.graph: p.counts.get("matched") for p in record.passes if p.name == "cpu_attention"}
    assert record.dynamo_graphs >= 2 and set(attention.values()) == {2}, attention  # each graph, both layers
    assert kernel.masked_calls["aten"] == before["aten"] and kernel.masked_calls["kernel"] > before["kernel"]


def test_a_mixture_traced_whole_keeps_its_kernels_for_rows_read_from_the_data_and_from_the_cache(tmp_path):
    """The mixture routed by ``torch.where`` and ``index_add`` is one graph whose experts' rows are
    sizes read from the data: its regions read their row count at each call, at eager's losses; a
    second process's copy loads the graph from the cache and its record says the same."""
    records = []
    for _ in range(2):
        torch.manual_seed(0)
        model = USER_MODELS["indexed_moe"]()
        reference = copy.deepcopy(model)
        cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
        compiled = compile_model(model, transformer_blocks(model), cfg)
        _train_side_by_side(model, reference, steps=3)
        records.append(compiled.record)
        torch._dynamo.reset()  # as a new process: the second compile goes through the graph cache
    cold, cached = records
    assert cold.graph_cache.get("saved") and cached.graph_cache.get("loaded"), (cold.graph_cache, cached.graph_cache)
    for record in records:
        assert not record.regions_left_to_aten(), record.regions_left_to_aten()
        assert record.summary()["regions_with_runtime_rows"] > 0, record.regions
    assert cold.summary()["regions_with_runtime_rows"] == cached.summary()["regions_with_runtime_rows"]


@pytest.mark.parametrize("off", ["graph_cache", "dump"])
def test_a_mixture_compiles_the_same_graph_with_the_graph_cache_off(off, tmp_path):
    """The graph cache traces with ``fullgraph=True``, under which Dynamo keeps ``torch.where``'s rows in
    the graph. Without the cache (``compile.graph_cache = false``, ``compile.dump``, multi-rank runs)
    Dynamo broke the graph there, skipped the forward, ran the first step eagerly and compiled the
    experts one by one: the dump was not of the graphs a default run trains with. Now the same one
    graph, at eager's losses; and the setting is torch's default again outside accelrun's calls."""
    torch.manual_seed(0)
    model = USER_MODELS["indexed_moe"]()
    reference = copy.deepcopy(model)
    settings = {"graph_cache": False} if off == "graph_cache" else {"dump": True}
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"), **settings)
    compiled = compile_model(model, transformer_blocks(model), cfg, dump_dir=tmp_path / "dump")
    _train_side_by_side(model, reference, steps=3)
    record = compiled.record
    assert "off" in record.graph_cache, record.graph_cache  # the path under test: no cache
    assert record.dynamo_graphs == 1 and not record.graph_breaks, record.compiled_line()
    assert not record.fallback_scope, record.fallback_scope
    assert record.summary()["regions_with_runtime_rows"] > 0, record.regions
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is False
    if off == "dump":
        forward = next((tmp_path / "dump").glob("*.pre_grad/00_input.py")).read_text()
        assert "torch.where" in forward and "index_add" in forward


def test_sharded_weights_count_as_taken_by_a_graph():
    """FSDP's parameters are DTensors between steps, and the graphs take the gathered tensors: the
    first-call fallback cannot tell from them whether a block ran in a graph, so it assumes it did
    (rather than compiling every block again after any graph break)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from accelrun.compile.compile_model import _FirstCallFallback
    from accelrun.compile.record import CompileRecord

    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain, sharded = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        for name, p in list(sharded.named_parameters()):
            setattr(sharded, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        fallback = _FirstCallFallback(torch.nn.Sequential(plain, sharded), backend=None, record=CompileRecord())
        assert not fallback._in_a_graph(plain)  # no graph took its weights
        assert fallback._in_a_graph(sharded)
        fallback.record.parameters_in_graphs.add(id(plain.weight))
        assert fallback._in_a_graph(plain)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
