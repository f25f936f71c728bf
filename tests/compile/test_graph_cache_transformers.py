"""transformers' own LlamaForCausalLM compiled whole (compile.scope = model) through the graph cache:
a new process loads its graphs instead of tracing them, at eager's loss and gradients.

torch's precompile refused this model until 2026-12-03 (a guard on the identity of a code object in
transformers' decorators, and the decorator's closure it could not rebuild), so every new process
traced it again: 3.7 s before its first step against eager's 0.23 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from accelrun.compile import graph_cache
from accelrun.compile.graph_cache import saveable_guards, wrapped_functions
from accelrun.compile.output_code import pack_graph, unpack_graph
from tests.conftest import REPO

pytest.importorskip("transformers")

# One process: build the tiny Llama (seeded), compile it whole with the cache in argv[1], one forward
# and backward beside an eager copy; print what the graph cache did and the differences from eager.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from accelrun.compile.compile_model import compile_model
    from accelrun.config.compile_names import PRESETS
    from accelrun.config.schema import CompileConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    # cpu_gemm's library fixed: both processes run the same products (no tuning in between).
    passes = [p if p != "cpu_gemm" else {"cpu_gemm": {"library": "onednn"}} for p in PRESETS["default"]]
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", scope="model", passes=passes,
                                                        executors=["cpp", "aten"], cache_dir=sys.argv[1]))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = reference(input_ids=ids, labels=ids).loss
    ref.backward()
    grad_rel = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                   for p, q in zip(model.parameters(), reference.parameters()))
    record = compiled.record
    print(json.dumps({"loss": loss.item(), "loss_rel": abs(loss.item() / ref.item() - 1), "grad_rel": grad_rel,
                      "cache": record.graph_cache, "dynamo_graphs": record.dynamo_graphs,
                      "line": record.compiled_line(), "cpp": record.regions_per_executor().get("cpp", 0)}))
""")


def _process(cache: str) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, cache], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "ACCELRUN_CACHE_DIR": cache}, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_transformers_llama_instead_of_tracing_it(tmp_path):
    cold, warm = _process(str(tmp_path / "cache")), _process(str(tmp_path / "cache"))
    assert cold["cache"]["compiled"] == cold["cache"]["saved"] == 1 and not cold["cache"]["errors"], cold
    assert cold["cache"]["fallbacks"] == 0 and cold["cpp"] > 0
    assert warm["cache"]["loaded"] == 1 and warm["cache"]["compiled"] == 0, warm["cache"]
    assert not warm["cache"]["errors"] and warm["dynamo_graphs"] == 0
    assert warm["line"].startswith("1 graph (loaded from cache)"), warm["line"]
    assert warm["cpp"] == cold["cpp"]
    for run in (cold, warm):
        assert run["loss_rel"] < 1e-5 and run["grad_rel"] < 1e-5, run
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-7)


def _entry(name, value, guard_type="TENSOR_MATCH", derived=(), is_global=False):
    return types.SimpleNamespace(name=name, value=value, guard_type=guard_type, derived_guard_types=derived,
                                 is_global=is_global)  # fmt: skip


def test_saveable_guards_drop_code_identity_and_the_methods_closure_and_keep_the_rest():
    code = (lambda: 0).__code__
    entries = [
        _entry("x", torch.ones(1)),                                              # kept: the input's metadata
        _entry("self.config.use_cache", True, "CONSTANT_MATCH"),                 # kept: the model's settings
        _entry("f.__code__", code, "CONSTANT_MATCH", ("ID_MATCH",)),             # a code object's identity
        _entry("func.__name__", "forward", "CONSTANT_MATCH"),                    # the decorator's closure
        _entry("func.__closure__[0].cell_contents", None, "CONSTANT_MATCH"),     # deeper in it
        _entry("function_name", "x", "CONSTANT_MATCH"),                          # kept: only a prefix of "func"
        _entry("torch", torch, "MODULE_MATCH", is_global=True),                  # torch drops these too
        _entry("self.lin", torch.nn.Linear(1, 1), "ID_MATCH"),
        _entry("self.thing", object(), "CONSTANT_MATCH", ("ID_MATCH",)),         # kept: precompile then refuses
        _entry("G['SCALE']", 2.0, "CONSTANT_MATCH", is_global=True),             # kept: a value baked in
        _entry("G['__import_m'].ON", True, "CONSTANT_MATCH", is_global=True),    # kept: read through a module
        _entry("G['S']['scale']", 1.5, "CONSTANT_MATCH", is_global=True),         # kept: a global dict's
        _entry("G['m'].f.__defaults__[0]()", 1, "CONSTANT_MATCH", is_global=True),  # cannot be read back by name
        _entry("G['NAMES']", b"x", "CONSTANT_MATCH", is_global=True),            # not a value JSON holds
        _entry("dict(type(self).__dict__)['SCALE']", 2.0, "CONSTANT_MATCH"),      # kept: a class's, recorded
    ]  # fmt: skip
    baked = []
    assert saveable_guards(entries, frozenset({"func"}), baked) == [True, True, False, False, False, True, False,
                                                                    False, True, True, True, True, False, False,
                                                                    True]  # fmt: skip
    # what the record holds of them, to check on load (accelrun.compile.traced_from)
    assert [(b.name, b.value) for b in baked] == [("G['SCALE']", 2.0), ("G['__import_m'].ON", True),
                                                  ("G['S']['scale']", 1.5),
                                                  ("dict(type(self).__dict__)['SCALE']", 2.0)]  # fmt: skip


def _made_in_a_function():
    class Func(torch.nn.Module):  # as the `kernels` package wraps a function transformers decorates
        def forward(self, x):
            return x

    return Func()


def test_saveable_guards_drop_a_local_class_and_what_is_read_through_it():
    """transformers 5.25 with `kernels` installed: precompile refused the type match on such an object,
    and the loading process rebuilt the guards through its class on a bare nn.Module (its class's
    methods gone). Guards on its attributes and on other objects stay."""
    func = _made_in_a_function()
    rope = "self.layers[0].attn._kernel_funcs['rope']"
    entries = [
        _entry(rope, func, "TYPE_MATCH", ("TYPE_MATCH",)),                               # its class
        _entry(f"dict(type({rope}).__dict__)['forward'].__closure__[0].cell_contents.__defaults__", (1,),
               "SEQUENCE_LENGTH", ("TYPE_MATCH", "SEQUENCE_LENGTH")),                     # through its class
        _entry(f"{rope}._forward_hooks", {}, "EMPTY_NN_MODULE_HOOKS_DICT"),              # kept: an attribute
        _entry(f"{rope}.training", True, "CONSTANT_MATCH", ("BOOL_MATCH",)),            # kept
        _entry("self.layers[0].attn._kernel_funcs['rope_other']", 1, "CONSTANT_MATCH"),  # kept: another name
        _entry("self.proj_x.scale", 0.125, "CONSTANT_MATCH"),                           # kept
    ]  # fmt: skip
    assert saveable_guards(entries) == [False, False, True, True, True, True]
    # A model whose own class is local keeps its settings' guards (train or eval mode, say).
    owner = [_entry("self", func, "TYPE_MATCH", ("TYPE_MATCH",)), _entry("self.training", True, "CONSTANT_MATCH"),
             _entry("x", torch.ones(1))]  # fmt: skip
    assert saveable_guards(owner) == [False, True, True]
    # The key takes the local class's code: this file, where its forward is written.
    assert graph_cache._local_type_files(type(func)) == {__file__}
    assert graph_cache._local_type_files(torch.nn.Linear) == set()


def test_wrapped_functions_are_found_by_place_in_the_closures():
    def inner(x):
        return x

    def deco(f):
        def wrapper(*a):
            return f(*a)
        return wrapper

    outer = deco(deco(inner))
    found = wrapped_functions(outer)
    assert list(found) == ["0", "0.0"] and found["0.0"] is inner
    assert list(wrapped_functions(deco(deco(inner)))) == list(found)  # the same places in another copy


def test_a_lowered_graph_with_a_constant_packs_and_unpacks():
    """AOTAutograd lifts constants (transformers' Llama: empty tensors) as get_attr nodes; the graph
    was then saved in the slow form and lowered again on every load (0.3 s of a 0.5 s warm start)."""
    from torch import fx

    g = fx.Graph()
    x = g.placeholder("x")
    dead = g.get_attr("_tensor_constant0")  # noqa: F841 (unused, as AOTAutograd leaves some)
    c = g.get_attr("_tensor_constant1")
    g.output(g.call_function(torch.ops.aten.add.Tensor, (x, c)))
    gm = fx.GraphModule({"_tensor_constant0": torch.empty(0), "_tensor_constant1": torch.tensor([1.0, 2.0])}, g)
    back = unpack_graph(pack_graph(gm))
    assert [n.op for n in back.graph.nodes] == ["placeholder", "get_attr", "call_function", "output"]
    torch.testing.assert_close(back(torch.tensor([3.0, 4.0])), torch.tensor([4.0, 6.0]))


def test_the_key_covers_inherited_decorated_methods_and_their_closures_values(tmp_path, monkeypatch):
    """A block that inherits a decorated forward from a class in another file: that file (where the
    wrapped code is) and the decorator's settings are in the key, since the saved guards no longer
    check the code's identity nor the closure."""
    from accelrun.compile.graph_cache import _wrapped_code, model_code_digest

    (tmp_path / "deco_mod.py").write_text(
        "def deco(name):\n"
        "    def outer(f):\n"
        "        def wrapper(self, x):\n"
        "            return f(self, x) if name else x\n"
        "        return wrapper\n"
        "    return outer\n")
    (tmp_path / "base_mod.py").write_text(
        "import torch\nfrom deco_mod import deco\n\n"
        "class Base(torch.nn.Module):\n"
        "    @deco('v1')\n"
        "    def forward(self, x):\n"
        "        return x * 2\n")
    (tmp_path / "block_mod.py").write_text("from base_mod import Base\n\nclass Block(Base):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from block_mod import Block  # noqa: I001 (written above)

    files, constants = _wrapped_code(Block)
    assert str(tmp_path / "base_mod.py") in files and str(tmp_path / "deco_mod.py") in files
    assert any("'v1'" in c for c in constants), constants
    digest = model_code_digest(Block(), Block.forward)
    import base_mod

    base_mod.Base.forward = base_mod.deco("v2")(base_mod.Base.forward.__closure__[0].cell_contents)
    _wrapped_code.cache_clear()
    assert model_code_digest(Block(), Block.forward) != digest  # another setting: another entry


class _TwoKindsBlock(torch.nn.Module):  # at module level: precompile saves the class by name
    def __init__(self, sliding):
        super().__init__()
        self.sliding, self.lin = sliding, torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu() if self.sliding else self.lin(x).tanh()


def test_blocks_of_two_kinds_keep_an_entry_each(tmp_path):
    """Blocks of one class whose traces differ per instance (sliding and full attention layers) share a
    key; entries are numbered by the kinds met before, so a second process loads both instead of
    compiling the kind the other's file overwrote."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.graph_cache import GraphCache, install
    from accelrun.compile.options import CompileOptions

    Block = _TwoKindsBlock
    x = torch.randn(4, 8)
    stats = []
    for _ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = [Block(True), Block(False)]
        reference = [b.lin(x).relu() if b.sliding else b.lin(x).tanh() for b in blocks]
        backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "c"))
        install(GraphCache(backend, tmp_path / "c" / "graphs"), blocks, "forward")
        for b, ref in zip(blocks, reference, strict=True):
            out = b(x)
            out.sum().backward()  # a training step: the backward's kernels are built by then
            torch.testing.assert_close(out, ref)
        stats.append(dict(backend.record.graph_cache))
    assert stats[0]["compiled"] == stats[0]["saved"] == 2, stats[0]
    assert stats[1]["loaded"] == 2 and stats[1]["compiled"] == 0, stats[1]
    torch._dynamo.reset()
