"""One training run end to end: run directory, setup, loop, report.

The run directory is written as the run goes: ``config.yaml``, ``command.txt`` and ``env.json``
before the first step, ``metrics.jsonl`` line by line, ``report.json`` and ``report.md`` at the
end (also when the loss diverges, so a stopped run still says what happened). While the run is
alive its launcher holds the directory's lock, so ``checkpoint.resume: auto`` never takes over a
live run. A multi-process job starts its ranks through torchrun's elastic agent; every rank runs
``run_in_dir`` and rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
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

from accelrun.config import ConfigError, ResolvedConfig
from accelrun.config.hf_model import RUN_EXPORT_FOLDER
from accelrun.config.preflight import preflight
from accelrun.config.resolve import explain_text
from accelrun.dist import stop
from accelrun.dist.collective import set_group_timeouts
from accelrun.dist.context import ParallelContext
from accelrun.dist.launch import JobOutcome, LaunchOptions, launch_job
from accelrun.dist.stop import Stopped
from accelrun.dist.worker import cpu_rank_threads, machine_as_torch_sees_it, rank_uses_cuda
from accelrun.errors import TrainingDiverged, UserError
from accelrun.report.env import collect_env
from accelrun.report.files import write_json, write_text_atomic
from accelrun.report.html import write_report_html
from accelrun.report.lineage import history
from accelrun.report.machine_load import CpuWindow, busy_note, others_share
from accelrun.report.markdown import write_report_md
from accelrun.report.memory import peak_memory_bytes
from accelrun.report.metrics import MetricsWriter, forget_steps_after, read_metrics
from accelrun.report.rundir import create_run_dir, hold_run_lock, job_run_dir
from accelrun.report.summary import compile_time_s, is_steady, step_breakdown, summarize
from accelrun.report.trackers import check_trackers, open_trackers
from accelrun.train.host_malloc import malloc_record, tune_malloc
from accelrun.train.lineage import mark_crashed
from accelrun.train.loop import LoopOutcome, run_loop
from accelrun.train.progress import TrainProgress
from accelrun.train.setup import TrainSetup, build_setup
from accelrun.train.threads import choose_threads


@dataclass
class TrainResult:
    run_dir: Path
    status: str  # finished | preempted | interrupted | stopped | diverged | nothing-to-do | failed
    report: dict | None
    stopped: Stopped | None = None  # where a signal stopped it (preempted, interrupted)


class JobFailed(UserError):
    """The ranks stopped on a user error or a diverged loss; keep their exit code. Its messages are
    those no rank printed itself (rank 0 stopped by the agent before it could)."""

    def __init__(self, code: int, unprinted: list[str]):
        super().__init__(unprinted)  # only what no rank printed
        self.exit_code = code


def train(
    resolved: ResolvedConfig,
    *,
    command: str = "",
    console: Console | None = None,
    stop_after_step: int | None = None,
    launch: LaunchOptions | None = None,
) -> TrainResult:
    """Train ``resolved`` and write its run directory: in this process, or, when the recipe asks
    for several, through torchrun's elastic agent (one process per device; this one waits).

    >>> from accelrun.config import load_config               # doctest: +SKIP
    >>> train(load_config("configs/llama.yaml", ["train.steps=20"])).report["final_loss"]  # doctest: +SKIP
    """
    cfg = resolved.config
    console = console or Console(stderr=True)
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)  # before env.json records it and the peak probe runs
    elif _adapts_threads(cfg):
        choice = choose_threads()  # the cores nobody else is using now (train/threads.py says why)
        torch.set_num_threads(choice.threads)
        if choice.threads != choice.usable_cores:
            console.print(choice.describe(), markup=False, highlight=False)
    # Files the recipe names, one GPU per process, cores for the ranks: exit 2 (or warn) before a run
    # directory or a rank exists; `accelrun validate` runs the same checks.
    for warning in preflight(cfg, resolved.sources, machine_as_torch_sees_it()):
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    check_trackers(cfg.report.trackers)  # a missing tracker package: exit 2 before any work
    launch = launch or LaunchOptions()
    run_dir, node = _run_dir_for(cfg, launch)
    # Caught from here on: a signal during setup stops the run after its first step, with a checkpoint.
    with hold_run_lock(run_dir, node), stop.catch_signals():
        write_text_atomic(resolved.to_yaml(), run_dir / "config.yaml")
        write_text_atomic(explain_text(resolved), run_dir / "config.sources.txt")
        write_text_atomic((command or "(called from Python)") + "\n", run_dir / "command.txt")
        write_json(_env_of_ranks(cfg), run_dir / "env.json")
        console.print(f"[bold]accelrun[/] run [cyan]{escape(str(run_dir))}[/]  config {resolved.hash}")
        if cfg.parallel.world_size == 1:
            try:
                result = run_in_dir(resolved, run_dir, None, console, stop_after_step=stop_after_step)
            except Exception as e:  # a crash, told apart from a kill (no marker) in `runs list` and resume
                if run_dir.is_dir() and not (run_dir / "report.json").exists():
                    mark_crashed(run_dir, e)
                raise
            return _warn_if_late(result, console)
        console.print(f"launching {cfg.parallel.nproc_per_node} process(es) per node on {cfg.parallel.nnodes} "
                      "node(s) through torchrun's elastic agent", markup=False)
        outcome = launch_job(run_dir, cfg.parallel, launch)
    return _warn_if_late(_launched_result(run_dir, outcome, console), console)


def _warn_if_late(result: TrainResult, console: Console) -> TrainResult:
    if result.stopped is not None and (late := stop.late_warning()):
        console.print(late, markup=False, highlight=False)
    return result


def _run_dir_for(cfg, launch: LaunchOptions) -> tuple[Path, int]:
    """A new run directory; for a job on several nodes, the one directory all of them share."""
    if cfg.parallel.nnodes == 1:
        return create_run_dir(cfg.report.runs_dir, cfg.name), 0
    if not launch.rdzv_id or launch.node_rank is None or not launch.rdzv_endpoint:
        raise ConfigError(
            f"parallel.nnodes = {cfg.parallel.nnodes}: give every node the same --rdzv-id and "
            "--rdzv-endpoint HOST:PORT, and its own --node-rank"
        )
    try:
        return job_run_dir(cfg.report.runs_dir, cfg.name, launch.rdzv_id), launch.node_rank
    except ValueError as e:
        raise ConfigError(f"--rdzv-id: {e}") from None


def _launched_result(run_dir: Path, outcome: JobOutcome, console: Console) -> TrainResult:
    code = outcome.exit_code
    if outcome.stopped is not None:
        console.print(outcome.stopped.line(outcome.ranks), markup=False, highlight=False)
        return TrainResult(run_dir, outcome.stopped.status, None, outcome.stopped)
    report_path = run_dir / "report.json"
    if code == 0 and report_path.exists():
        report = json.loads(report_path.read_text())
        _print_summary(console, report, run_dir)
        return TrainResult(run_dir, report["status"], report)
    if code in (2, 3):  # the CLI prints what no rank printed and exits with the same code
        if (run_dir / "metrics.jsonl").exists() and not report_path.exists():
            mark_crashed(run_dir, "; ".join(outcome.unprinted) or f"a rank stopped on a user error (exit {code})")
        raise JobFailed(code, outcome.unprinted)
    if outcome.failure:
        console.print("[bold red]error:[/] " + escape(outcome.failure[0]), highlight=False)
        for line in outcome.failure[1:]:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if code != 0 and not report_path.exists():
        mark_crashed(run_dir, outcome.failure[0] if outcome.failure else f"the job exited with code {code}")
    return TrainResult(run_dir, "preempted" if code == 0 else "failed", None)


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
    main = ctx is None or ctx.is_main
    if not rank_uses_cuda(cfg):
        tune_malloc(cfg.train.cpu_malloc)  # before setup allocates anything big
    t_setup = time.perf_counter()
    try:
        s = build_setup(resolved, run_dir, ctx)
    except UserError:
        if main and not (run_dir / "metrics.jsonl").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: no directory that looks interrupted
        raise
    setup_s = time.perf_counter() - t_setup
    if ctx is not None and ctx.distributed:  # setup ran under parallel.init_timeout_s; the steps get theirs
        set_group_timeouts(timedelta(seconds=cfg.parallel.timeout_s))
    if console is not None:
        _announce(console, s, setup_s)
    if s.start_step >= cfg.train.steps:
        if console is not None:
            console.print(f"nothing to train: {s.resumed_from} is at step {s.start_step} and train.steps = "
                          f"{cfg.train.steps}; raise train.steps to go on", markup=False)
        if main:
            shutil.rmtree(run_dir, ignore_errors=True)
        return TrainResult(run_dir, "nothing-to-do", None)

    if main and s.resumed_from is not None and s.resumed_from.parent.parent == run_dir:
        forget_steps_after(run_dir / "metrics.jsonl", s.start_step)  # they are about to be redone
    progress = (TrainProgress(cfg.train.steps, s.start_step, cfg.report.progress, cfg.report.log_every, console,
                              ranks=s.ctx.world_size)
                if console is not None else None)
    error: TrainingDiverged | None = None
    trackers = (open_trackers(cfg.report.trackers, run_dir, cfg.model_dump(mode="json"), name=run_dir.name,
                              mlflow_uri=cfg.report.mlflow_uri) if main and cfg.report.trackers else None)
    cpu = CpuWindow()  # what the node's other processes took while this loop ran (report's "machine load")
    try:
        with MetricsWriter(run_dir / "metrics.jsonl") if main else contextlib.nullcontext() as metrics:
            outcome: LoopOutcome = run_loop(s, metrics, progress, stop_after_step=stop_after_step,
                                            trackers=trackers)
        status = outcome.status
    except TrainingDiverged as e:
        status, error = "diverged", e
    except BaseException:
        if trackers is not None:
            trackers.close()
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

        export_checkpoint(outcome.checkpoints[-1], run_dir / RUN_EXPORT_FOLDER)
        if console is not None:
            console.print(f"exported {outcome.checkpoints[-1].name} to {run_dir / RUN_EXPORT_FOLDER} (Hugging Face format)",
                          markup=False, highlight=False)
    if console is not None and ctx is None:
        _print_summary(console, report, run_dir)
    return TrainResult(run_dir, status, report)


def _gather_per_rank(s: TrainSetup, step_times: list[dict], warmup_steps: int, cpu: CpuWindow) -> list[dict]:
    """Every rank's peak memory and median steady step time (the report's own definition of steady):
    a slow or memory-heavy rank is what a job-wide figure hides. And its CPU time and node, so that
    rank 0 can tell the job's CPU from its neighbours'."""
    steady = [m["step_time_s"] for m in step_times[warmup_steps:] if is_steady(m)]
    mine = {"mem_peak_bytes": peak_memory_bytes(s.device),
            "step_time_s": statistics.median(steady) if steady else None,
            "cpu_s": cpu.own_s(), "host": socket.gethostname()}
    if s.pipeline is not None:  # its stages, what they sent on, how the loss saw the logits
        mine["pipeline"] = s.pipeline.trace.as_dict(s.pipeline.stage_ids)
    if not s.ctx.distributed:
        return [mine]
    everyone: list = [None] * s.ctx.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def _compiler_summary(s: TrainSetup) -> dict | None:
    """accelrun's compile section (stages, cache, passes, regions), or graph breaks for Inductor."""
    if s.compile_record is not None:
        return s.compile_record.summary()
    if not s.compiles:
        return None
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks}


def _machine_load(per_rank: list[dict], cpu: CpuWindow) -> dict:
    """The share of rank 0's node that processes outside the job used while the loop ran."""
    host = per_rank[0]["host"]
    job_cpu = sum(r["cpu_s"] for r in per_rank if r["host"] == host)
    wall = cpu.wall_s()
    share = others_share(cpu.busy_s(), job_cpu, wall, os.cpu_count() or 1)
    return {"others_cpu_share": share, "seconds": round(wall, 2), "cores": os.cpu_count(),
            "job_processes_on_node": sum(1 for r in per_rank if r["host"] == host)}


def _write_report(resolved, s: TrainSetup, run_dir: Path, env: dict, status: str, setup_s: float, error,
                  per_rank: list[dict], cpu: CpuWindow) -> dict:
    cfg = resolved.config
    metrics = read_metrics(run_dir / "metrics.jsonl")
    report = summarize(
        metrics, warmup_steps=cfg.report.warmup_steps, peak=s.peak, flops_per_token=s.flops_per_token,
        compile_time_s=compile_time_s(metrics) if s.compiles else None, tokens_per_step=s.tokens_per_step,
    )
    if s.compiles:
        report["notes"].append("compile time = the first step's time minus the median of the others "
                               "(Dynamo and its backend compile lazily inside the first step)")
    _distrust_low_probe(report, s)
    load = _machine_load(per_rank, cpu)
    if (busy := busy_note(load["others_cpu_share"], "the training loop")) is not None:
        report["notes"].append(busy)
    report.update(
        machine_load=load,
        status=status,
        error=str(error) if error else None,
        name=cfg.name,
        config_hash=resolved.hash,
        training_hash=resolved.training_hash,
        resumed_from=str(s.resumed_from) if s.resumed_from else None,
        setup_time_s=setup_s,
        model=s.model_info,
        device=str(s.device),
        compiled=s.compiled,
        data=getattr(s.data, "fingerprint", None),
        step_breakdown_s=step_breakdown(metrics, cfg.report.warmup_steps),
        world_size=s.ctx.world_size,
        parallel=cfg.parallel.degrees(),
        tokens_per_s_job=report["tokens_per_s"] * s.ctx.world_size if report.get("tokens_per_s") else None,
        mem_peak_bytes_per_rank=[r["mem_peak_bytes"] for r in per_rank],
        step_time_s_per_rank=[r["step_time_s"] for r in per_rank],
        pipeline_per_rank=[r["pipeline"] for r in per_rank] if s.pipeline is not None else None,
        compiler=_compiler_summary(s),
        history=[str(p) for p in history(run_dir)],  # the run folders of this run, restarts included
        final_val_loss=next((m["val_loss"] for m in reversed(metrics) if m.get("val_loss") is not None), None),
    )
    summary = {
        "name": cfg.name,
        "config_hash": resolved.hash,
        "status": status,
        "model params": s.model_info["params_total"],
        "precision": cfg.train.precision,
        "compile": s.compiled,
        "device": str(s.device),
        "processes": s.ctx.world_size,
        "parallel degrees": " × ".join(f"{k} {v}" for k, v in cfg.parallel.degrees().items()),
        "global batch × seq_len": f"{cfg.train.global_batch} × {cfg.train.seq_len}",
        "resumed from": report["resumed_from"],
        "history": " → ".join(Path(p).name for p in report["history"]) if len(report["history"]) > 1 else None,
    }
    write_report_md(report, summary, run_dir / "report.md", env=env)
    write_report_html(report, summary, run_dir, env=env)
    write_json(report, run_dir / "report.json")  # last: its presence marks the run as ended
    return report


def _distrust_low_probe(report: dict, s: TrainSetup) -> None:
    """A measured CPU peak below what training achieved was taken while the CPU was busy elsewhere:
    say so, and drop the cached figure so the next run measures again."""
    if report.get("mfu") is None or report["mfu"] <= 1.0 or not s.peak.cache_file:
        return
    Path(s.peak.cache_file).unlink(missing_ok=True)
    report["notes"].append(
        f"MFU above 100%: the cached CPU peak ({s.peak.tflops:.4g} TFLOP/s) was measured while the "
        "machine was busy; it has been deleted and the next run measures it again"
    )


def _announce(console: Console, s: TrainSetup, setup_s: float) -> None:
    params = s.model_info["params_total"]
    world = s.ctx.world_size
    # The job's tokens lead (what the report and `runs list` show); a rank's share only beside them.
    tokens = f"{s.tokens_per_step * world:,} tokens/step" + (
        f" (job; {s.tokens_per_step:,} per rank × {world} ranks)" if world > 1 else "")
    lines = [
        f"model {params / 1e6:.2f} M params on {s.device}; compile: {s.compiled}; {tokens}; setup {setup_s:.1f}s",
        "MFU peak: " + (f"{s.peak.tflops:.3f} TFLOP/s ({s.peak.source})" if s.peak.tflops
                        else f"unknown ({s.peak.detail})"),
    ]
    if s.resumed_from:
        lines.append(f"resuming from {s.resumed_from} at step {s.start_step} ({s.resume_reason})")
    elif s.config.checkpoint.resume != "none":
        lines.append(f"starting fresh: {s.resume_reason}")
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _print_summary(console: Console, r: dict, run_dir: Path) -> None:
    st = r["step_time_s"]["median"]
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a"
    # The job's throughput, as report.md and `runs list` show it: a rank's alone made a 2-rank FSDP
    # run look slower than one process when it was faster.
    tps = f"{r['tokens_per_s_job']:,.0f} tok/s" if r.get("tokens_per_s_job") else "n/a tok/s"
    ranks = r.get("world_size") or 1
    if ranks > 1 and r.get("tokens_per_s"):
        tps += f" (job; {r['tokens_per_s']:,.0f} per rank × {ranks})"
    step = f"{st * 1e3:.0f} ms" if st else "n/a"
    console.print(
        f"[bold green]done[/]: loss {r['first_loss']:.3f} → {r['final_loss']:.3f}; {tps}; "
        f"step {step} (median); MFU {mfu}; report {escape(str(run_dir / 'report.md'))}",
        highlight=False,
    )
    if r.get("no_steady_reason"):  # a short run: say why the figures are n/a, as report.md does
        console.print(f"  n/a: {r['no_steady_reason']}", markup=False, highlight=False)
    share = (r.get("machine_load") or {}).get("others_cpu_share")
    if (busy := busy_note(share, "the training loop")) is not None:
        console.print(f"[bold yellow]warning:[/] {escape(busy)}", highlight=False)
    compiler = r.get("compiler") or {}
    if compiler.get("compiled"):  # accelrun's backend: what ran compiled, in one line
        took = f"; compile {r['compile_time_s']:.1f} s" if r.get("compile_time_s") else ""
        console.print(f"  compiled: {compiler['compiled']}{took}", markup=False, highlight=False)
    for warning in compiler.get("warnings") or []:  # never silent: nothing compiled, skipped frames
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)


def _adapts_threads(cfg) -> bool:
    """A single process on the CPU with train.threads unset (ranks divide the node's cores instead;
    ACCELRUN_FIXED_THREADS=1 keeps torch's default, for tests that compare runs bit for bit)."""
    return (cfg.parallel.world_size == 1 and not rank_uses_cuda(cfg)
            and os.environ.get("ACCELRUN_FIXED_THREADS") != "1")


def _env_of_ranks(cfg) -> dict:
    """This process's environment, with the thread count and malloc settings CPU ranks will set
    (this launcher process keeps its own threads, which the ranks do not use)."""
    env = collect_env()
    if cfg.parallel.world_size > 1 and cfg.train.threads is None:  # GPU ranks set it too (dist.worker)
        env["cpu"]["torch_threads"] = cpu_rank_threads(cfg.parallel.nproc_per_node)
    if rank_uses_cuda(cfg):
        return env
    env["cpu"]["malloc"] = malloc_record(cfg.train.cpu_malloc)
    return env
