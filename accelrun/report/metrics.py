"""Per-step metrics, one JSON object per line in ``metrics.jsonl``.

Each line is flushed as soon as it is written, so a run that is killed keeps every step it finished;
:func:`read_metrics` skips a last line cut off mid-write. Lines are written by Python's ``json``:
a diverged loss appears as ``NaN``, which Python's ``json`` reads back.

Example::

    with MetricsWriter(run_dir / "metrics.jsonl") as w:
        m = StepMetrics(step=1, loss=5.2, lr=1e-3, grad_norm=0.9, step_time_s=0.31, data_time_s=0.01,
                        tokens=4096, mem_peak_bytes=peak_memory_bytes(device), compile=True)
        w.write(m.to_dict(flops_per_token=6 * n_params, peak_tflops=peak.tflops))
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

# The keys of one step's line, in the order they are written.
STEP_FIELDS = (
    "step", "loss", "lr", "grad_norm", "step_time_s", "data_time_s", "tokens", "tokens_per_s",
    "tflops", "mfu", "mem_peak_bytes", "compile",
)


@dataclass(frozen=True)
class StepMetrics:
    """What the training loop measured in one optimizer step on this device.

    ``step_time_s`` is the step's whole wall time, data loading included; ``data_time_s`` is the part
    spent waiting for the batch. ``tokens`` are this device's tokens in the step. ``compile`` is true
    when the step's time includes compilation (it is then left out of steady-state figures).
    """

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    data_time_s: float
    tokens: int
    mem_peak_bytes: int | None = None
    compile: bool = False

    def to_dict(self, *, flops_per_token: float | None, peak_tflops: float | None) -> dict:
        """The line for ``metrics.jsonl``, with throughput, achieved TFLOP/s and MFU derived.

        ``tflops`` is null without a FLOP count per token, ``mfu`` also without a known peak.
        """
        tokens_per_s = self.tokens / self.step_time_s if self.step_time_s > 0 else None
        tflops = (flops_per_token * tokens_per_s / 1e12
                  if flops_per_token is not None and tokens_per_s is not None else None)
        mfu = tflops / peak_tflops if tflops is not None and peak_tflops else None
        values = {
            "step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
            "step_time_s": self.step_time_s, "data_time_s": self.data_time_s, "tokens": self.tokens,
            "tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": mfu,
            "mem_peak_bytes": self.mem_peak_bytes, "compile": self.compile,
        }
        return {k: values[k] for k in STEP_FIELDS}


class MetricsWriter:
    """Appends one JSON object per line to ``path`` and flushes after each line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close() / __exit__

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Every complete line of a ``metrics.jsonl``; a torn last line (a killed run) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # the last line, not newline-terminated: cut off mid-write
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
    return records


def forget_steps_after(path: str | Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (a run that continues from a checkpoint at ``step``
    redoes them), atomically."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
