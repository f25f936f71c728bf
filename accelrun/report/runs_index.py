"""Past runs at a glance (``accelrun runs list``): one row of key figures per run directory, newest first.

Example::

    for row in list_run_rows("runs", limit=10):
        print(row.run, row.status, row.step_time_s, row.tokens_per_s)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from accelrun.config.resolve import values_hash
from accelrun.report.peak import is_upper_bound
from accelrun.report.rundata import RunNotFound, load_run
from accelrun.report.rundir import STAMP_FORMAT, is_running, list_runs, started_stamp
from accelrun.report.stats import median as steady_median


@dataclass
class RunRow:
    run: str  # name/id
    path: str
    started: str  # UTC: from the directory name, or a job folder's start file (rundir.started_stamp)
    status: str
    steps: int  # the last step it recorded
    final_loss: float | None
    step_time_s: float | None  # steady median
    tokens_per_s: float | None  # the job's: all ranks together
    mfu: float | None
    mem_peak_bytes: int | None
    compile: str
    precision: str
    config_hash: str | None
    segment: int = 1  # this run folder's place in its history (1: it continues no other run)
    kind: str = "train"  # train | explain (`compile explain`) | ab (`accelrun ab`: its variants' runs inside)
    processes: int | None = None  # the job's: ranks on every node together
    # Its MFU is against a CPU peak probed while other processes used the CPU (report/peak.py: BUSY_PEAK),
    # which understates the machine: the figure is an upper bound.
    mfu_upper_bound: bool = False
    # A continued folder's own end (crashed | interrupted): a later run took over its checkpoint after it.
    continued_after: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _started(run_dir: Path) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.strptime(started_stamp(run_dir), STAMP_FORMAT))
    except (OSError, ValueError):
        return "?"


# What `compile explain` leaves in its run folder when it is done (it trains no run: one compiled step).
EXPLAIN_RECORD = Path("compile") / "record.json"
# Where `accelrun ab` puts its comparisons under a runs folder (ab/<name>/<id>/), and the file that marks
# one as finished (accelrun.report.ab.write_ab_reports).
AB_FOLDER, AB_RESULT = "ab", "ab.json"


def list_run_rows(runs_dir: str | Path, name: str | None = None, limit: int | None = None,
                  comparisons: bool = True) -> list[RunRow]:
    """Rows for the runs under ``runs_dir`` (of run ``name``), newest first, at most ``limit``: training
    runs, `compile explain` runs and (``comparisons``) the `accelrun ab` comparisons under its ab/."""
    rows = [row for path in list_runs(runs_dir, name)  # (runs_dir may be an ab folder of one name: runs/ab/<name>)
            if (row := _ab_row(path) if is_ab_folder(path) else _run_row(path)) is not None]
    if comparisons:
        rows += [row for path in list_runs(Path(runs_dir) / AB_FOLDER, name) if (row := _ab_row(path)) is not None]
    rows.sort(key=lambda r: started_stamp(Path(r.path)), reverse=True)
    return rows[:limit]


def is_ab_folder(path: Path) -> bool:
    """An `accelrun ab` comparison's folder (its result, or its variants' runs, and no recipe of its own),
    whatever the folders above it are named."""
    return not (path / "config.yaml").exists() and ((path / AB_RESULT).exists() or (path / "runs").is_dir())


def _processes(config_flat: dict, report: dict) -> int | None:
    world = report.get("world_size")
    if world is None:
        nodes, per_node = config_flat.get("parallel.nnodes", 1), config_flat.get("parallel.nproc_per_node")
        world = nodes * per_node if isinstance(nodes, int) and isinstance(per_node, int) else None
    return int(world) if world is not None else None


def _ab_row(path: Path) -> RunRow | None:
    """One row per comparison: its verdict lives in ab.md; its variants' runs are listed with
    `accelrun runs list <ab folder>/runs`."""
    try:
        result = json.loads((path / AB_RESULT).read_text())
    except FileNotFoundError:
        result = None  # running, or stopped before its reports
    except ValueError:
        return None
    from accelrun.report.ab import EXIT_INTERRUPTED, EXIT_LOSSES_DISAGREE

    # A comparison that ran whole but found the variants' losses apart is not a failed one (a trial's,
    # where ab itself said why: B drew its dropout masks in accelrun's kernels).
    said = {0: "finished", EXIT_LOSSES_DISAGREE: "losses differ",
            EXIT_INTERRUPTED: "interrupted"}  # (Ctrl-C: it compared the rounds it finished)
    code = (result or {}).get("exit_code")
    status = "running" if result is None and is_running(path) else \
        "interrupted" if result is None else said.get(code, "failed")
    # (the label under the runs folder, as a training run's: compare was given "llama-debug/<id>" for
    # runs/ab/llama-debug/<id>, a trial's)
    return RunRow(run=f"{AB_FOLDER}/{path.parent.name}/{path.name}", path=str(path), started=_started(path), status=status,
                  steps=int((result or {}).get("steps") or 0), final_loss=None, step_time_s=None, tokens_per_s=None,
                  mfu=None, mem_peak_bytes=None, compile="-", precision="-", config_hash=None, kind="ab")


def _run_row(path: Path) -> RunRow | None:
    try:
        r = load_run(path)
    except RunNotFound:  # a directory being created, or not one of ours: skip it
        return None
    if not r.metrics and r.report is None and (path / EXPLAIN_RECORD).is_file():
        return RunRow(run=r.label, path=str(path), started=_started(path), status="finished",
                      steps=0, final_loss=None, step_time_s=None, tokens_per_s=None, mfu=None, mem_peak_bytes=None,
                      compile=str(r.config_flat.get("compile.backend", "?")),
                      precision=str(r.config_flat.get("train.precision", "?")), config_hash=None, kind="explain",
                      processes=1)  # explain compiles one process's step whatever the layout
    rep = r.report or {}
    losses = r.losses()
    # A run that ran whole in this folder: its report's figures. A resumed one (or one without a report):
    # the run's, over every folder it continues, as compare gives them (a resumed report covers its own).
    whole = bool(rep) and len(r.segments) < 2
    steps = rep.get("steps") if whole else max((int(m["step"]) for m in r.metrics), default=0)
    times = r.steady_step_times()
    median = (rep.get("step_time_s") or {}).get("median") if whole else (steady_median(times) if times else None)
    tokens = r.job_tokens_per_step
    return RunRow(
        run=r.label, path=str(path), started=_started(path), status=r.status,
        steps=int(steps or 0), final_loss=losses[max(losses)] if losses else None, step_time_s=median,
        tokens_per_s=(rep.get("tokens_per_s_job") if whole else None) or (tokens / median if tokens and median else None),
        mfu=rep.get("mfu") if whole else r.mfu, mem_peak_bytes=rep.get("mem_peak_bytes") if whole else r.mem_peak_bytes,
        compile=str(r.config_flat.get("compile.backend", "?")), precision=str(r.config_flat.get("train.precision", "?")),
        config_hash=rep.get("config_hash") or (values_hash(r.config) if r.config else None),
        segment=len(r.segments), processes=_processes(r.config_flat, rep),
        mfu_upper_bound=is_upper_bound(rep if rep else r.env),  # no report: the peak env.json recorded
        continued_after=r.stopped_by if r.status == "continued" else None,
    )
