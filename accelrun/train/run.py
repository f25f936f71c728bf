"""One process's part of a training run in its run directory: setup, loop, report (``run_in_dir``).

``metrics.jsonl`` is written line by line, ``report.json`` and ``report.md`` at the end (also when the
loss diverges, so a stopped run still says what happened). ``train.entry.train`` makes the directory and
calls ``run_in_dir`` in this process, or launches ranks that each call it (``train.rank``); rank 0 alone
writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from accelrun.config import ResolvedConfig
from accelrun.config.data_checks import data_description
from accelrun.config.hf_model import RUN_EXPORT_FOLDER
from accelrun.config.preflight import capped_texts
from accelrun.data.summary import describe_batches
from accelrun.dist.collective import set_group_timeouts
from accelrun.dist.context import ParallelContext
from accelrun.dist.stop import Stopped
from accelrun.dist.worker import rank_uses_cuda
from accelrun.errors import TrainingDiverged, UserError
from accelrun.models.build import loss_source
from accelrun.models.flop_count import COUNTED
from accelrun.report.compile_time import compile_time, record_seconds
from accelrun.report.files import write_json
from accelrun.report.html import write_report_html
from accelrun.report.lineage import history
from accelrun.report.machine_load import CpuWindow, busy_note, others_share
from accelrun.report.markdown import write_report_md
from accelrun.report.memory import peak_memory_bytes
from accelrun.report.metrics import MetricsWriter, forget_steps_after, read_metrics
from accelrun.report.peak import BUSY_PEAK, is_upper_bound
from accelrun.report.rundata import RunNotFound, history_metrics
from accelrun.report.summary import (
    is_steady,
    learning_rate_said,
    step_breakdown,
    summarize,
    whole_run_summary,
)
from accelrun.report.trackers import open_trackers
from accelrun.train import host_blocks
from accelrun.train.compile_ticker import CompileTicker
from accelrun.train.host_malloc import end_of_run, malloc_record, tune_malloc
from accelrun.train.loop import LoopOutcome, run_loop
from accelrun.train.progress import TrainProgress
from accelrun.train.setup import TrainSetup, build_setup


@dataclass
class TrainResult:
    run_dir: Path
    status: str  # finished | preempted | interrupted | stopped | diverged | nothing-to-do | failed
    report: dict | None
    stopped: Stopped | None = None  # where a signal stopped it (preempted, interrupted)


def _steps_recorded(run_dir: Path) -> bool:
    """Whether a step of this folder finished (a metrics row) or a checkpoint was begun."""
    metrics = run_dir / "metrics.jsonl"
    return (metrics.exists() and metrics.stat().st_size > 0) or any((run_dir / "checkpoints").glob("*"))


def _continues_itself(resumed_from: Path | None, run_dir: Path) -> bool:
    """Whether the checkpoint resumed from is this folder's own (a requeued multi-node job's), however
    either path was written (relative, absolute, through a link)."""
    return resumed_from is not None and resumed_from.resolve().parent.parent == run_dir.resolve()


def _remove_unused(run_dir: Path, console: Console | None) -> None:
    """A folder in which nothing ran (a recipe or model error before any step finished) is removed, so
    that no folder looks like an interrupted run to ``runs list`` and resume."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if console is not None and not run_dir.exists():  # it was announced: say where it went
        console.print(f"nothing ran: {run_dir} removed", markup=False, highlight=False)


def run_in_dir(
    resolved: ResolvedConfig,
    run_dir: Path,
    ctx: ParallelContext | None,
    console: Console | None,
    *,
    stop_after_step: int | None = None,
) -> TrainResult:
    """Set up, train and report in ``run_dir``. In a job every rank calls this; only rank 0 writes
    (``console`` is None on the others)."""
    cfg = resolved.config
    on_cpu = not rank_uses_cuda(cfg)
    if on_cpu:
        tune_malloc(cfg.train.cpu_malloc)  # before setup allocates anything big
        if ctx is None or ctx.is_main:
            _record_malloc(run_dir, cfg.train.cpu_malloc)
    try:
        return _train_in_dir(resolved, run_dir, ctx, console, stop_after_step)
    finally:
        if on_cpu:
            end_of_run(cfg.train.cpu_malloc)


def _record_malloc(run_dir: Path, mode: str) -> None:
    """env.json's malloc record as this process has it: the launcher wrote what a rank would get
    before any rank set it (the block cache may still have been refused)."""
    path = run_dir / "env.json"
    if path.is_file():
        env = json.loads(path.read_text())
        env.setdefault("cpu", {})["malloc"] = malloc_record(mode)
        write_json(env, path)


def _record_peak(run_dir: Path, s: TrainSetup) -> None:
    """env.json's record of the peak MFU divides by: a run that ends without a report (a killed
    multi-rank job) still says, in ``runs list``, that a peak probed on a busy machine bounds its MFU."""
    path = run_dir / "env.json"
    if path.is_file():
        env = json.loads(path.read_text())
        env["peak"] = s.peak.to_dict()
        write_json(env, path)


def _train_in_dir(resolved: ResolvedConfig, run_dir: Path, ctx: ParallelContext | None, console: Console | None,
                  stop_after_step: int | None) -> TrainResult:
    cfg = resolved.config
    main = ctx is None or ctx.is_main
    t_setup = time.perf_counter()
    try:
        s = build_setup(resolved, run_dir, ctx)
    except UserError:
        if main and not (run_dir / "metrics.jsonl").exists():
            _remove_unused(run_dir, console)
        raise
    setup_s = time.perf_counter() - t_setup
    if ctx is not None and ctx.distributed:  # setup ran under parallel.init_timeout_s; the steps get theirs
        set_group_timeouts(timedelta(seconds=cfg.parallel.timeout_s))
    if console is not None:
        _announce(console, s, setup_s)
    if s.start_step >= cfg.train.steps:
        if console is not None:
            # a raised train.steps is another training (its schedule changes): named explicitly, it goes on
            how = f"raise train.steps with checkpoint.resume={s.resumed_from} to go on" + (
                " (and a new --rdzv-id)" if _continues_itself(s.resumed_from, run_dir) else "")
            console.print(f"nothing to train: {s.resumed_from} is at step {s.start_step} and train.steps = "
                          f"{cfg.train.steps}; {how}", markup=False)
        # The new folder goes; a multi-node job's own folder, entered again, is the finished run itself
        # (a new user's rerun of a finished job deleted its report, metrics and checkpoints).
        if main and not _continues_itself(s.resumed_from, run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        return TrainResult(run_dir, "nothing-to-do", None)

    if main:
        _record_peak(run_dir, s)
    if main and _continues_itself(s.resumed_from, run_dir):
        forget_steps_after(run_dir / "metrics.jsonl", s.start_step)  # they are about to be redone
    progress = (TrainProgress(cfg.train.steps, s.start_step, cfg.report.progress, cfg.report.log_every, console,
                              ranks=s.ctx.world_size)
                if console is not None else None)
    error: TrainingDiverged | None = None
    trackers = (open_trackers(cfg.report.trackers, run_dir, cfg.model_dump(mode="json"), name=run_dir.name,
                              mlflow_uri=cfg.report.mlflow_uri) if main and cfg.report.trackers else None)
    if console is not None and s.compiles and main:
        # Inductor's first step took 13 s on this CPU with nothing on the screen but "step 0/8"
        console.print(f"the first step compiles ({cfg.compile.backend}"
                      + (", or loads its graphs from the graph cache" if cfg.compile.backend == "accelrun" else "")
                      + "): its time is left out of the step figures", markup=False, highlight=False)
    cpu = CpuWindow()  # what the node's other processes took while this loop ran (report's "machine load")
    try:
        # A compile that runs long (the first step's, a recompile's) says now and then what it is doing.
        ticker = (CompileTicker(lambda line: console.print(line, markup=False, highlight=False),
                                unstaged=None if cfg.compile.backend == "accelrun"  # it says its stages
                                else f"Dynamo and {cfg.compile.backend} compile")
                  if console is not None and s.compiles and main and cfg.report.progress != "none"
                  else contextlib.nullcontext())
        if progress is not None and isinstance(ticker, CompileTicker):
            progress.before_line = ticker.settle  # "compile done" before the step's line, not after it
        with (MetricsWriter(run_dir / "metrics.jsonl") if main else contextlib.nullcontext() as metrics, ticker):
            outcome: LoopOutcome = run_loop(s, metrics, progress, stop_after_step=stop_after_step,
                                            trackers=trackers)
        status = outcome.status
    except TrainingDiverged as e:
        status, error = "diverged", e
    except BaseException as e:
        if trackers is not None:
            trackers.close()
        if main:  # what compiled before the failure, beside its dumps: what a user debugging it reads first
            with contextlib.suppress(Exception):  # (never in place of the failure itself)
                _write_compile_record(cfg, s, run_dir)
        if (isinstance(e, UserError) and ctx is None and s.resumed_from is None and not _steps_recorded(run_dir)
                and not cfg.compile.dump and not cfg.report.trackers):
            # The model's output refused at its first step: nothing ran. One process only (a job's other
            # ranks and its agent may still write there), and not when the folder holds the step's
            # compile dumps or trackers' files, which are worth reading.
            _remove_unused(run_dir, console)
        raise
    finally:
        if progress is not None:
            progress.close()
    if trackers is not None and status in ("preempted", "interrupted", "stopped"):
        trackers.close()

    if status in ("preempted", "interrupted", "stopped"):
        # No report.json: `checkpoint.resume: auto` treats this run as one to continue.
        saved = outcome.checkpoints[-1] if outcome.checkpoints else None
        stopped = (Stopped(s.ctx.rank, int(outcome.signum), outcome.last_step, str(saved) if saved else None)
                   if outcome.signum else None)
        if console is not None and stopped is not None and ctx is None:
            console.print(stopped.line(), markup=False, highlight=False)
        elif console is not None and stopped is None:
            console.print(f"{status} after step {outcome.last_step}; last checkpoint: {saved or 'none'}",
                          markup=False)
        if ctx is None and _steps_recorded(run_dir):
            _report_the_steps_run(resolved, s, run_dir, status, setup_s, outcome, saved, cpu, console)
        return TrainResult(run_dir, status, None, stopped)

    per_rank = _gather_per_rank(s, outcome.step_times if error is None else [], cfg.report.warmup_steps, cpu)
    report = None
    if main:
        env = json.loads((run_dir / "env.json").read_text())
        report = _write_report(resolved, s, run_dir, env, status, setup_s, error, per_rank, cpu)
        if trackers is not None:
            trackers.log_summary(report)
            trackers.close()
    if error is not None:
        raise error
    if main and cfg.checkpoint.hf_on_finish and outcome.checkpoints:
        # From the final checkpoint (DCP reshards whatever the layout was): one process writes.
        from accelrun.train.export import export_checkpoint

        notes: list[str] = []
        export_checkpoint(outcome.checkpoints[-1], run_dir / RUN_EXPORT_FOLDER, notes=notes)
        if console is not None:
            console.print(f"exported {outcome.checkpoints[-1].name} to {run_dir / RUN_EXPORT_FOLDER} (Hugging Face format)",
                          markup=False, highlight=False)
            for note in notes:
                console.print(f"note: {note}", markup=False, highlight=False)
    if console is not None and ctx is None:
        _print_summary(console, report, run_dir)
    return TrainResult(run_dir, status, report)


def _report_the_steps_run(resolved, s: TrainSetup, run_dir: Path, status: str, setup_s: float,
                          outcome: LoopOutcome, saved: Path | None, cpu: CpuWindow, console) -> None:
    """report.md (and report.html, unless a signal stopped it) of an interrupted process's steps (an
    interrupted run's folder had none: its steps were only in metrics.jsonl). No report.json, which marks
    a run as ended: resume still continues it. One process only: a stopped job's ranks need not all reach
    a gather. Best effort: a report that cannot be written must not hold up a stop (a preemption's grace
    period is short)."""
    try:
        env = json.loads((run_dir / "env.json").read_text())
        per_rank = _gather_per_rank(s, outcome.step_times, resolved.config.report.warmup_steps, cpu)
        resume = (f"checkpoint.resume: auto continues it from {saved}" if saved is not None else
                  "it saved no checkpoint, so it cannot be continued")
        _write_report(resolved, s, run_dir, env, status, setup_s, None, per_rank, cpu, ended=False,
                      note=f"{status} after step {outcome.last_step}: this report covers the steps run; {resume}",
                      html=not outcome.signum)  # a preemption's grace period: not the plots
    except Exception as e:  # noqa: BLE001 (a full disk, a plot that fails, ...): the stop goes on
        if console is not None:
            console.print(f"warning: report.md of the steps run not written: {e}", markup=False, highlight=False)


def _whole_run(segments: list[Path], warmup_steps: int, job_tokens_per_step: int) -> dict | None:
    """A resumed run's figures over all its folders, or None (one folder; an earlier folder's
    metrics.jsonl unreadable: this folder's report is still written)."""
    if len(segments) < 2:
        return None
    try:
        metrics, starts = history_metrics(segments)
    except RunNotFound:
        return None
    return whole_run_summary(metrics, starts, warmup_steps, job_tokens_per_step)


def _gather_per_rank(s: TrainSetup, step_times: list[dict], warmup_steps: int, cpu: CpuWindow) -> list[dict]:
    """Every rank's peak memory and median steady step time (the report's own definition of steady):
    a slow or memory-heavy rank is what a job-wide figure hides. And its CPU time and node, so that
    rank 0 can tell the job's CPU from its neighbours'."""
    steady = [m["step_time_s"] for m in step_times[warmup_steps:] if is_steady(m)]
    mine = {"mem_peak_bytes": peak_memory_bytes(s.device),
            "step_time_s": statistics.median(steady) if steady else None,
            "cpu_s": cpu.own_s(), "host": socket.gethostname(), "threads": torch.get_num_threads()}
    if s.pipeline is not None:  # its stages and their layers, what they sent on, how the loss saw the logits
        mine["pipeline"] = s.pipeline.trace_dict()
    if not s.ctx.distributed:
        return [mine]
    everyone: list = [None] * s.ctx.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def parallel_said(par) -> str:
    """``pp 1 × ... × tp 2; sequence parallel, loss parallel``: the degrees and the switches on (report.md
    named degrees alone: a trial's TP run with both switches read as plain TP)."""
    deg = par.degrees()  # (pp may be -1, inferred: a review's)
    degrees = " × ".join(f"{k} {v}" for k, v in deg.items())
    on = [what for what, is_on in (("sequence parallel", par.sequence_parallel), ("loss parallel", par.loss_parallel),
                                   ("async TP", par.async_tp), (f"{par.pp_schedule} schedule", deg["pp"] > 1)) if is_on]
    return degrees + (f"; {', '.join(on)}" if on else "")


def _compiler_summary(s: TrainSetup) -> dict | None:
    """accelrun's compile section (stages, cache, passes, regions), or graph breaks for Inductor."""
    if s.compile_record is not None:
        return s.compile_record.summary()
    if not s.compiles:
        return None
    from accelrun.compile.coverage import graph_breaks_since

    breaks = graph_breaks_since({})  # this process's (Inductor's compiles: the run's only ones)
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks}


def _machine_load(per_rank: list[dict], cpu: CpuWindow) -> dict:
    """The share of rank 0's node that processes outside the job used while the loop ran."""
    host = per_rank[0]["host"]
    job_cpu = sum(r["cpu_s"] for r in per_rank if r["host"] == host)
    wall = cpu.wall_s()
    share = others_share(cpu.busy_s(), job_cpu, wall, os.cpu_count() or 1)
    return {"others_cpu_share": share, "seconds": round(wall, 2), "cores": os.cpu_count(),
            "job_processes_on_node": sum(1 for r in per_rank if r["host"] == host)}


def _host_blocks(s: TrainSetup) -> dict | None:
    """This process's block cache counters (train.cpu_malloc = blocks on a CPU), or None."""
    return dataclasses.asdict(host_blocks.counters()) if host_blocks.installed() else None


def _write_compile_record(cfg, s: TrainSetup, run_dir: Path) -> None:
    """compile/record.json beside the dumps (``compile.dump``), as ``compile explain`` writes it."""
    if cfg.compile.dump and s.compile_record is not None:
        with contextlib.suppress(OSError):
            write_json(s.compile_record.to_json(), run_dir / "compile" / "record.json")


def _write_report(resolved, s: TrainSetup, run_dir: Path, env: dict, status: str, setup_s: float, error,
                  per_rank: list[dict], cpu: CpuWindow, ended: bool = True, note: str | None = None,
                  html: bool = True) -> dict:
    cfg = resolved.config
    metrics = read_metrics(run_dir / "metrics.jsonl")
    compiler = _compiler_summary(s)
    if s.ctx.is_main:
        _write_compile_record(cfg, s, run_dir)
    # What the compiler timed, where it did: a difference of steps on a busy machine said 0.0 s.
    took = compile_time(metrics, record_seconds(compiler)) if s.compiles else None
    report = summarize(
        metrics, warmup_steps=cfg.report.warmup_steps, peak=s.peak, flops_per_token=s.flops.value,
        compile_time_s=took.seconds if took else None, tokens_per_step=s.tokens_per_step, flops_source=s.flops.source,
    )
    if note is not None:
        report["notes"].insert(0, note)
    report["notes"] += s.model_notes
    if restarts := s.ctx.restart_count:  # (a trial's job recovered from a killed rank; its report said "finished")
        start = (f"from {s.resumed_from} at step {s.start_step}, so the steps after it ran again" if s.resumed_from
                 else "from its start")
        report["notes"].append(f"the job's ranks were restarted {restarts} time{'s' if restarts > 1 else ''} after a "
                               f"rank failed (torchrun's --max-restarts); the last restart went on {start}; the "
                               "launcher's console and logs/ say which rank failed and how")
    # The highest rank's peak, as its rank row reads it, taken after the last step's row (the final
    # checkpoint's save included), so the run's figure never reads below a rank's (a trial's report said
    # rank 0's 478.6 MiB where rank 2's row read 518.4: a pipeline's last stage is the one that runs out).
    ranks_peaks = [r["mem_peak_bytes"] for r in per_rank if r.get("mem_peak_bytes") is not None]
    if report.get("mem_peak_bytes") is not None and ranks_peaks:
        report["mem_peak_bytes"] = max(report["mem_peak_bytes"], *ranks_peaks)
        if len(per_rank) > 1:
            report["mem_peak_rank"] = max(range(len(per_rank)), key=lambda i: per_rank[i].get("mem_peak_bytes") or 0)
    if took is not None:
        report["notes"].append(took.how)
    _distrust_low_probe(report, s)
    segments = history(run_dir)
    load = {**_machine_load(per_rank, cpu), "threads": torch.get_num_threads()}  # a rank's (CPU) threads
    if (busy := busy_note(load["others_cpu_share"], "the training loop", load["threads"])) is not None:
        report["notes"].append(busy)
    report.update(
        machine_load=load,
        status=status,
        error=str(error) if error else None,
        name=cfg.name,
        config_hash=resolved.hash,
        training_hash=resolved.training_hash,
        resumed_from=str(s.resumed_from) if s.resumed_from else None,
        restarts=s.ctx.restart_count,
        setup_time_s=setup_s,
        model=s.model_info,
        device=str(s.device),
        compiled=s.compiled,
        data=getattr(s.data, "fingerprint", None),
        step_breakdown_s=step_breakdown(metrics, cfg.report.warmup_steps, pipelined=cfg.parallel.pp > 1),
        world_size=s.ctx.world_size,
        parallel=cfg.parallel.degrees(),
        tokens_per_s_job=report["tokens_per_s"] * s.ctx.world_size if report.get("tokens_per_s") else None,
        mem_peak_bytes_per_rank=[r["mem_peak_bytes"] for r in per_rank],
        step_time_s_per_rank=[r["step_time_s"] for r in per_rank],
        threads_per_rank=[r["threads"] for r in per_rank],  # each rank's own (env.json has the launcher's)
        pipeline_per_rank=[r["pipeline"] for r in per_rank] if s.pipeline is not None else None,
        compiler=compiler,
        host_blocks=_host_blocks(s),
        history=[str(p) for p in segments],  # the run folders of this run, restarts included
        whole_run=_whole_run(segments, cfg.report.warmup_steps, cfg.train.global_batch * cfg.train.seq_len),
        final_val_loss=next((m["val_loss"] for m in reversed(metrics) if m.get("val_loss") is not None), None),
    )
    summary = {
        "name": cfg.name,
        "config_hash": resolved.hash,
        "status": status,
        "model params": s.model_info["params_total"],
        "precision": cfg.train.precision,
        "compile": s.compiled,
        # which one the forward's output made it, where the run found out (a forward given targets)
        "loss": (getattr(s.loss_fn, "trained", None) or s.loss_source or loss_source(s.model)).value,
        "device": str(s.device),
        "processes": s.ctx.world_size,
        "parallel degrees": parallel_said(cfg.parallel),
        "global batch × seq_len": f"{cfg.train.global_batch} × {cfg.train.seq_len}",
        "learning rate": learning_rate_said(metrics, cfg.train.optimizer.lr, cfg.train.lr_schedule.name,
                                            cfg.train.lr_schedule.warmup_steps, cfg.train.steps),
        "data": data_description(cfg.data) + "".join(
            f"; {cut.cap:,} of the {cut.total:,} bytes of {cut.paths_key} read (data.max_bytes)" for cut in capped_texts(cfg)),
        "resumed from": report["resumed_from"],
        "history": (" → ".join(Path(p).name for p in report["history"]) if len(report["history"]) > 1
                    else f"{run_dir.name} alone" + ("" if report["resumed_from"] else " (no restarts)")),
    }
    write_report_md(report, summary, run_dir / "report.md", env=env)
    if html:
        write_report_html(report, summary, run_dir, env=env)
    if ended:
        write_json(report, run_dir / "report.json")  # last: its presence marks the run as ended
    return report


def _distrust_low_probe(report: dict, s: TrainSetup) -> None:
    """A measured CPU peak below what training achieved was taken while the CPU ran slower than during
    training (busy elsewhere, or a virtual machine's pace, which can drift by a fifth between minutes):
    say so, without guessing which, and drop the cached figure so the next run measures again."""
    if report.get("mfu") is None or report["mfu"] <= 1.0 or not s.peak.cache_file:
        return
    Path(s.peak.cache_file).unlink(missing_ok=True)
    report["notes"].append(
        f"MFU above 100%: the cached CPU peak ({s.peak.tflops:.4g} TFLOP/s) is less than training achieved: "
        "the CPU ran slower while the probe measured it (busy elsewhere, or a virtual machine's pace drifting); "
        "it has been deleted and the next run measures it again"
    )


def _share(degrees: dict) -> str:
    """How a rank's token figure relates to its work: its share of the job's tokens, which under tensor or
    pipeline parallelism is not what it computes (each of a group's ranks works on all the group's tokens:
    a trial read "2,048 per rank" where each of 2 TP ranks ran all 4,096)."""
    return "a share of" if degrees.get("tp", 1) * degrees.get("pp", 1) == 1 else \
        "the job's tokens split evenly, not what each computes:"


def _announce(console: Console, s: TrainSetup, setup_s: float) -> None:
    params = s.model_info["params_total"]
    world = s.ctx.world_size
    # The job's tokens lead (what the report and `runs list` show); a rank's share only beside them.
    tokens = f"{s.tokens_per_step * world:,} tokens/step" + (f" (job; {_share(s.config.parallel.degrees())} "
                                                            f"{s.tokens_per_step:,} a rank × {world} ranks)" if world > 1 else "")
    lines = [
        f"model {params / 1e6:.2f} M params on {s.device}; compile: {s.compiled}; {tokens}; setup {setup_s:.1f}s",
        "MFU peak: " + (f"{s.peak.tflops:.3f} TFLOP/s ({s.peak.source})" if s.peak.tflops
                        else f"unknown ({s.peak.detail})"),
    ]
    # (a step draws grad_accum micro-batches: a pass is counted in those)
    if (counted := describe_batches(s.data, s.config.train.steps, s.grad_accum)) is not None:
        lines.append(f"data: {data_description(s.config.data)}; {counted}")
    if s.eval_data is not None and (held := len(s.eval_data.batches)) < s.config.eval.steps:
        # (a trial's eval.steps=10 ran 1 batch without a word: the held-out tail had 4 windows)
        own = bool(s.config.eval.paths)  # its own files, or a tail of the training data's
        lines.append(f"eval: the {'eval.paths' if own else 'held-out'} {s.eval_data.n_heldout:,} windows make {held} "
                     f"batch(es) of train.micro_batch per rank, fewer than eval.steps = {s.config.eval.steps}: each "
                     "evaluation runs those (" + ("more evaluation data adds some" if own else
                                                  "eval.split raises the share held out") + ")")
    lines += [f"note: {n}" for n in s.model_notes]
    if s.resumed_from:
        lines.append(f"resuming from {s.resumed_from} at step {s.start_step} ({s.resume_reason})")
    elif s.config.checkpoint.resume != "none":
        lines.append(f"starting fresh: {s.resume_reason}")
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _print_summary(console: Console, r: dict, run_dir: Path) -> None:
    st = r["step_time_s"]["median"]
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a"
    if r.get("flops_per_token") is None and st:  # a model of the user's whose FLOPs could not be counted
        mfu += f" (no FLOP count per token for this model: {(r.get('model') or {}).get('flops_source', 'unknown')})"
    elif r.get("mfu") is not None and (r.get("model") or {}).get("flops_source") == COUNTED:
        mfu += " (its FLOPs counted on one sequence)"
    # Above 100% first: "121% (an upper bound)" read as a contradiction (a trial), though it was one.
    if r.get("mfu") is not None and r["mfu"] > 1:
        why = f"the peak, {BUSY_PEAK}," if is_upper_bound(r) else "the peak"
        mfu += f" (above 100%: {why} is too low; the report's notes say why)"
    elif r.get("mfu") is not None and is_upper_bound(r):
        mfu += f" (an upper bound: the peak was {BUSY_PEAK})"
    # The job's throughput, as report.md and `runs list` show it: a rank's alone made a 2-rank FSDP
    # run look slower than one process when it was faster.
    tps = f"{r['tokens_per_s_job']:,.0f} tok/s" if r.get("tokens_per_s_job") else "n/a tok/s"
    ranks = r.get("world_size") or 1
    if ranks > 1 and r.get("tokens_per_s"):
        tps += f" (job; {_share(r.get('parallel') or {})} {r['tokens_per_s']:,.0f} a rank × {ranks})"
    step = f"{st * 1e3:.0f} ms" if st else "n/a"
    held_out = f"; eval loss {r['final_val_loss']:.3f} (held out)" if r.get("final_val_loss") is not None else ""
    console.print(
        f"[bold green]done[/]: loss {r['first_loss']:.3f} → {r['final_loss']:.3f}{held_out}; {tps}; "
        f"step {step} (median); MFU {mfu}; report {escape(str(run_dir / 'report.md'))}",
        highlight=False,
    )
    if r.get("no_steady_reason"):  # a short run: say why the figures are n/a, as report.md does
        console.print(f"  n/a: {r['no_steady_reason']}", markup=False, highlight=False)
    load = r.get("machine_load") or {}
    if (busy := busy_note(load.get("others_cpu_share"), "the training loop", load.get("threads"))) is not None:
        console.print(f"[bold yellow]warning:[/] {escape(busy)}", highlight=False)
    compiler = r.get("compiler") or {}
    took = f"; compile {r['compile_time_s']:.1f} s" if r.get("compile_time_s") else ""
    if compiler.get("compiled"):  # accelrun's backend: what ran compiled, in one line
        console.print(f"  compiled: {compiler['compiled']}{took}", markup=False, highlight=False)
    elif compiler and r.get("compiled"):  # another backend (Inductor): what was handed to it
        breaks = f", {compiler['graph_breaks']} graph break(s)" if compiler.get("graph_breaks") else ""
        console.print(f"  compiled: {r['compiled']}{breaks}{took}", markup=False, highlight=False)
    errors = (compiler.get("graph_cache") or {}).get("errors") or []  # was only in report.json
    if compiler.get("graph_breaks") or not compiler.get("graphs_in_use"):
        # A graph break (or nothing traced) is why precompiling failed: the warnings below say where.
        from accelrun.compile.graph_cache import PRECOMPILE_FAILED

        errors = [e for e in errors if not e.startswith(PRECOMPILE_FAILED)]
    if errors:
        more = f" (and {len(errors) - 1} more in report.md)" if len(errors) > 1 else ""
        console.print(f"[bold yellow]graph cache:[/] {escape(errors[0])}{more}", highlight=False)
    for warning in compiler.get("warnings") or []:  # never silent: nothing compiled, skipped frames
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
