"""A finished (or interrupted) run directory read back: config, provenance, machine, metrics, report.

``compare``, ``ab`` and ``runs list`` read runs through :func:`load_run`; nothing here imports torch.

Example::

    run = load_run("runs/llama-debug/20261122-131155-f27524")
    run.label, run.status, run.steady_step_times()[:3], run.config_flat["train.seed"]
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from accelrun.errors import UserError
from accelrun.report.lineage import continued_by, crash_error, history
from accelrun.report.metrics import read_metrics
from accelrun.report.rundir import is_running, runs_in
from accelrun.report.summary import steady_over_folders


class RunNotFound(UserError):
    """A path given as a run is not a run directory (or a folder holding some)."""


@dataclass
class RunRecord:
    path: Path
    config: dict[str, Any]
    sources: dict[str, str]  # dotted key -> where its value came from (config.sources.txt)
    env: dict[str, Any]
    metrics: list[dict]
    report: dict[str, Any] | None  # None while running or after an interruption
    running: bool = False
    label: str = field(default="")
    # A resumed run's folders, first segment first, and where each one's rows start in ``metrics``
    # (which holds every segment's steps, a redone step from the segment that redid it).
    segments: list[Path] = field(default_factory=list)
    segment_starts: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        if not self.label:  # where it lies under the runs folder (an explain run's name ends in -explain)
            self.label = f"{self.path.parent.name}/{self.path.name}"

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.parent.name)

    @property
    def status(self) -> str:
        """finished | diverged | running | continued (a later run took over its checkpoint) | crashed (its
        process raised) | interrupted (killed or stopped: no report.json, no live process, no crash)."""
        if self.report is not None:
            return str(self.report.get("status") or "finished")
        if self.running:
            return "running"
        if continued_by(self.path) is not None:
            return "continued"
        return self.stopped_by

    @property
    def stopped_by(self) -> str:
        """How a folder without a report ended: crashed (its process raised) or interrupted (killed or
        stopped); a continued folder keeps it, so a crash is not hidden once a later run went on."""
        return "crashed" if crash_error(self.path) is not None else "interrupted"

    @property
    def warmup_steps(self) -> int:
        if self.report is not None and self.report.get("warmup_steps") is not None:
            return int(self.report["warmup_steps"])
        return int((self.config.get("report") or {}).get("warmup_steps", 0))

    @cached_property
    def config_flat(self) -> dict[str, Any]:
        """The resolved config as ``{"train.steps": 300, ...}`` (lists are values, not sections)."""
        return flatten(self.config)

    def steady_step_times(self) -> list[float]:
        """Step times of the steady steps: after warm-up (each segment of a resumed run warms up
        again), not compiling, not profiled."""
        return self.steady_figures("step_time_s")

    def steady_figures(self, key: str) -> list[float]:
        """``key`` of each steady step's metrics row that has it (see ``steady_step_times``)."""
        return steady_over_folders(self.metrics, self.segment_starts, self.warmup_steps, key)

    def losses(self) -> dict[int, float]:
        return {int(m["step"]): float(m["loss"]) for m in self.metrics if m.get("loss") is not None}

    def learning_rates(self) -> dict[int, float]:
        return {int(m["step"]): float(m["lr"]) for m in self.metrics if m.get("lr") is not None}

    @property
    def tokens_per_step(self) -> int | None:
        if self.report and self.report.get("tokens_per_step"):
            return int(self.report["tokens_per_step"])
        return int(self.metrics[0]["tokens"]) if self.metrics and self.metrics[0].get("tokens") else None

    @property
    def job_tokens_per_step(self) -> int | None:
        """Tokens the whole job trains on per step (global batch × sequence length): what runs on
        different numbers of ranks, or with TP/PP sharing tokens between ranks, are compared by."""
        flat = self.config_flat
        batch, seq = flat.get("train.global_batch"), flat.get("train.seq_len")
        if isinstance(batch, int) and isinstance(seq, int):
            return batch * seq
        per_device, world = self.tokens_per_step, (self.report or {}).get("world_size") or 1
        return per_device * int(world) if per_device else None

    def figure(self, key: str) -> Any:
        return (self.report or {}).get(key)

    @cached_property
    def segment_envs(self) -> list[dict]:
        """env.json of each of its folders, first folder first (one for a run that was not resumed)."""
        return [_read_json(s / "env.json") or {} for s in self.segments[:-1]] + [self.env]

    @cached_property
    def mfu(self) -> float | None:
        """The report's MFU at this run's median steady step. A resumed run's report measured its last
        folder's steps only; its flops per step and peak hold for every folder (the model is the same)."""
        said = self.figure("mfu")
        if self.report is None:  # interrupted or running: its steady steps' own figures
            mfus = self.steady_figures("mfu")
            return statistics.median(mfus) if mfus else None
        measured_at = (self.figure("step_time_s") or {}).get("median")
        times = self.steady_step_times()
        if said is None or len(self.segments) < 2 or not measured_at or not times:
            return said
        return float(said) * float(measured_at) / statistics.median(times)

    @cached_property
    def mem_peak_bytes(self) -> int | None:
        """The highest peak of its folders: each one's report's, or where it wrote none (a folder that was
        stopped and continued, or a run still going) the highest of its own steps' rows."""
        segments = self.segments or [self.path]
        reports = [_read_json(s / "report.json") for s in segments[:-1]] + [self.report]
        peaks = []
        for segment, report in zip(segments, reports, strict=True):
            if report is not None and report.get("mem_peak_bytes") is not None:
                peaks.append(int(report["mem_peak_bytes"]))
            else:  # its own rows (in ``metrics`` a redone step's row is the later folder's)
                rows = self.metrics[self.segment_starts[-1]:] if segment == self.path else _segment_rows(segment)
                peaks += [int(m["mem_peak_bytes"]) for m in rows if m.get("mem_peak_bytes") is not None]
        return max(peaks) if peaks else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; an empty dict is a value of its own."""
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for k, v in tree.items():
            flat.update(flatten(v, f"{prefix}{k}."))
        return flat
    return {prefix[:-1]: tree} if prefix else {}


def parse_sources(text: str, values: dict[str, Any]) -> dict[str, str]:
    """``config.sources.txt`` (``key  value  source``, aligned) to ``{key: source}``.

    The value column is ``repr`` of the value, padded; knowing the value from ``config.yaml``
    finds where it ends even when it holds double spaces. A line that does not parse keeps its
    last column.
    """
    sources: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        key, _, rest = line.partition(" ")
        rest = rest.lstrip()
        shown = repr(values[key]) if key in values else None
        if shown is not None and rest.startswith(shown):
            sources[key] = rest[len(shown):].strip()
        else:
            sources[key] = re.split(r"\s{2,}", rest.strip())[-1]
    return sources


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise RunNotFound(f"{path}: not valid JSON ({e})") from None


def resolve_run_path(ref: str | Path) -> Path:
    """A run directory, or a folder of runs (``runs/<name>`` or ``runs``): then its newest run."""
    path = Path(ref).expanduser()
    if not path.exists():
        raise RunNotFound(f"run directory not found: {ref}")
    if (path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file():
        return path
    if path.is_dir():
        for run in runs_in(path):
            if (run / "metrics.jsonl").is_file():
                return run
    raise RunNotFound(f"{ref} is not a run directory (no metrics.jsonl or config.yaml) and holds no runs")


def load_run(ref: str | Path, label: str = "") -> RunRecord:
    """Read a run directory (or the newest run in a folder of runs; see :func:`resolve_run_path`)."""
    path = resolve_run_path(ref)
    config_file = path / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise RunNotFound(f"{path}: no config.yaml; is this an accelrun run directory?") from None
    except yaml.YAMLError as e:
        raise RunNotFound(f"{config_file}: not valid YAML ({e})") from None
    flat = flatten(config)
    try:
        sources = parse_sources((path / "config.sources.txt").read_text(encoding="utf-8"), flat)
    except FileNotFoundError:
        sources = {}
    segments = history(path)
    metrics, starts = history_metrics(segments)
    return RunRecord(path=path, config=config, sources=sources, env=_read_json(path / "env.json") or {},
                     metrics=metrics, report=_read_json(path / "report.json"),
                     running=is_running(path), label=label, segments=segments, segment_starts=starts)


def _segment_rows(segment: Path) -> list[dict]:
    """One run folder's own metrics rows ([] where it has none or they cannot be read)."""
    try:
        return read_metrics(segment / "metrics.jsonl") if (segment / "metrics.jsonl").exists() else []
    except ValueError:
        return []


def history_metrics(segments: list[Path]) -> tuple[list[dict], list[int]]:
    """The steps of a run's folders (``lineage.history``) as one list, and where each folder's begin:
    a resumed folder redoes the steps after its checkpoint, so its rows replace an earlier folder's
    from its first step on."""
    metrics: list[dict] = []
    starts: list[int] = []
    for segment in segments:
        metrics_file = segment / "metrics.jsonl"
        try:
            rows = read_metrics(metrics_file) if metrics_file.exists() else []
        except ValueError as e:
            raise RunNotFound(str(e)) from None
        if rows and metrics:
            first = int(rows[0]["step"])
            metrics = [m for m in metrics if int(m["step"]) < first]
            starts = [s for s in starts if s < len(metrics)]
        starts.append(len(metrics))
        metrics += rows
    return metrics, starts or [0]
