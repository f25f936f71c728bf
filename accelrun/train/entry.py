"""``train()``: a recipe to a finished run directory, in this process or through torchrun's elastic agent.

The run directory is written as the run goes: ``config.yaml``, ``command.txt`` and ``env.json``
before the first step, then what ``train.run.run_in_dir`` writes. While the run is alive its launcher
holds the directory's lock, so ``checkpoint.resume: auto`` never takes over a live run. A multi-process
job starts one process per device through ``dist.launch``, each running ``train.rank.run_rank``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.markup import escape

from accelrun.config import ConfigError, ResolvedConfig
from accelrun.config.preflight import preflight
from accelrun.config.resolve import explain_text, training_hash_of
from accelrun.consoles import DiagnosticConsole
from accelrun.dist import stop
from accelrun.dist.launch import JobOutcome, launch_job
from accelrun.dist.launch_options import LaunchOptions
from accelrun.dist.node_configs import leave_launched_hash
from accelrun.dist.worker import cpu_rank_threads, machine_as_torch_sees_it, rank_uses_cuda
from accelrun.errors import UserError
from accelrun.report.env import collect_env
from accelrun.report.files import write_json, write_text_atomic
from accelrun.report.rundir import create_run_dir, hold_run_lock, job_run_dir
from accelrun.report.trackers import check_trackers
from accelrun.train.host_malloc import malloc_record
from accelrun.train.lineage import mark_crashed
from accelrun.train.rank import run_rank
from accelrun.train.resume import threads_of_the_run_resumed
from accelrun.train.run import TrainResult, _print_summary, run_in_dir
from accelrun.train.threads import choose_threads


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
    console = console or DiagnosticConsole()
    threads_why = None  # why fewer threads than cores, for env.json and the report
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)  # before env.json records it and the peak probe runs
    elif _adapts_threads(cfg):
        threads_why = _choose_threads(cfg, resolved.training_hash)
        if threads_why is not None:
            console.print(threads_why, markup=False, highlight=False)
    # Files the recipe names, one GPU per process, cores for the ranks: exit 2 (or warn) before a run
    # directory or a rank exists; `accelrun validate` runs the same checks.
    for warning in preflight(cfg, resolved.sources, machine_as_torch_sees_it()):
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    check_trackers(cfg.report.trackers)  # a missing tracker package: exit 2 before any work
    launch = launch or LaunchOptions()
    run_dir, node = _run_dir_for(resolved, launch)
    # Caught from here on: a signal during setup stops the run after its first step, with a checkpoint.
    with hold_run_lock(run_dir, node), stop.catch_signals():
        # A finished job's folder entered again (its --rdzv-id given again) keeps the run's own records:
        # written over, they no longer matched its report (a review's finding).
        report_before = _stamp(run_dir / "report.json")  # a finished job's, entered again
        if report_before is None:
            write_text_atomic(resolved.to_yaml(), run_dir / "config.yaml")
            write_text_atomic(explain_text(resolved), run_dir / "config.sources.txt")
            write_text_atomic((command or "(called from Python)") + "\n", run_dir / "command.txt")
            write_json(_env_of_ranks(cfg, threads_why), run_dir / "env.json")
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
        leave_launched_hash(run_dir, resolved.training_hash)  # the ranks check that every node resolved the same
        outcome = launch_job(run_dir, cfg.parallel, launch, run_rank,
                             say=lambda line: console.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False))
    return _warn_if_late(_launched_result(run_dir, outcome, console,
                                          report_before is not None and _stamp(run_dir / "report.json") == report_before),
                         console)


def _stamp(path: Path) -> tuple[int, int] | None:
    """A file's identity and time: whether the launched ranks wrote it anew (a diverged job trained again)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _warn_if_late(result: TrainResult, console: Console) -> TrainResult:
    if result.stopped is not None and (late := stop.late_warning()):
        console.print(late, markup=False, highlight=False)
    return result


def _run_dir_for(resolved: ResolvedConfig, launch: LaunchOptions) -> tuple[Path, int]:
    """A new run directory; for a job on several nodes, the one directory all of them share."""
    cfg = resolved.config
    if cfg.parallel.nnodes == 1:
        return create_run_dir(cfg.report.runs_dir, cfg.name), 0
    if not launch.rdzv_id or launch.node_rank is None or not launch.rdzv_endpoint:
        raise ConfigError(
            f"parallel.nnodes = {cfg.parallel.nnodes}: give every node the same --rdzv-id and "
            "--rdzv-endpoint HOST:PORT, and its own --node-rank"
        )
    try:
        run_dir = job_run_dir(cfg.report.runs_dir, cfg.name, launch.rdzv_id)
    except ValueError as e:
        raise ConfigError(f"--rdzv-id: {e}") from None
    _refuse_another_training(run_dir, resolved, launch.rdzv_id)
    return run_dir, launch.node_rank


def _refuse_another_training(job_dir: Path, resolved: ResolvedConfig, job_id: str) -> None:
    """A job's folder is entered again when the job is requeued, and continues its own run there. The
    same id given to another training would have written its recipe over the run's, which a new
    user found beside the run's own report (and checkpoints it could not continue): exit 2 instead."""
    try:
        held = yaml.safe_load((job_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # a garbled file (UnicodeDecodeError is a ValueError)
        return
    if not isinstance(held, dict) or not (job_dir / "metrics.jsonl").exists():
        return
    if (theirs := training_hash_of(held)) != resolved.training_hash:
        raise ConfigError(f"--rdzv-id {job_id}: {job_dir} holds this job id's run of another training (training hash "
                          f"{theirs}, this recipe's {resolved.training_hash}); give a new --rdzv-id to start a new "
                          f"run (with checkpoint.resume={job_dir} to go on from its newest checkpoint, as when "
                          "raising train.steps), or the same recipe to continue that one")


def _launched_result(run_dir: Path, outcome: JobOutcome, console: Console,
                     report_untouched: bool = False) -> TrainResult:
    code = outcome.exit_code
    if outcome.stopped is not None:
        console.print(outcome.stopped.line(outcome.ranks), markup=False, highlight=False)
        return TrainResult(run_dir, outcome.stopped.status, None, outcome.stopped)
    report_path = run_dir / "report.json"
    if code == 0 and report_path.exists():
        report = json.loads(report_path.read_text())
        if report_untouched:
            # the ranks trained nothing: the old report's "done: loss ..." read as this rerun's (a new user)
            loss = report.get("final_loss")
            console.print(f"this job's run had finished before ({report.get('steps')} steps, final loss "
                          f"{'n/a' if loss is None else f'{loss:.3f}'}); nothing was trained now; its report: "
                          f"{run_dir / 'report.md'}", markup=False, highlight=False)
            return TrainResult(run_dir, "nothing-to-do", report)
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


def _choose_threads(cfg, training_hash: str) -> str | None:
    """Set this process's threads: as many as the run it continues took (its losses then go on as an
    uninterrupted run's would), else the cores nobody else is using now (train/threads.py says why).
    Why, when that is not every core this process may use."""
    choice = choose_threads()
    runs_root = Path(cfg.report.runs_dir) / cfg.name
    resumed = threads_of_the_run_resumed(cfg.checkpoint.resume, runs_root, training_hash)
    if resumed is not None and resumed != choice.threads and resumed <= choice.usable_cores:
        torch.set_num_threads(resumed)
        return (f"threads: {resumed}, as the run it continues took, so its losses go on as an uninterrupted "
                f"run's would ({choice.threads} would be taken now; train.threads sets it)")
    torch.set_num_threads(choice.threads)
    if resumed is not None and resumed > choice.usable_cores:
        return (f"threads: {choice.threads}; the run it continues took {resumed}, more than the {choice.usable_cores} "
                "cores this process may use, so its losses will part from an uninterrupted run's")
    return choice.describe() if choice.threads != choice.usable_cores else None


def _adapts_threads(cfg) -> bool:
    """A single process on the CPU with train.threads unset (ranks divide the node's cores instead;
    ACCELRUN_FIXED_THREADS=1 keeps torch's default, for tests that compare runs bit for bit)."""
    return (cfg.parallel.world_size == 1 and not rank_uses_cuda(cfg)
            and os.environ.get("ACCELRUN_FIXED_THREADS") != "1")


def _env_of_ranks(cfg, threads_why: str | None = None) -> dict:
    """This process's environment, with the thread count and malloc settings CPU ranks will set
    (this launcher process keeps its own threads, which the ranks do not use), and why a one-process
    run took fewer threads than cores."""
    env = collect_env()
    if threads_why is not None:
        env["cpu"]["threads_chosen"] = threads_why
    if cfg.parallel.world_size > 1 and cfg.train.threads is None:  # GPU ranks set it too (dist.worker)
        env["cpu"]["torch_threads"] = cpu_rank_threads(cfg.parallel.nproc_per_node)
    if rank_uses_cuda(cfg):
        return env
    env["cpu"]["malloc"] = malloc_record(cfg.train.cpu_malloc)
    return env
