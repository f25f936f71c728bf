"""Past runs at a glance (``accelrun runs list``): one row of key figures per run directory, newest first.

Example::

    for row in list_run_rows("runs", limit=10):
        print(row.run, row.status, row.step_time_s, row.tokens_per_s)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from accelrun.report.lineage import history
from accelrun.report.rundata import RunNotFound, load_run
from accelrun.report.rundir import list_runs
from accelrun.report.stats import median as steady_median


@dataclass
class RunRow:
    run: str  # name/id
    path: str
    started: str  # UTC, from the directory name
    status: str
    steps: int
    final_loss: float | None
    step_time_s: float | None  # steady median
    tokens_per_s: float | None  # the job's: all ranks together
    mfu: float | None
    mem_peak_bytes: int | None
    compile: str
    precision: str
    config_hash: str | None
    segment: int = 1  # this run folder's place in its history (1: it continues no other run)

    def to_dict(self) -> dict:
        return asdict(self)


def _started(run_id: str) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.strptime(run_id[:15], "%Y%m%d-%H%M%S"))
    except ValueError:
        return "?"


def list_run_rows(runs_dir: str | Path, name: str | None = None, limit: int | None = None) -> list[RunRow]:
    """Rows for the runs under ``runs_dir`` (of run ``name``), newest first, at most ``limit``."""
    rows = []
    for path in list_runs(runs_dir, name)[:limit]:
        try:
            r = load_run(path)
        except RunNotFound:  # a directory being created, or not one of ours: skip it
            continue
        rep = r.report or {}
        losses = r.losses()
        steps = rep.get("steps") if rep else len(r.metrics)
        times = r.steady_step_times()
        median = (rep.get("step_time_s") or {}).get("median") if rep else (steady_median(times) if times else None)
        tokens = r.job_tokens_per_step
        rows.append(RunRow(
            run=f"{r.name}/{path.name}", path=str(path), started=_started(path.name), status=r.status,
            steps=int(steps or 0), final_loss=losses[max(losses)] if losses else None, step_time_s=median,
            tokens_per_s=rep.get("tokens_per_s_job") or (tokens / median if tokens and median else None),
            mfu=rep.get("mfu"), mem_peak_bytes=rep.get("mem_peak_bytes"),
            compile=str(r.config_flat.get("compile.backend", "?")), precision=str(r.config_flat.get("train.precision", "?")),
            config_hash=rep.get("config_hash"), segment=len(history(path)),
        ))
    return rows
