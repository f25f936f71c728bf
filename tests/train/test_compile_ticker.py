"""A compile that runs long says what it is doing: the compiler's stages reach the activity record, and
the ticker turns it into a line now and then (none for a short compile)."""

from __future__ import annotations

import re
import threading
import time

import torch
from click.testing import CliRunner
from torch import nn

from accelrun.cli.main import cli
from accelrun.compile.activity import ACTIVITY, DYNAMO_TRACES, CompileActivity
from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions
from accelrun.train.compile_ticker import CompileTicker
from tests.conftest import DEFAULT_CONFIG, TINY


def test_a_short_compile_says_nothing_a_long_one_says_what_it_does_then_that_it_ended():
    activity, lines = CompileActivity(), []
    ticker = CompileTicker(lines.append, activity, first_after=10, every=15)
    activity.begin("Dynamo traces Block.forward")
    t0 = activity.now().began
    ticker.check(t0 + 9)
    assert lines == []  # the default recipe's 2 s compile prints nothing
    activity.doing("g0.backward: post_grad pass remat (812 ops)")
    stage_t0 = activity.now().stage_began
    ticker.check(stage_t0 + 11)
    assert len(lines) == 1 and "g0.backward: post_grad pass remat (812 ops) (11 s in it)" in lines[0], lines
    ticker.check(stage_t0 + 12)
    assert len(lines) == 1  # not again before `every`
    activity.tracing_again()  # back from the backend: the outer compile's own words
    ticker.check(stage_t0 + 27)
    assert len(lines) == 2 and "Dynamo traces Block.forward" in lines[1]
    activity.end()
    ticker.check(activity.ended_at + 1)
    assert len(lines) == 2  # it may go on (a graph break's next frame): not yet said to be done
    ticker.check(activity.ended_at + 3)
    assert len(lines) == 3 and lines[2] == f"compile done after {activity.ended_at - t0:.0f} s"
    ticker.check(activity.ended_at + 60)
    assert len(lines) == 3  # nothing compiles: nothing to say


def test_compiles_back_to_back_are_one_count_and_one_done_line(monkeypatch):
    """A graph break's next frame, or the fallback after a refused precompile, starts a compile right
    after the last one ended: the count goes on, and "done" is said once, after the last."""
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    activity, lines = CompileActivity(), []
    ticker = CompileTicker(lines.append, activity, first_after=10, every=15)
    activity.begin()  # t=0
    activity.end()  # t=1
    activity.begin()  # t=2: within the gap
    ticker.check(12.0)
    assert lines == ["still compiling, 12 s so far: Dynamo traces the Python code (10 s in it)"]
    activity.end()  # t=3
    activity.begin()  # t=4
    ticker.check(30.0)
    assert len(lines) == 2 and lines[1].startswith("still compiling, 30 s so far")
    activity.end()  # t=5
    activity.begin()  # t=6
    activity.end()  # t=7
    activity.begin()  # t=8: 1 s after: the same compiling still
    activity.end()  # t=9
    ticker.check(20.0)
    assert lines[-1] == "compile done after 9 s", lines
    # one further apart: a new count, which says nothing while it is short
    for _ in range(5):
        next(clock)  # t=10..14
    activity.begin()  # t=15
    ticker.check(18.0)
    assert len(lines) == 3 and activity.now().since == 15.0


def test_another_backends_compile_is_named_for_it():
    activity, lines = CompileActivity(), []
    ticker = CompileTicker(lines.append, activity, first_after=10, every=15, unstaged="Dynamo and inductor compile")
    activity.begin()
    ticker.check(activity.now().began + 20)
    assert lines[0].endswith("so far: Dynamo and inductor compile"), lines  # no stage, no time in one


def test_the_loop_settles_a_compile_that_ended_before_its_step_line():
    """The training loop's progress line for the compiling step comes after "compile done", not 2 s
    before it (the gap another compile may still go on within)."""
    activity, lines = CompileActivity(), []
    ticker = CompileTicker(lines.append, activity, first_after=0, every=15)
    activity.begin()
    ticker.check(activity.now().began + 1)
    ticker.settle()
    assert len(lines) == 1  # still compiling: nothing to settle
    activity.end()
    ticker.settle()
    assert len(lines) == 2 and lines[1].startswith("compile done after ")
    activity.begin()  # a recompile at once (the next step): its own count, not the one said done
    assert activity.now().since == activity.now().began


def test_nested_compiles_are_one():
    # The graph cache's precompile marks its compile, and Dynamo's callbacks inside it mark theirs.
    activity = CompileActivity()
    with activity.compiling("Dynamo traces Block.forward"):
        began = activity.now().began
        with activity.compiling():
            assert activity.now().began == began and activity.now().stage == "Dynamo traces Block.forward"
        assert activity.now() is not None
    assert activity.now() is None


def test_the_backend_says_each_stage_of_a_real_compile(monkeypatch):
    stages: list[str] = []
    doing = ACTIVITY.doing
    monkeypatch.setattr(ACTIVITY, "doing", lambda stage: (stages.append(stage), doing(stage)))
    seen_compiling = []
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()  # which drops every callback: listening again registers them again
    ACTIVITY.listen_to_dynamo()
    ACTIVITY.listen_to_dynamo()
    monkeypatch.setattr(backend, "collect_graph_breaks", lambda: seen_compiling.append(ACTIVITY.now()))
    try:
        compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert backend.record.regions  # it compiled
    assert seen_compiling and seen_compiling[0] is not None  # Dynamo's callbacks marked the compile
    # back from the backend's stages to Dynamo's (its guards)
    assert seen_compiling[0].stage == DYNAMO_TRACES
    assert "g0: AOTAutograd traces the forward and backward" in stages
    assert ACTIVITY.now() is None  # and its end
    assert "g0: pre_grad passes" in stages
    assert any(s.startswith("g0.forward: lowering to cpp/aten (") for s in stages)
    assert any(s.startswith("g0.backward: post_grad pass ") for s in stages)
    assert any(s.startswith("g0.pre_grad: pass fuse_rmsnorm (") for s in stages), stages
    assert any(s.startswith("g0.forward: post_grad pass ") for s in stages), stages


def test_the_ticker_thread_prints_while_a_compile_runs():
    activity, lines, said = CompileActivity(), [], threading.Event()

    def say(line):
        lines.append(line)
        said.set()

    with CompileTicker(say, activity, first_after=0.05, every=10, poll=0.01):
        with activity.compiling(DYNAMO_TRACES):
            assert said.wait(5)
        time.sleep(0.05)
    assert lines[0].startswith("still compiling") and DYNAMO_TRACES in lines[0]
    assert lines[-1].startswith("compile done after")


def test_a_run_prints_the_lines_of_a_compile_longer_than_the_threshold(tmp_path, monkeypatch):
    # The default recipe compiles in ~2 s, under the 10 s threshold: lowered to 0 here, a run says it.
    from accelrun.train import compile_ticker

    monkeypatch.setattr(compile_ticker, "FIRST_AFTER_S", 0.0)
    monkeypatch.setattr(compile_ticker, "POLL_S", 0.01)
    args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=2", f"report.runs_dir={tmp_path}",
            "checkpoint.resume=none", "compile.backend=accelrun", "compile.executors=[cpp,aten]",
            "compile.graph_cache=false", "report.progress=lines"]  # (TINY has none: no progress, no ticker)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert re.search(r"still compiling, \d+ s so far: ", result.output), result.output
    assert "compile done after " in result.output
    out = result.output
    assert out.index("the first step compiles") < out.index("still compiling") < out.index("compile done")
    assert out.index("compile done") < out.index("step      1/2"), out
