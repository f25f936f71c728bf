"""Deferred host reads (report.read_every): the loop keeps finished steps on the device and reads them
every few steps. Same metrics as reading every step; divergence and stop requests are acted on at the
next read, before any checkpoint; one synchronisation per read on CUDA (pretended with fake events)."""

from __future__ import annotations

import signal
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accelrun.train.run as train_run
from accelrun.config import load_config
from accelrun.dist import stop
from accelrun.report.metrics import read_metrics
from accelrun.train import loop
from accelrun.train.checkpoint import complete_checkpoints
from accelrun.train.entry import train
from accelrun.train.step_clock import StepClock
from accelrun.train.step_reads import PendingStep, PendingSteps, StepMarks, read_interval
from tests.conftest import DEFAULT_CONFIG
from tests.train.test_train_run import NAN_MODEL

MOE = ["model.arch=moe", "model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_dim=48",
       "model.capacity_factor=1.0", "model.aux_loss_coef=0.05"]


def run(overrides, **kw):
    return train(load_config(DEFAULT_CONFIG, overrides), command="test", **kw)


@pytest.fixture
def reads(monkeypatch):
    """How many steps each host read of the loop returned, in order."""
    sizes: list[int] = []
    real = PendingSteps.read

    def spy(self):
        records = real(self)
        sizes.append(len(records))
        return records

    monkeypatch.setattr(PendingSteps, "read", spy)
    return sizes


def test_reading_every_4_steps_writes_what_reading_every_step_writes(tiny, reads):
    # An MoE model, so the router's totals (all-reduced per step, read later) are compared too.
    every = run(tiny(9, "name=r1", "checkpoint.enabled=false", "report.log_every=1", "report.read_every=1", *MOE))
    assert reads == [1] * 9
    reads.clear()
    deferred = run(tiny(9, "name=r4", "checkpoint.enabled=false", "report.log_every=1", "report.read_every=4", *MOE))
    assert reads == [1, 3, 4, 1]  # the first step, steps 4 and 8, the last: four synchronisations, not nine
    assert deferred.status == "finished" and deferred.report["steps"] == 9

    want, got = (read_metrics(r.run_dir / "metrics.jsonl") for r in (every, deferred))
    same = ("step", "loss", "grad_norm", "lr", "tokens", "moe_aux_loss", "moe_tokens_per_expert",
            "moe_imbalance", "moe_dropped_tokens", "moe_dropped_frac")
    assert [{k: r[k] for k in same} for r in got] == [{k: r[k] for k in same} for r in want]  # fp32 CPU: exact
    assert list(got[0]) == list(want[0])  # the same keys, in the same order
    for r in got:  # the step's time is its clock's: from its start mark to the optimizer's end
        parts = r["data_time_s"] + r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        assert r["step_time_s"] >= parts * (1 - 1e-9) > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])


def test_a_step_that_diverges_between_reads_is_named_and_no_checkpoint_follows_it(tiny, tmp_path, monkeypatch,
                                                                                  reads):
    # A module name of its own: test_train_run imports its NaN model as `nanmodel` (sys.modules keeps it).
    (tmp_path / "nan_at_5.py").write_text(NAN_MODEL.replace("{n}", "5"))  # NaN from the 5th step on
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(loop.TrainingDiverged) as e:
        run(tiny(12, "checkpoint.every=3", "report.read_every=4", "model.custom=nan_at_5:build", "name=nan"))
    # Reads at step 1 (the first), 3 (before its checkpoint), 4, then 6: step 6's checkpoint is due, so
    # its read comes first and finds step 5; nothing is saved after it.
    assert reads == [1, 2, 1, 2]
    assert "the loss became nan at step 5" in str(e.value) and "step-000003" in str(e.value)
    (d,) = list((tmp_path / "runs" / "nan").iterdir())
    assert [c.step for c in complete_checkpoints(d / "checkpoints")] == [3]
    assert [r["step"] for r in read_metrics(d / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_stop_request_between_reads_stops_at_the_next_read_with_a_checkpoint(tiny, monkeypatch, reads):
    steps_done, asked_at = [0], []
    real_clip = loop.clip_grad_norm_

    def counting_clip(*args, **kwargs):  # called once per step
        steps_done[0] += 1
        return real_clip(*args, **kwargs)

    def requested():  # SIGTERM arrives during step 5
        asked_at.append(steps_done[0])
        return signal.SIGTERM if steps_done[0] >= 5 else 0

    monkeypatch.setattr(loop, "clip_grad_norm_", counting_clip)
    monkeypatch.setattr(stop, "requested", requested)
    result = run(tiny(12, "checkpoint.every=100", "report.read_every=4", "name=stop"))
    assert result.status == "preempted"
    assert asked_at == [1, 4, 8, 8]  # only at reads: steps 1 and 4, then step 8 (whether, then which signal)
    assert reads == [1, 3, 4]
    assert [c.step for c in complete_checkpoints(result.run_dir / "checkpoints")] == [8]
    assert [r["step"] for r in read_metrics(result.run_dir / "metrics.jsonl")] == list(range(1, 9))


class HostReads(TorchDispatchMode):
    """Notes every read of a tensor's value on the host that would wait for a GPU: item, float, int,
    bool (aten's _local_scalar_dense) and tolist, each as its caller's module, and whether it came
    from inside the loop's reads (``PendingSteps.read``)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reading = 0
        self.seen: list[tuple[bool, str]] = []
        real_read, real_tolist = PendingSteps.read, torch.Tensor.tolist
        reads = self

        def read(pending):
            reads.reading += 1
            try:
                return real_read(pending)
            finally:
                reads.reading -= 1

        def tolist(t):
            reads.note()
            return real_tolist(t)

        monkeypatch.setattr(PendingSteps, "read", read)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    def note(self) -> None:
        frame = sys._getframe(2)
        while frame.f_globals["__name__"].startswith("torch"):  # the caller: the first frame outside torch
            frame = frame.f_back
        self.seen.append((self.reading > 0, frame.f_globals["__name__"]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note()
        return func(*args, **(kwargs or {}))


def test_between_reads_the_loop_reads_no_tensor_on_the_host(tiny, monkeypatch):
    # A dense model (the CPU MoE's experts read their row counts on the host; CUDA's grouped_mm does not).
    spy = HostReads(monkeypatch)
    with spy:
        float(torch.ones(()))  # the spy sees what it must see
    assert spy.seen == [(False, __name__)]
    spy.seen.clear()
    real_loop = train_run.run_loop

    def spied_loop(*args, **kwargs):
        with spy:
            return real_loop(*args, **kwargs)

    monkeypatch.setattr(train_run, "run_loop", spied_loop)
    result = run(tiny(8, "name=reads", "checkpoint.enabled=false", "report.read_every=4"))
    assert result.status == "finished" and result.report["steps"] == 8
    # The batches' window indices are made on the host (accelrun.data), never on a device.
    seen = [s for s in spy.seen if not s[1].startswith("accelrun.data")]
    assert seen == [(True, "accelrun.train.step_reads")] * 3  # one copy per read (steps 1, 4, 8), nothing else


class FakeEvent:
    """A CUDA event that records its place in the log; it may only be read after a synchronisation."""

    log: list[str] = []

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        FakeEvent.log.append("record")
        self.at = len(FakeEvent.log)

    def elapsed_time(self, end):
        assert "synchronize" in FakeEvent.log[max(self.at, end.at):], "read before a synchronisation after both"
        return 1000.0 * (end.at - self.at)


def test_one_synchronisation_reads_every_pending_step_on_cuda(monkeypatch):
    FakeEvent.log = log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    pending = PendingSteps(flops_per_token=None, peak_tflops=None)
    for step in (1, 2, 3):
        clock = StepClock(torch.device("cuda", 0))
        start, m0, m1, m2, m3, m4 = (clock.mark() for _ in range(6))
        router = torch.tensor([0.5, 2.0, 3.0, 10.0, 6.0], dtype=torch.float64) if step == 2 else None
        pending.add(PendingStep(step, clock, StepMarks(start, [(m0, m1, m2, m3)], m3, m4),
                                torch.tensor(step / 4), torch.tensor(float(step)), router, lr=0.1, tokens=64,
                                compile=False, mem_peak_bytes=100, mem_reserved_bytes=200, extras={"comm_s": 0.0}))
    assert "synchronize" not in log  # nothing read while steps are added
    records = pending.read()
    assert log.count("synchronize") == 1 and log[-1] == "synchronize"  # one, after every step's marks
    assert [r["step"] for r in records] == [1, 2, 3] and len(pending) == 0
    assert [r["loss"] for r in records] == [0.25, 0.5, 0.75] and [r["grad_norm"] for r in records] == [1, 2, 3]
    assert records[0]["step_time_s"] == pytest.approx(5.0)  # 5 marks later, 1 s each (the fake's scale)
    assert records[0]["forward_s"] == pytest.approx(1.0) and records[0]["mem_reserved_bytes"] == 200
    assert records[1]["moe_aux_loss"] == 0.25 and records[1]["moe_tokens_per_expert"] == [10, 6]
    assert "moe_aux_loss" not in records[0] and list(records[2])[-1] == "comm_s"
    assert pending.read() == [] and log.count("synchronize") == 1  # nothing pending: no synchronisation


def test_read_interval_is_every_step_on_a_cpu_and_log_every_on_an_accelerator():
    cfg = SimpleNamespace(report=SimpleNamespace(read_every=None, log_every=10))
    assert read_interval(cfg, torch.device("cpu")) == 1
    assert read_interval(cfg, torch.device("cuda", 0)) == 10
    cfg.report.read_every = 3
    assert read_interval(cfg, torch.device("cpu")) == read_interval(cfg, torch.device("cuda", 0)) == 3
