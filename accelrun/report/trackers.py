"""Experiment trackers (``report.trackers``): TensorBoard, W&B (offline), MLflow (file store).

Each tracker is one small class behind ``Tracker``: ``log_config`` once, ``log_step`` for every
metrics.jsonl record, ``log_summary`` with the final report, ``close``. Rank 0 alone creates them
(``open_trackers`` is called where metrics.jsonl is written). Everything lands inside the run
folder; nothing reaches the network (W&B runs in offline mode).

>>> trackers = open_trackers(["tensorboard"], run_dir, config_dict)  # doctest: +SKIP
>>> trackers.log_step(record); trackers.log_summary(report); trackers.close()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from accelrun.errors import UserError

# tracker name -> (module that must import, pip package)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
# metrics.jsonl keys logged per step (when present and numeric)
STEP_KEYS = ("loss", "val_loss", "lr", "grad_norm", "step_time_s", "data_time_s", "tokens_per_s", "mfu",
             "mem_peak_bytes", "mem_reserved_bytes", "forward_s", "backward_s", "optimizer_s", "comm_s")


class TrackerMissing(UserError):
    pass


def check_trackers(names: list[str]) -> None:
    """Exit 2 before any work when a named tracker's package is not installed."""
    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n][0]) is None]
    if missing:
        pkgs = " ".join(PACKAGES[n][1] for n in missing)
        raise TrackerMissing(
            f"report.trackers names {', '.join(missing)}, but its package is not installed: "
            f"pip install {pkgs}  (or pip install 'accelrun[{','.join(missing)}]'), or remove it from report.trackers"
        )


def _numbers(d: dict[str, Any], keys=None) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if keys is not None and k not in keys:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[k] = float(v)
    return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``; lists and None as strings (hyperparameter tables)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


class Tracker:
    """The interface: every method is optional to override."""

    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_step(self, step: int, values: dict[str, float]) -> None: ...
    def log_summary(self, summary: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_config(self, config):
        import json

        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")

    def log_step(self, step, values):
        for k, v in values.items():
            self.writer.add_scalar(f"train/{k}", v, step)

    def log_summary(self, summary):
        for k, v in summary.items():
            self.writer.add_scalar(f"final/{k}", v, 0)

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run_dir: Path, name: str):
        import wandb

        os.environ["WANDB_MODE"] = "offline"  # never the network
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="accelrun", name=name, dir=str(run_dir), mode="offline", reinit=True)

    def log_config(self, config):
        self.run.config.update(_flat(config), allow_val_change=True)

    def log_step(self, step, values):
        self.run.log(values, step=step)

    def log_summary(self, summary):
        for k, v in summary.items():
            self.run.summary[f"final_{k}"] = v

    def close(self):
        self.run.finish()


class MlflowTracker(Tracker):
    def __init__(self, run_dir: Path, name: str, uri: str | None):
        from mlflow.tracking import MlflowClient

        if uri is None:  # the local file store; MLflow >= 3.x refuses it unless asked (no database needed)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri or (run_dir / "mlflow").resolve().as_uri())
        exp = self.client.get_experiment_by_name("accelrun")
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("accelrun")
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def log_config(self, config):
        for k, v in _flat(config).items():
            self.client.log_param(self.run_id, k, str(v)[:500])

    def log_step(self, step, values):
        for k, v in values.items():
            self.client.log_metric(self.run_id, k, v, step=step)

    def log_summary(self, summary):
        for k, v in summary.items():
            self.client.log_metric(self.run_id, f"final_{k}", v)

    def close(self):
        self.client.set_terminated(self.run_id)


class Trackers:
    """All of a run's trackers as one; an empty list does nothing."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_config(self, config: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_config(config)

    def log_step(self, record: dict[str, Any]) -> None:
        values = _numbers(record, STEP_KEYS)
        for t in self.trackers:
            t.log_step(int(record["step"]), values)

    def log_summary(self, report: dict[str, Any]) -> None:
        summary = _numbers(report)  # the report's scalar figures (final loss, tokens/s, MFU, ...)
        for t in self.trackers:
            t.log_summary(summary)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def open_trackers(names: list[str], run_dir: Path, config: dict[str, Any], *, name: str = "run",
                  mlflow_uri: str | None = None) -> Trackers:
    """The trackers ``names`` asks for, with the resolved config logged as hyperparameters."""
    check_trackers(names)
    made: list[Tracker] = []
    for n in names:
        if n == "tensorboard":
            made.append(TensorBoardTracker(run_dir))
        elif n == "wandb":
            made.append(WandbTracker(run_dir, name))
        elif n == "mlflow":
            made.append(MlflowTracker(run_dir, name, mlflow_uri))
    trackers = Trackers(made)
    trackers.log_config(config)
    return trackers
