"""The graph cache (compile/graph_cache.py): a new process loads the compiled graphs instead of tracing.

Every load is checked against eager PyTorch on the same inputs (float32, rel 1e-5) and against the
process that compiled them (the same kernels on the same inputs: equal to 1e-7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelrun.compile.compile_model import compile_model
from accelrun.compile.graph_cache import model_code_digest
from accelrun.config import load_config
from accelrun.config.compile_names import PRESETS
from accelrun.models import build_model, transformer_blocks
from accelrun.models.build import training_loss_fn
from tests.conftest import DEFAULT_CONFIG, REPO, TINY

# cpu_gemm's library fixed: a tuned layout's first calls alternate between ATen and oneDNN, so a graph
# loaded before its layouts are decided would not run the same products as the graph it was saved from.
# Fixed to oneDNN, the saved graphs hold its product sites (gemm_choice.GemmSite) through the cache too.
PASSES = [p if p != "cpu_gemm" else {"cpu_gemm": {"library": "onednn"}} for p in PRESETS["default"]]
COMPILED = ["compile.backend=accelrun", "compile.scope=loss", "compile.executors=[cpp,aten]",
            f"compile.passes={json.dumps(PASSES)}"]  # fmt: skip


def step(*overrides: str, grad: bool = True, shape: tuple[int, int] = (4, 32), cuda_graphs=None):
    """One forward (+ backward) of the tiny Llama on (batch, seq) = ``shape`` tokens: (loss, grads by
    name, compile record). ``cuda_graphs``: the run's CUDA-graph decision, as dist.layout sets it."""
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *overrides]).config
    model = build_model(cfg.model, torch.device("cpu"), seed=0)
    compiled = compile_model(model, transformer_blocks(model), cfg.compile)
    if cuda_graphs is not None:
        compiled.record.cuda_graphs = cuda_graphs
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, cfg.model.vocab_size, shape, generator=gen) for _ in range(2))
    with torch.set_grad_enabled(grad):
        loss = training_loss_fn(model)(tokens, targets)
    if grad:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, compiled.record


def assert_close(a, b, rel):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rel, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rel, atol=rel * grads_b[name].abs().max())


def test_a_second_compile_loads_instead_of_tracing():
    eager = step()
    first = step(*COMPILED)
    torch._dynamo.reset()
    second = step(*COMPILED)
    cold, warm = first[2], second[2]
    assert cold.graph_cache["compiled"] == cold.graph_cache["saved"] == 2  # the block graph, the loss head
    assert cold.dynamo_graphs == 2
    assert warm.graph_cache["loaded"] == 2 and warm.graph_cache["compiled"] == 0, warm.graph_cache
    assert warm.dynamo_graphs == 0 and not warm.stage_seconds.get("aot trace")
    # The record still says what the graphs hold: their regions and executors, replayed from the entry.
    assert warm.regions_per_executor() == cold.regions_per_executor()
    assert warm.cache_hits == sum(1 for r in cold.regions if r.cache_hit is not None)
    assert_close(second, first, rel=1e-7)
    assert_close(second, eager, rel=1e-5)


def test_grad_mode_and_options_are_part_of_the_key():
    step(*COMPILED)
    torch._dynamo.reset()
    _, _, inference = step(*COMPILED, grad=False)  # no_grad: an inference graph, not the training one
    assert inference.graph_cache["loaded"] == 0 and inference.graph_cache["compiled"] == 2
    torch._dynamo.reset()
    other = step("compile.backend=accelrun", "compile.scope=loss", "compile.executors=[aten]")
    assert other[2].graph_cache["loaded"] == 0 and other[2].graph_cache["compiled"] == 2
    assert_close(other, step(), rel=1e-5)


def test_a_damaged_entry_is_compiled_afresh(tmp_path):
    step(*COMPILED)
    entries = list((tmp_path / "cache" / "compile" / "graphs").glob("*.pt"))
    assert len(entries) == 2
    for entry in entries:
        entry.write_bytes(b"not a pickle")
    torch._dynamo.reset()
    again = step(*COMPILED)
    stats = again[2].graph_cache
    assert stats["loaded"] == 0 and stats["compiled"] == 2 and len(stats["errors"]) == 2
    assert all("could not load" in e for e in stats["errors"])
    assert_close(again, step(), rel=1e-5)


def test_a_kernel_gone_from_the_kernel_cache_means_a_fresh_compile(tmp_path):
    step(*COMPILED)
    for lib in (tmp_path / "cache" / "compile" / "cpp").glob("*.so"):
        lib.unlink()
    torch._dynamo.reset()
    again = step(*COMPILED)
    stats = again[2].graph_cache
    assert stats["loaded"] == 0 and stats["compiled"] == 2
    assert any("is not in the kernel cache (removed, or still being built" in e for e in stats["errors"]), stats["errors"]
    assert again[2].cache_misses > 0  # g++ rebuilt them
    assert_close(again, step(), rel=1e-5)


@pytest.mark.parametrize(("override", "why"), [
    ("compile.graph_cache=false", "compile.graph_cache = false"),
    ("compile.debug_numerics=true", "debug_numerics"),
    # a loaded graph's fallbacks were never seen by a strict run (a compiler engineer's trial: strict loaded one)
    ("compile.strict=true", "compile.strict checks every pass and region as they compile"),
    ("train.activation_checkpoint.mode=full", "is checkpointed (train.activation_checkpoint)"),
])  # fmt: skip
def test_off_with_a_reason(override, why):
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *COMPILED, override]).config
    model = build_model(cfg.model, torch.device("cpu"), seed=0)
    if "activation_checkpoint" in override:
        from accelrun.dist.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(transformer_blocks(model), cfg.train.activation_checkpoint)
    record = compile_model(model, transformer_blocks(model), cfg.compile).record
    assert why in record.graph_cache["off"]


def test_model_code_is_part_of_the_key(tmp_path, monkeypatch):
    cfg = load_config(DEFAULT_CONFIG, TINY).config
    model = build_model(cfg.model, torch.device("cpu"), seed=0)
    block = transformer_blocks(model)[0]
    before = model_code_digest(block, type(block).forward)
    import accelrun.compile.graph_cache as graph_cache

    monkeypatch.setattr(graph_cache, "file_digest", lambda path: "edited" if path.endswith("llama.py") else "same")
    assert model_code_digest(block, type(block).forward) != before


# A user's model whose forward calls a helper from another file of theirs, run in a new process each time.
USER_MODEL = {
    "userpkg/__init__.py": "",
    "userpkg/helpers.py": "import torch\n\ndef act(x):\n    return torch.relu(x) * 2\n",
    "userpkg/model.py": ("from torch import nn\nfrom userpkg.helpers import act\n\nclass Net(nn.Module):\n"
                         "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n\n"
                         "    def forward(self, x):\n        return act(self.lin(x)).sum()\n"),
}  # fmt: skip
USER_RUN = """
import json, sys, torch
from userpkg.model import Net
from accelrun.compile.compile_model import compile_model
from accelrun.config.schema import CompileConfig
torch.manual_seed(0)
model, reference = Net(), Net()
reference.load_state_dict(model.state_dict())
compiled = compile_model(model, None, CompileConfig(backend="accelrun", scope="model", executors=["cpp", "aten"]))
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
print(json.dumps({"out": model(x).item(), "eager": reference(x).item(), "cache": compiled.record.graph_cache}))
"""


def test_an_edited_helper_in_another_file_is_compiled_again(tmp_path):
    """The key covers the model's classes, not a helper its forward calls from another file: edited,
    its old graph loaded, and the model computed the old helper's result."""
    for name, text in USER_MODEL.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}  # fmt: skip

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", USER_RUN], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["cache"]["saved"] == 1 and second["cache"]["loaded"] == 1, (first, second)
    (tmp_path / "userpkg/helpers.py").write_text(USER_MODEL["userpkg/helpers.py"].replace("* 2", "* 3"))
    edited = run()
    assert edited["cache"]["loaded"] == 0 and edited["cache"]["compiled"] == 1, edited["cache"]
    # an edit is no failure: said as what happened (it had read "could not load ...: RuntimeError")
    said = edited["cache"]["errors"][0]
    assert "compiled again: " in said and "helpers.py changed since it was compiled" in said, said
    assert "RuntimeError" not in said and "could not load" not in said
    for result in (first, second, edited):
        assert result["out"] == pytest.approx(result["eager"], rel=1e-5)
    assert edited["out"] == pytest.approx(first["out"] * 1.5, rel=1e-5)
    # the edit undone: the original's entry was kept beside the edited one's, and loads (it was written over)
    (tmp_path / "userpkg/helpers.py").write_text(USER_MODEL["userpkg/helpers.py"])
    reverted = run()
    assert reverted["cache"]["loaded"] == 1 and reverted["cache"]["compiled"] == 0, reverted["cache"]
    assert reverted["cache"]["errors"] == [], reverted["cache"]  # (the edited entry's "compiled again" was said)
    assert reverted["out"] == pytest.approx(first["out"], rel=1e-6)
    # an edit of the model's own file (a comment) is part of the key: compiled again, and said (it was not)
    (tmp_path / "userpkg/model.py").write_text(USER_MODEL["userpkg/model.py"] + "# a comment\n")
    commented = run()
    assert commented["cache"]["compiled"] == 1 and commented["cache"]["loaded"] == 0, commented["cache"]
    assert "compiled again: model.py changed since its graphs were saved" in commented["cache"]["errors"], commented
    assert run()["cache"]["loaded"] == 1  # and saved for the new code


# The same kind of model, its helper's scale a module global read from the environment at import.
SETTING_HELPER = "import os\nimport torch\n\nSCALE = float(os.environ['USER_SCALE'])\n\ndef act(x):\n    return torch.relu(x) * SCALE\n"


# Values a graph bakes in that torch's saved guards did not hold across processes (review of 2026-12-06):
# (what the model's forward computes, the helpers module, what the script sets first, the two values).
FORWARD = "        return act(self.lin(x)).sum()"
BAKED_CASES = {
    "a helper module's global read at import": (FORWARD, SETTING_HELPER, "", ("2", "3")),
    "a class attribute a script sets": (
        "        return (act(self.lin(x)) * self.scale).sum()", USER_MODEL["userpkg/helpers.py"],
        "from userpkg.model import Net\nNet.scale = float(os.environ['USER_SCALE'])\n", ("2", "3")),
    "a base class's attribute": (
        "        return (act(self.lin(x)) * self.scale).sum()", USER_MODEL["userpkg/helpers.py"],
        "import torch\ntorch.nn.Module.scale = float(os.environ['USER_SCALE'])\n", ("2", "3")),
    "a global tuple's length": (
        "        y = act(self.lin(x))\n        for w in helpers.WEIGHTS:\n            y = y * w\n        return y.sum()",
        USER_MODEL["userpkg/helpers.py"] + "\nimport os\nWEIGHTS = tuple(float(w) for w in os.environ['USER_SCALE'].split(','))\n",
        "", ("2", "2,1.5")),
    "a dtype chosen at import": (
        "        return act(self.lin(x)).to(helpers.DT).sum()",
        USER_MODEL["userpkg/helpers.py"] + "\nimport os\nDT = torch.float64 if os.environ['USER_SCALE'] == '64' else torch.float32\n",
        "", ("32", "64")),
}  # fmt: skip


def _baked_case(tmp_path, case: str):
    """Writes the case's user package; returns ``run(value)``: a new process with that value, its result."""
    forward, helpers, prelude, _ = BAKED_CASES[case]
    model = USER_MODEL["userpkg/model.py"].replace(FORWARD, forward).replace(
        "from userpkg.helpers import act", "from userpkg import helpers\nfrom userpkg.helpers import act")
    for name, text in {**USER_MODEL, "userpkg/model.py": model, "userpkg/helpers.py": helpers}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    script = "import os\n" + prelude + USER_RUN

    def run(value: str) -> dict:
        env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "cache"), "USER_SCALE": value,
               "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}  # fmt: skip
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


def test_values_that_alternate_between_processes_each_load_their_own_entry(tmp_path):
    """`accelrun ab` of two settings a user's module reads (A B A B ...): each process wrote its entry
    over the other's, and every process compiled again. The entries of one key are kept side by side
    (graph_cache.MAX_VARIANTS), the most recently used tried first."""
    run = _baked_case(tmp_path, "a helper module's global read at import")
    a, b = run("2"), run("3")
    assert a["cache"]["saved"] == 1 and b["cache"]["saved"] == 1 and b["cache"]["loaded"] == 0
    again = run("2")  # 3's entry, the most recently used, is tried first and passed over unsaid
    assert again["cache"]["loaded"] == 1 and again["cache"]["saved"] == 0, again["cache"]
    assert again["cache"]["rejected"] == 0 and not again["cache"]["state_changed"], again["cache"]
    assert again["out"] == pytest.approx(again["eager"], rel=1e-5) and again["out"] == pytest.approx(a["out"])
    assert b["out"] != pytest.approx(a["out"], rel=1e-3)  # two graphs, for two values
    assert len(list((tmp_path / "cache").rglob("*.v2.pt"))) == 1


@pytest.mark.parametrize("case", sorted(BAKED_CASES))
def test_a_value_the_graph_baked_in_that_changed_between_processes_is_compiled_again(tmp_path, case):
    """A helper module's global read from the environment at import (found 2026-12-06: a helper scaled
    by 3 trained with 2's graph), a class attribute (``Net.scale = ...`` in a script), a base class's, a
    global tuple's length, a dtype: torch rebuilt a loaded entry's guards on them against the class or
    module as it is now (or dropped them), and a new process with another value trained the old value's graph. The entry's
    record (``traced_from.TracedFrom``) holds them, a process with another one compiles anew, and one
    with the same value loads."""
    run, (first, second) = _baked_case(tmp_path, case), BAKED_CASES[case][3]
    before, after, again = run(first), run(second), run(second)
    assert before["cache"]["saved"] == 1, before["cache"]
    assert after["cache"]["loaded"] == 0 and after["cache"]["rejected"] == 1, after["cache"]
    assert after["cache"]["state_changed"], after["cache"]  # said: the graphs held are for another value
    assert again["cache"]["loaded"] == 1, again["cache"]
    for result in (before, after, again):
        assert result["out"] == pytest.approx(result["eager"], rel=1e-5), result


# A script that changes what the model's forward reads between two calls, in one process: a global of
# another module of the user's, read through it, and two of the model's own module, read by name.
CHANGED_IN_PROCESS = {
    "userpkg/helpers.py": "import torch\n\nWEIGHTS = (2.0,)\n",
    "userpkg/model.py": ("import torch\nfrom torch import nn\nfrom userpkg import helpers\n\nDT = torch.float32\n"
                         "SCALE = 1.0\n\nclass Net(nn.Module):\n"
                         "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n\n"
                         "    def forward(self, x):\n        y = self.lin(x).relu() * SCALE\n        for w in helpers.WEIGHTS:\n"
                         "            y = y * w\n        return y.to(DT).sum()\n"),
}  # fmt: skip
CHANGE_RUN = USER_RUN.rsplit("print(", 1)[0] + """import userpkg.model
from userpkg import helpers
outs = [(model(x).item(), reference(x).item())]
helpers.WEIGHTS = (2.0, 1.5)
outs.append((model(x).item(), reference(x).item()))
userpkg.model.DT = torch.float64
outs.append((model(x).item(), reference(x).item()))
userpkg.model.SCALE = 2.0
outs.append((model(x).item(), reference(x).item()))
print(json.dumps({"outs": outs, "cache": compiled.record.graph_cache}))
"""


def test_a_value_the_graph_baked_in_that_a_script_changes_between_calls_is_compiled_again(tmp_path):
    """A global tuple replaced by a longer one, a dtype and a float of the model's own module set anew
    between calls of one process: torch's precompile drops Dynamo's guards on them in the compiling
    process too, and rebuilds a loaded entry's guards on a copy of the module's globals taken when it
    loaded; the graph traced for the old values ran (91.8 where eager gave 137.7, 2026-12-07), where
    ``torch.compile`` without the graph cache compiles again. Checked at each call against the module
    as it is (``traced_from.BakedCheck``), compiled or loaded."""
    for name, text in {**USER_MODEL, **CHANGED_IN_PROCESS}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}  # fmt: skip
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHANGE_RUN], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    compiled, loaded = runs
    assert compiled["cache"]["compiled"] == 4 and compiled["cache"]["saved"] == 4, compiled["cache"]
    # The float's entry is not loaded: Dynamo recompiled for a float that changed with the float as an
    # input of the graph (automatic dynamic), and that entry's guards fail where it loads; the second
    # process compiles it anew, with the float fixed, as the first would have.
    assert loaded["cache"]["loaded"] == 3 and loaded["cache"]["compiled"] == 1, loaded["cache"]
    for run in runs:
        for out, eager in run["outs"]:
            assert out == pytest.approx(eager, rel=1e-5), run["outs"]
    eager = [e for _, e in compiled["outs"]]
    assert eager[1] == pytest.approx(eager[0] * 1.5, rel=1e-5) and eager[3] == pytest.approx(eager[2] * 2, rel=1e-5)


def test_a_new_process_trains_from_the_loaded_graphs(tmp_path):
    """Two `accelrun train` processes sharing a cache: the second compiles nothing and computes the
    same losses as the first."""
    env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "shared")}
    reports = []
    for name in ("first", "second"):
        cmd = [sys.executable, "-m", "accelrun.cli.main", "train", str(DEFAULT_CONFIG), *TINY, *COMPILED,
               "train.steps=3", f"report.runs_dir={tmp_path / 'runs'}", f"name={name}"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        (report,) = (tmp_path / "runs" / name).glob("*/report.json")
        reports.append(json.loads(report.read_text()))
    first, second = (r["compiler"] for r in reports)
    assert first["graph_cache"]["saved"] == 2 and first["dynamo_graphs"] == 2
    assert second["graph_cache"]["loaded"] == 2 and second["dynamo_graphs"] == 0, second["graph_cache"]
    losses = [[p["loss"] for p in r["loss_curve"]] for r in reports]
    assert losses[0] == pytest.approx(losses[1], rel=1e-7)


def test_graphs_that_cannot_be_saved_node_by_node_are_lowered_again(monkeypatch):
    """The slower form (the graph before lowering, for regions whose executor cannot be pickled, as
    Triton's): loading lowers it again, from the kernel cache."""
    import accelrun.compile.output_code as output_code

    def refuse(gm):
        raise TypeError("this executor's regions cannot be pickled")

    monkeypatch.setattr(output_code, "pack_graph", refuse)
    first = step(*COMPILED)
    torch._dynamo.reset()
    second = step(*COMPILED)
    assert second[2].graph_cache["loaded"] == 2, second[2].graph_cache
    assert second[2].cache_misses == 0 and second[2].cache_hits > 0  # lowered again: every kernel a hit
    assert_close(second, first, rel=1e-7)


class BreaksAfterLinear(torch.nn.Module):
    """A module whose forward Dynamo cannot trace as one graph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).relu()
        torch._dynamo.graph_break()
        return y


def test_a_method_with_a_graph_break_falls_back_once_and_says_why(tmp_path):
    """Precompiling needs one whole graph; a break falls back to torch.compile, and the next process
    goes straight there (the refusal is kept beside the entries)."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.graph_cache import GraphCache, install
    from accelrun.compile.options import CompileOptions

    x = torch.randn(4, 8)
    for attempt in range(2):
        torch._dynamo.reset()
        module = BreaksAfterLinear()
        torch.manual_seed(0)
        module.lin.reset_parameters()
        backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "c"))
        install(GraphCache(backend, tmp_path / "c" / "graphs"), [module], "forward")
        torch.testing.assert_close(module(x), module.lin(x).relu())
        stats = backend.record.graph_cache
        assert stats["fallbacks"] == 1 and stats["compiled"] == 0
        assert ("precompile failed" if attempt == 0 else "precompile failed before") in stats["errors"][0]


class BreaksUnlessTold(BreaksAfterLinear):
    """Breaks the graph unless ``whole`` is set: a setting (as model.kwargs gives one) that Dynamo's
    guards check and the graph cache's key leaves out."""

    def __init__(self, whole: bool):
        super().__init__()
        self.whole = whole

    def forward(self, x):
        y = self.lin(x).relu()
        if not self.whole:
            torch._dynamo.graph_break()
        return y


def test_a_refusal_does_not_outlive_a_change_of_the_modules_settings(tmp_path):
    """A user's model refused once (a graph break) and then fixed through a setting, not its code
    (model.kwargs: is_causal true): it used to stay refused, so every new process compiled it again."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.graph_cache import GraphCache, install
    from accelrun.compile.options import CompileOptions

    x = torch.randn(4, 8)
    stats = []
    for whole in (False, True, True):
        torch._dynamo.reset()
        module = BreaksUnlessTold(whole)
        backend = AccelrunBackend(CompileOptions(executors=["aten"], cache_dir=tmp_path / "c"))
        install(GraphCache(backend, tmp_path / "c" / "graphs"), [module], "forward")
        torch.testing.assert_close(module(x), module.lin(x).relu())
        stats.append(backend.record.graph_cache)
    refused, fixed, again = stats
    assert refused["fallbacks"] == 1 and "precompile failed" in refused["errors"][0], refused
    assert fixed["fallbacks"] == 0 and fixed["saved"] == 1, fixed  # tried again, and saved
    assert again["loaded"] == 1 and again["compiled"] == 0, again


def test_a_precompile_torch_refuses_after_compiling_is_not_counted_twice(tmp_path, monkeypatch):
    """transformers' own Llama, whole forward, under torch's own guard filter: Dynamo guards on the
    identity of a code object in one of transformers' decorators, a guard torch's precompile cannot
    save, so it refuses after the backend has compiled the graphs (the graph cache's own filter,
    ``saveable_guards``, now drops that guard: tests/compile/test_graph_cache_transformers.py). The
    record keeps only the torch.compile fallback's graph and regions (it said 2 graphs and twice the
    regions, while one graph ran), and the step equals eager's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelrun.compile.graph_cache as graph_cache
    from accelrun.config.schema import CompileConfig
    from accelrun.torch_private import CheckFunctionManager

    unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    monkeypatch.setattr(graph_cache, "saveable_guards", lambda entries, closure_names, **_: [
        not (g.is_global or g.guard_type in unsaveable) for g in entries])  # what aot_compile keeps by default

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", scope="model", executors=["cpp", "aten"],
                                                        cache_dir=str(tmp_path / "c")))  # fmt: skip
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = reference(input_ids=ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * q.grad.abs().max().item(), msg=name)
    record = compiled.record
    stats = record.graph_cache
    assert stats["fallbacks"] == 1 and "precompile failed" in stats["errors"][0], stats
    assert record.graphs_in_use() == 1 and [g.name for g in record.graphs] == ["g0.forward", "g0.backward"]
    assert record.regions_per_executor().get("cpp", 0) > 0
    assert record.compiled_line().startswith("1 graph,"), record.compiled_line()


def test_a_lowered_graph_with_runtime_assertions_on_unbacked_sizes_packs_and_unpacks():
    """AOTAutograd leaves ``_assert_scalar(ge(u0, 0))`` in a graph whose sizes depend on data (an
    MoE's tokens per expert): operator's comparisons and torch.sym_* are saved by name, so the graph
    cache keeps such a graph instead of refusing the whole method (which then broke the graph)."""
    import operator

    from torch import fx

    from accelrun.compile.output_code import pack_graph, unpack_graph

    g = fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten._local_scalar_dense.default, (g.call_function(torch.ops.aten.sum.default, (x,)),))
    g.call_function(torch.ops.aten._assert_scalar.default, (g.call_function(operator.ge, (n, 0)), "n >= 0"))
    bigger = g.call_function(torch.sym_max, (n, 1))
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, bigger)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    back = unpack_graph(pack_graph(gm))
    assert back.meta["static_layouts"] is False  # data-dependent sizes: its views are never collapsed
    assert [nd.target for nd in back.graph.nodes if nd.op == "call_function"] == \
        [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(back(x), gm(x))
    with pytest.raises(RuntimeError, match="n >= 0"):
        back(torch.tensor([-3.0, 1.0]))


def test_a_graph_input_named_getitem_is_loaded_as_an_input():
    """A backward graph's inputs are named after the forward values saved for it, and a value taken
    out of a tuple is called ``getitem``: loaded, such an input was made a call of operator.getitem,
    the entry refused ("a str is expected") and every new process compiled the graph again (a conv
    mixer, once its convolutions were accelrun's own ops)."""
    import operator

    from torch import fx

    from accelrun.compile.output_code import pack_graph, unpack_graph

    g = fx.Graph()
    saved = g.placeholder("getitem")
    pair = g.call_function(torch.ops.aten.var_mean.correction, (saved, [0]))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (g.call_function(operator.getitem, (pair, 1)), saved)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    back = unpack_graph(pack_graph(gm))
    assert [(n.op, n.target) for n in back.graph.nodes] == [(n.op, n.target) for n in gm.graph.nodes]
    x = torch.randn(4, 3)
    torch.testing.assert_close(back(x), gm(x))


def test_a_saved_graph_keeps_whether_its_layouts_are_fixed():
    """A loaded graph's nodes have no fake tensors; the flag saved with it lets its views be collapsed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from accelrun.compile.fast_calls import runnable
    from accelrun.compile.output_code import pack_graph, unpack_graph

    gm = make_fx(lambda x: x.view(6).mul(2).view(2, 3).t().mul(1), tracing_mode="fake")(torch.randn(3, 2))
    back = unpack_graph(pack_graph(gm))
    assert back.meta["static_layouts"] is True
    run, x = runnable(back), torch.randn(3, 2)
    for _ in range(3):
        assert torch.equal(run(x), gm(x))
    assert run.collapsed == 2


def test_precompiles_where_torch_leaves_aot_compile_off():
    """torch 2.11 (the H200's, 2026-11-27) leaves ``torch.compile(...).aot_compile`` off by default:
    every graph was refused and a new process compiled everything again. The cache turns it on itself."""
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert not hasattr(torch.compile(lambda x: x), "aot_compile")  # what such a torch gives
        cold = step(*COMPILED)[2]
    assert cold.graph_cache["compiled"] == cold.graph_cache["saved"] == 2, cold.graph_cache
    assert not cold.graph_cache["errors"]


def test_precompiles_where_torch_wraps_only_inductors_graphs(monkeypatch):
    """torch 2.11 wraps only Inductor's graphs for saving and refused accelrun's ("does not implement
    SerializableCallable", H200, 2026-11-27): a new process traced and lowered again. The backend hands
    over a graph torch can save as it is, which torch 2.13 must not wrap a second time either."""
    import torch._dynamo.aot_compile as aot_compile

    wrapped = []
    monkeypatch.setattr(aot_compile, "BundledAOTAutogradSerializableCallable",
                        lambda fn: wrapped.append(fn) or fn)  # torch's own wrapping: a no-op, as in 2.11
    eager = step()
    cold = step(*COMPILED)
    torch._dynamo.reset()
    warm = step(*COMPILED)
    assert not wrapped  # torch found nothing left to wrap
    assert cold[2].graph_cache["saved"] == 2 and not cold[2].graph_cache["errors"], cold[2].graph_cache
    assert warm[2].graph_cache["loaded"] == 2 and warm[2].graph_cache["compiled"] == 0, warm[2].graph_cache
    assert_close(warm, eager, rel=1e-5)


def test_a_miss_after_accelrun_torch_or_the_options_changed_says_which(monkeypatch):
    """Entries are keyed by torch's version, accelrun's code and the compile options too: a run after
    an upgrade (or an edit of accelrun's source) compiles again, and says why rather than nothing
    (found by a new user); the first run says nothing, and so does a load."""
    import accelrun.compile.graph_cache as graph_cache

    first = step(*COMPILED)[2]
    assert first.graph_cache["saved"] == 2 and first.graph_cache["state_changed"] == []
    version = torch.__version__
    with monkeypatch.context() as changed:
        changed.setattr(graph_cache, "accelrun_source_digest", lambda: "an-edited-accelrun")
        torch._dynamo.reset()
        edited = step(*COMPILED)[2]
        assert edited.graph_cache["compiled"] == 2 and edited.graph_cache["loaded"] == 0, edited.graph_cache
        assert edited.graph_cache["state_changed"] == ["another version of accelrun's code (upgraded, switched or "
                                                       "edited since)"]
        assert "not from the graph cache, which holds these graphs for another version of accelrun's code" \
            in edited.compiled_line()
        changed.setattr(graph_cache.torch, "__version__", "9.9.9")
        torch._dynamo.reset()
        newer = step(*COMPILED)[2]
        # the nearest saved entry's differences: the edited code's differ in torch alone
        assert newer.graph_cache["state_changed"] == [f"torch {version}, not 9.9.9"], newer.graph_cache
    torch._dynamo.reset()
    again = step(*COMPILED)[2]
    assert again.graph_cache["loaded"] == 2 and again.graph_cache["state_changed"] == [], again.graph_cache


@pytest.fixture
def threads():
    """set(n): run at n threads; the test's end restores the thread count it started with."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_each_thread_count_has_its_own_entry(threads):
    """Dynamo's guards check the thread count (train.threads = auto picks it by the machine's load):
    2 then 1 then 1 threads compiled twice and then loaded, with no entry rejected on the way."""
    threads(2)
    first = step(*COMPILED)
    threads(1)
    torch._dynamo.reset()
    _, _, one = step(*COMPILED)
    assert one.graph_cache["compiled"] == 2 and one.graph_cache["loaded"] == 0, one.graph_cache
    assert one.graph_cache["errors"] == []  # before: "could not load ...: its guards reject these inputs"
    # Said where the user looks, not left to guess why a cached run compiled again.
    assert one.graph_cache["state_changed"] == ["threads 2, not 1"], one.graph_cache
    assert "not from the graph cache, which holds these graphs for threads 2, not 1" \
        in one.compiled_line()
    torch._dynamo.reset()
    again = step(*COMPILED)
    assert again[2].graph_cache["loaded"] == 2 and again[2].graph_cache["compiled"] == 0, again[2].graph_cache
    assert again[2].graph_cache["state_changed"] == [] and "not loaded" not in again[2].compiled_line()
    # Every state an entry of this code was saved under is kept beside it, not only the last one.
    sidecars = list(Path(os.environ["ACCELRUN_CACHE_DIR"]).rglob("*.state"))
    assert sidecars and all([s["threads"] for s in json.loads(f.read_text())] == ["2", "1"] for f in sidecars)
    assert_close(again, first, rel=1e-5)


def test_a_rejected_entry_leaves_nothing_in_the_record(threads, monkeypatch):
    """A load whose guards reject the inputs is compiled afresh: only what runs is counted (its graphs,
    regions and ATen ops once, not once for the rejected entry and again for the new one)."""
    import accelrun.compile.graph_cache as graph_cache

    monkeypatch.setattr(graph_cache, "global_state", lambda: {"any": "one key for every thread count"})
    threads(2)
    _, _, cold = step(*COMPILED)
    threads(1)
    torch._dynamo.reset()
    _, _, rejected = step(*COMPILED)
    assert rejected.graph_cache["compiled"] == 2 and rejected.graph_cache["loaded"] == 0
    # a miss, counted apart from the errors (the terminal printed it as one: a walk found it noise)
    assert rejected.graph_cache["rejected"] == 2 and rejected.graph_cache["errors"] == [], rejected.graph_cache
    assert len(rejected.graphs) == len(cold.graphs)
    assert rejected.regions_per_executor() == cold.regions_per_executor()
    assert sum(g.left_to_aten for g in rejected.graphs) == sum(g.left_to_aten for g in cold.graphs)
    assert "graph cache load" not in rejected.stage_seconds


def test_frames_compiled_through_the_graph_cache_are_counted():
    """Precompiling and loading go around Dynamo's frame counters: report.md said "Dynamo frames seen /
    compiled / skipped 0 / 0 / 0" beside "graphs compiled 2"."""
    from accelrun.report.markdown import _compiler_section

    for way in ("2 traced to be saved in the graph cache", "2 loaded from the graph cache"):  # cold, cached
        torch._dynamo.reset()
        record = step(*COMPILED)[2]
        summary = record.summary()
        assert summary["dynamo"]["frames_compiled"] == summary["graphs_in_use"] == 2, summary["dynamo"]
        assert f"| Dynamo frames seen / given a graph / skipped | 2 / 2 / 0 ({way}) |" in _compiler_section(summary)


def test_a_graph_cache_error_is_a_row_of_report_md():
    from accelrun.report.markdown import _compiler_section

    section = {"graph_cache": {"loaded": 0, "saved": 2, "errors": ["could not load a.pt: RuntimeError: boom"]}}
    assert "| graph cache: not used or not saved, why | 1: could not load a.pt: RuntimeError: boom |" in _compiler_section(section)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_users_block_with_a_graph_break_honours_fullgraph(tmp_path, fullgraph):
    """A user's repeated blocks go through the graph cache; one with a graph break cannot be
    precompiled and falls back to torch.compile. Under compile.fullgraph the fallback keeps it, so the
    break fails the run as it does with the cache off; it had split the graph without a word."""
    from accelrun.config.schema import CompileConfig

    class Block(BreaksAfterLinear):
        def forward(self, x):
            return super().forward(x) + x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for block in self.stack:
                x = block(x)
            return x.sum()

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 8)
    expected = model(x)
    cfg = CompileConfig(backend="accelrun", scope="block", fullgraph=fullgraph, executors=["cpp", "aten"],
                        cache_dir=str(tmp_path / "c"))  # fmt: skip
    compiled = compile_model(model, None, cfg)
    stats = compiled.record.graph_cache
    assert "off" not in stats, stats  # the blocks went through the graph cache
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
            model(x)
        assert stats["fallbacks"] == 1 and "precompile failed" in stats["errors"][0], stats
        return
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=0)
    assert compiled.record.graphs_in_use() > 0
    assert stats["fallbacks"] == 1 and "precompile failed" in stats["errors"][0], stats
    # What Dynamo saw is what it sees with the cache off: the refused precompile's trace is not counted
    # on top of its fallback's (it had added its graph break as a second reason).
    seen = compiled.record.summary()["dynamo"]  # (Dynamo's counters are process-wide: read before)
    torch._dynamo.reset()
    other = Net()
    uncached = compile_model(other, None, cfg.model_copy(update={"graph_cache": False}))
    other(x)
    assert uncached.record.graph_cache == {"off": "compile.graph_cache = false"}
    assert seen == uncached.record.summary()["dynamo"]


class ScaledBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class TwoScaledBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = torch.nn.ModuleList([ScaledBlock(), ScaledBlock()])

    def forward(self, x):
        for block in self.stack:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("shared", [False, True])
def test_hooks_inside_a_cached_method_are_not_skipped(tmp_path, shared):
    """A block's own hooks run around its cached method, eagerly, as Module.__call__ runs them. Hooks on
    a module inside a block are traced into its graph, and torch skips guards on hooks: an entry traced
    without one loaded in a new process, or was reused by an identical block, and skipped it (the loss
    differed from eager's). Such a method now goes to torch.compile, with guards on hooks.
    ``shared``: both blocks take inputs that need gradients, so they share one entry."""
    from accelrun.config.schema import CompileConfig

    def doubled(_module, _args, out):
        return out * 2

    def shifted(_module, _args, out):
        return out + 1

    def run(hook_inside: bool, compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TwoScaledBlocks()
        model.stack[0].register_forward_hook(doubled)  # on the block, whose forward is cached
        if hook_inside:
            model.stack[1].lin.register_forward_hook(shifted)  # inside the second block only
        record = None
        if compiled:
            cfg = CompileConfig(backend="accelrun", scope="block", executors=["cpp", "aten"],
                                cache_dir=str(tmp_path / "c"))  # fmt: skip
            record = compile_model(model, None, cfg).record
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(shared)
        loss = model(x)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, record

    entries = 1 if shared else 2  # unshared: the first block's input needs no gradient, the second's does
    for hook_inside, expected in ((False, {"compiled": entries, "loaded": 0, "fallbacks": 0}),
                                  (False, {"compiled": 0, "loaded": entries, "fallbacks": 0}),
                                  (True, {"compiled": 0, "fallbacks": 1})):  # fmt: skip
        eager_loss, eager_grads, _ = run(hook_inside, compiled=False)
        loss, grads, record = run(hook_inside, compiled=True)
        stats = record.graph_cache
        assert {k: stats[k] for k in expected} == expected, (hook_inside, stats)
        assert record.graphs_in_use() > 0
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6)
    assert stats["errors"] == ["hooks on lin (the graph cache keys no hooks)"], stats


def test_a_loaded_graph_decides_on_cuda_graphs_from_the_inputs_it_was_compiled_for(monkeypatch):
    """torch's precompile loads a graph with no example inputs (an empty list). Deciding from those,
    the H200's warm process found "the graph takes no tensors" for every graph and captured none
    (2026-12-04); the facts read when the graph was compiled travel with it instead. Here a graph that
    takes CPU tensors is declined for that reason, cold and loaded alike; and, with CPU tensors
    accepted, a loaded graph is set to replay."""
    from accelrun.compile import cuda_graphs, output_code
    from accelrun.compile.cuda_graph_policy import CudaGraphDecision, CudaGraphMode, CudaGraphsReport

    on = CudaGraphDecision(True, "CUDA, one rank")
    cold = step(*COMPILED, cuda_graphs=CudaGraphsReport(CudaGraphMode.ON, on))[2]
    torch._dynamo.reset()
    warm = step(*COMPILED, cuda_graphs=CudaGraphsReport(CudaGraphMode.ON, on))[2]
    assert warm.graph_cache["loaded"] == 2, warm.graph_cache
    assert set(cold.cuda_graphs.declined.values()) == {"the graph takes CPU tensors"}, cold.cuda_graphs.declined
    assert warm.cuda_graphs.declined == cold.cuda_graphs.declined  # not "the graph takes no tensors"

    monkeypatch.setattr(cuda_graphs, "decide_for_graph",
                        lambda run, facts: on if facts.devices else CudaGraphDecision.no("no tensors"))  # fmt: skip
    runners = []
    monkeypatch.setattr(output_code, "shared_capture", lambda report: None)  # no CUDA here: the graphs run
    monkeypatch.setattr(output_code, "CudaGraphRunner", lambda run, *a: runners.append(a[0]) or run)
    torch._dynamo.reset()
    loaded = step(*COMPILED, cuda_graphs=CudaGraphsReport(CudaGraphMode.ON, on))
    assert loaded[2].graph_cache["loaded"] == 2 and not loaded[2].cuda_graphs.declined, loaded[2].cuda_graphs
    assert sorted(runners) == ["g0.backward", "g0.forward", "g1.backward", "g1.forward"]  # each set to replay
    assert_close(loaded, step(), rel=1e-5)


def test_a_state_change_of_autocast_is_said_in_words():
    # It was said as Python tuples: "autocast [('cpu', False, torch.bfloat16), ...], not [('cpu', True, ...)]".
    from accelrun.compile.graph_cache import state_changes

    off = "[('cpu', False, torch.bfloat16), ('cuda', False, torch.float16)]"
    on = "[('cpu', True, torch.bfloat16), ('cuda', False, torch.float16)]"
    assert state_changes({"autocast": off, "threads": "2"}, {"autocast": on, "threads": "2"}) == \
        ["autocast off, not autocast cpu bfloat16"]


def test_a_precompile_refused_at_a_graph_break_says_so_in_the_user_s_words():
    """Found by a new-user trial: the report said "UserError: Consider annotating your code using
    torch._check*(). Could not guard on data-dependent expression zuf0 > 10000.0"."""
    from accelrun.compile.graph_cache import graph_break_said

    def checked(x):
        if x.abs().max().item() > 1e4:
            return x / 2
        return x * 2

    def branched(x):
        if x.sum() > 0:
            return x / 2
        return x * 2

    said = []
    for fn in (checked, branched):
        torch._dynamo.reset()
        with pytest.raises(Exception) as raised:  # noqa: PT011 (Dynamo's own exception types)
            torch.compile(fn, backend="eager", fullgraph=True)(torch.randn(4))
        said.append(graph_break_said(raised.value))
    torch._dynamo.reset()
    assert all(s is not None and s.startswith("the forward has a graph break (") for s in said), said
    assert all("zuf0" not in s and "torch._check" not in s for s in said), said
    assert graph_break_said(RuntimeError("disk full")) is None


def test_a_new_variant_takes_a_free_slot_else_the_least_recently_used(tmp_path):
    from accelrun.compile.graph_cache import MAX_VARIANTS, slot_for, variant_path, variants_of

    base = tmp_path / "k-0.pt"
    assert variants_of(base) == [] and slot_for(base, []) == base
    for n in range(1, MAX_VARIANTS + 1):
        variant_path(base, n).write_bytes(b"x")
        os.utime(variant_path(base, n), ns=(n * 10**9, n * 10**9))  # older the lower n
    os.utime(variant_path(base, 2), ns=(99 * 10**9, 99 * 10**9))  # 2 just used
    held = variants_of(base)
    assert held[0] == variant_path(base, 2) and held[-1] == base and len(held) == MAX_VARIANTS
    assert slot_for(base, held) == base  # the least recently used goes
    assert slot_for(base, [p for p in held if p != variant_path(base, 3)]) == variant_path(base, 3)  # a free one
    assert variant_path(base, 3).name == "k-0.v3.pt"
    # one that could not be read goes first, written over rather than removed (another process may
    # have just replaced it with a good entry)
    assert slot_for(base, held, [variant_path(base, 4)]) == variant_path(base, 4)
    # one traced from a file edited since goes before a good one, but only once no slot is free
    assert slot_for(base, held, stale=[variant_path(base, 2)]) == variant_path(base, 2)
    assert slot_for(base, held[:-1], stale=[variant_path(base, 2)]) == base
    variant_path(base, 3).unlink()
    assert variant_path(base, 3) not in variants_of(base) and len(variants_of(base)) == MAX_VARIANTS - 1


def test_a_mixture_of_experts_block_is_one_entry_for_any_routing():
    """The MoE's experts split their rows by counts read on the host: in the graph cache's whole-graph
    trace those are sizes read at run time (``traces_host_reads``), one entry for any routing, which a
    new compile loads. The trace ran with Dynamo's capture_scalar_outputs on, which the compiling
    process's own guards check: checked with it off, every call missed and compiled another entry (8 in
    8 calls, then a fallback). Losses and gradients against eager's."""
    moe = ["model.arch=moe", "model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_dim=48",
           "compile.backend=accelrun", "compile.scope=block", "compile.executors=[cpp,aten]"]
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *moe]).config
    eager = build_model(cfg.model, torch.device("cpu"), seed=0)
    records = []
    for _ in range(2):  # compiled, then loaded by a fresh compile of a fresh model
        torch._dynamo.reset()
        model = build_model(cfg.model, torch.device("cpu"), seed=0)
        compiled = compile_model(model, transformer_blocks(model), cfg.compile)
        for seed in range(3):  # each batch routes its tokens otherwise
            gen = torch.Generator().manual_seed(seed)
            tokens, targets = (torch.randint(0, cfg.model.vocab_size, (4, 32), generator=gen) for _ in range(2))
            got, want = training_loss_fn(model)(tokens, targets), training_loss_fn(eager)(tokens, targets)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
            got.backward()
            want.backward()
            for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
                a.grad = b.grad = None
        records.append(compiled.record)
        assert sum(compiled.record.graph_breaks.values()) == 0, compiled.record.graph_breaks
        assert compiled.record.regions_per_executor().get("cpp", 0) > 0
    cold, warm = (r.graph_cache for r in records)
    assert cold["compiled"] == 1 and cold["fallbacks"] == 0 and not cold["errors"], cold
    assert warm["loaded"] == 1 and warm["compiled"] == 0 and warm["fallbacks"] == 0, warm
    torch._dynamo.reset()


def test_a_refusal_at_an_rnns_break_promises_no_way_round():
    """An RNN runs at a graph break that nothing avoids (compile/eager_rnns.py): the graph cache's refusal had
    said the warning gives "what avoids it" (a new user's LSTM)."""
    from accelrun.compile.eager_rnns import REASON
    from accelrun.compile.graph_cache import graph_break_said

    Unsupported = type("Unsupported", (Exception,), {"__module__": "torch._dynamo.exc"})  # noqa: N806
    rnn = graph_break_said(Unsupported(f"Skip inlining `torch.compiler.disable()`d function\n  (reason: {REASON})"))
    assert rnn.endswith("which cannot be saved; the graph-break warning says where"), rnn
    other = graph_break_said(Unsupported("Data-dependent branching\n  Explanation: ..."))
    assert other.endswith("the graph-break warning says where, and what avoids it where something does"), other


def test_a_precompile_failure_is_said_once_in_a_whole_sentence():
    """A new user's model (scope model, hand-written checkpointing): torch's AOTAutograd cache logged its
    "unable to serialize" warning with a link on the console, and the report's line stopped mid-word."""
    import logging

    from accelrun.compile.graph_cache import _autograd_cache_quiet, one_line
    from tests.logs import logged

    torch_says = ("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor). If you're using "
                  "torch.compile/export/fx, it is likely that we are erroneously tracing into a custom kernel. To "
                  "fix this, please wrap the custom kernel into an opaque custom op. Please see the following for "
                  "details: https://pytorch.org/tutorials/advanced/custom_ops_landing_page.html")
    assert one_line(RuntimeError(torch_says)) == ("RuntimeError: Cannot access data pointer of Tensor (e.g. "
                                                  "FakeTensor, FunctionalTensor).")
    assert one_line(ValueError("short. Kept whole.")) == "ValueError: short. Kept whole."

    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    with logged("torch._functorch._aot_autograd.autograd_cache") as seen:
        with _autograd_cache_quiet():
            logger.warning("AOTAutograd cache unable to serialize compiled graph: %s", torch_says)
            logger.warning("another warning")
        logger.warning("AOTAutograd cache unable to serialize compiled graph: after")
    assert seen == ["another warning", "AOTAutograd cache unable to serialize compiled graph: after"]


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_a_model_typed_into_python_without_a_file_trains_uncached_and_says_why(tmp_path, how):
    """A compiler engineer's trial: a model class defined in ``python -`` (or ``-c``, a REPL) crashed its
    first step: the graph cache's key reads the source file of each module class."""
    script = (
        "import torch\nfrom torch import nn\n"
        "from accelrun.compile.compile_model import compile_model\n"
        "from accelrun.config.schema import CompileConfig\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n        return self.lin(x).relu().sum()\n"
        "torch.manual_seed(0)\nmodel = Net()\n"
        "c = compile_model(model, None, CompileConfig(backend='accelrun', scope='model', executors=['cpp', 'aten']))\n"
        "model(torch.randn(4, 8)).backward()\n"
        "print(c.record.graph_cache['off']); print(c.record.dynamo_graphs)\n"
    )
    env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path)}
    args, stdin = ([sys.executable, "-"], script) if how == "stdin" else ([sys.executable, "-c", script], None)
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    off, graphs = done.stdout.strip().splitlines()[-2:]
    assert off.startswith("Net is defined in ") and off.endswith(": its graphs are compiled afresh in each process")
    assert int(graphs) == 1  # compiled all the same


ACTIVATION_MODEL = '''
import json, sys, torch, torch.nn.functional as F
from torch import nn
from accelrun.compile.compile_model import compile_model
from accelrun.config.schema import CompileConfig

class Net(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), act

    def forward(self, x):
        return self.act(self.lin(x)).sum()

torch.manual_seed(0)
model = Net({"silu": F.silu, "tanh": torch.tanh, "gelu": F.gelu}[sys.argv[1]])
eager = model(torch.ones(4, 8)).item()
compiled = compile_model(model, None, CompileConfig(backend="accelrun", scope="model", executors=["cpp", "aten"]))
print(json.dumps({"out": model(torch.ones(4, 8)).item(), "eager": eager, "cache": compiled.record.graph_cache}))
'''


def test_a_function_held_in_an_attribute_is_checked_on_load(tmp_path):
    """A compiler engineer's trial: ``self.act`` chosen by a constructor's argument; a new process with
    tanh (and then gelu) loaded the graph compiled for silu, Dynamo's identity guard on the function
    being one torch's precompile drops."""
    (tmp_path / "net.py").write_text(ACTIVATION_MODEL)
    env = {**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "cache")}

    def run(act: str) -> dict:
        done = subprocess.run([sys.executable, str(tmp_path / "net.py"), act], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    runs = {act: run(act) for act in ("silu", "tanh", "gelu")}
    for act, result in runs.items():
        assert result["out"] == pytest.approx(result["eager"], rel=1e-5), (act, result)
        assert result["cache"]["loaded"] == 0 and result["cache"]["compiled"] == 1, (act, result["cache"])
    again = run("tanh")  # each function's entry is kept and loads for it
    assert again["cache"]["loaded"] == 1 and again["out"] == pytest.approx(again["eager"], rel=1e-5), again
