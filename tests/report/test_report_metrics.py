import json

import pytest
import torch

from accelrun.report import memory
from accelrun.report.metrics import STEP_FIELDS, MetricsWriter, StepMetrics, read_metrics


def _m(step, **kw):
    base = dict(step=step, loss=2.5, lr=1e-3, grad_norm=0.5, step_time_s=0.5, data_time_s=0.05,
                tokens=2048, mem_peak_bytes=1 << 20, compile=False)
    base.update(kw)
    return StepMetrics(**base)


def test_step_metrics_derives_throughput_tflops_and_mfu():
    d = _m(1).to_dict(flops_per_token=1e9, peak_tflops=8.0)
    assert tuple(d) == STEP_FIELDS
    assert d["tokens_per_s"] == 4096
    assert d["tflops"] == pytest.approx(4.096)
    assert d["mfu"] == pytest.approx(4.096 / 8.0)
    d = _m(1).to_dict(flops_per_token=1e9, peak_tflops=None)
    assert d["tflops"] == pytest.approx(4.096) and d["mfu"] is None
    d = _m(1).to_dict(flops_per_token=None, peak_tflops=8.0)
    assert d["tflops"] is None and d["mfu"] is None


def test_lines_are_flushed_while_the_file_is_open(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    w = MetricsWriter(path)
    for i in range(3):
        w.write(_m(i + 1, compile=i == 0).to_dict(flops_per_token=None, peak_tflops=None))
        lines = path.read_text().splitlines()  # another reader, while the writer still holds the file
        assert len(lines) == i + 1
        assert json.loads(lines[-1])["step"] == i + 1
    assert not w.closed
    w.close()
    assert [r["compile"] for r in read_metrics(path)] == [True, False, False]


def test_writer_appends_and_reader_skips_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write({"step": 1})
    with MetricsWriter(path) as w:
        w.write({"step": 2, "loss": float("nan")})
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # a run killed mid-write
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    with open(path, "w") as f:
        f.write('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_cpu_memory_is_measured():
    cpu = torch.device("cpu")
    peak, now = memory.peak_memory_bytes(cpu), memory.current_memory_bytes(cpu)
    assert peak > 10 * 2**20  # ru_maxrss is KiB on Linux: a torch process holds far more than 10 KiB
    assert now is None or 0 < now <= peak * 1.5
    memory.reset_peak_memory(cpu)  # a no-op, must not raise
    assert "RSS" in memory.describe_memory(cpu)


def test_cuda_memory_uses_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 123)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 45)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(d))
    cuda = torch.device("cuda", 0)
    assert memory.peak_memory_bytes(cuda) == 123
    assert memory.current_memory_bytes(cuda) == 45
    memory.reset_peak_memory(cuda)
    assert calls == [cuda]
    assert memory.peak_memory_bytes(torch.device("meta")) is None
