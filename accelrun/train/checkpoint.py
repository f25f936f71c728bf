"""Checkpoints that a kill can never corrupt, written with torch.distributed.checkpoint (DCP).

Layout, under ``<run dir>/checkpoints/``::

    step-000100/           complete: DCP shards + train_state.json + rng/ + COMPLETE
    .tmp-step-000200-ab12/ being written (or left by a kill): never trusted; removed when the run
                           it belongs to is resumed

A checkpoint is written into a temporary folder, and only when every file is on disk is the
``COMPLETE`` marker written and the folder renamed (an atomic rename on one filesystem).
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from accelrun.dist.context import ParallelContext
from accelrun.report.rundir import unwritable

COMPLETE = "COMPLETE"
TRAIN_STATE = "train_state.json"
PREFIX = "step-"
RNG_DIR = "rng"  # a file per rank: each rank's generators draw its own dropout masks


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    training_hash: str
    created: float

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    keep: int,
    ctx: ParallelContext | None = None,
) -> Path:
    """Write step ``step`` atomically, then delete all but the newest ``keep`` complete ones.

    Collective in a multi-process job: every rank writes its shards into the same temporary
    folder; rank 0 alone marks it complete, renames and prunes, and the others wait for that.
    A folder that cannot be written (read-only, full, a file in the way) is a ``RunFolderError``.
    """
    try:
        return _save(ckpt_dir, step, model, optimizer, train_state, keep, ctx)
    except OSError as e:
        raise unwritable(e, ckpt_dir.parent.parent.parent) from None
    except CheckpointException as e:  # DCP wraps each rank's error
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # (exception, trace)
        cause = next((c for c in causes if isinstance(c, OSError)), None)
        if cause is None:
            raise
        raise unwritable(cause, ckpt_dir.parent.parent.parent) from None


def _save(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
          train_state: dict[str, Any], keep: int, ctx: ParallelContext | None) -> Path:
    main = ctx is None or ctx.is_main
    final = ckpt_dir / f"{PREFIX}{step:06d}"
    tmp = ckpt_dir / f".tmp-{final.name}"  # the same name on every rank
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    _barrier(ctx)
    save_rng_state(tmp, ctx.rank if ctx is not None else 0)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # collective: every rank's file is written
    if main:
        _write_synced(tmp / TRAIN_STATE, json.dumps({"step": step, **train_state}, indent=1))
        _write_synced(tmp / COMPLETE, "")
        if final.exists():  # a re-save of the same step: move the old one aside first, never lose both
            old = ckpt_dir / f".tmp-old-{final.name}-{secrets.token_hex(2)}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        for old_ckpt in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old_ckpt.path, ignore_errors=True)
    _barrier(ctx)
    return final


def _barrier(ctx: ParallelContext | None) -> None:
    if ctx is not None:
        ctx.barrier()


# The optimizer's settings are saved per parameter name ("optim.param_groups.<name>.lr"), not per group
# index ("optim.param_groups.0.lr"): under pipelining each rank's groups hold other parameters, the
# indices collided, one rank's groups were kept, and the others' came back without settings (a resumed
# pipeline said the optimizer went on "lr: None -> 0.003"; a new user's trial, 2026-12-07).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
BY_GROUP_INDEX = StateDictOptions()  # how checkpoints were written before


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model and optimizer state in place; returns the saved train state (step, data, ...)."""
    options = FLAT if _flat(path) else BY_GROUP_INDEX
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return json.loads((path / TRAIN_STATE).read_text())


def _flat(path: Path) -> bool:
    """Whether the checkpoint keeps the optimizer's settings per parameter name (``FLAT``)."""
    return "optim.param_groups.0.params" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def rng_file(path: Path, rank: int) -> Path:
    return path / RNG_DIR / f"rank-{rank:05d}.pt"


def save_rng_state(path: Path, rank: int) -> None:
    """This rank's random generators as they stand after the checkpoint's step: dropout masks (eager's,
    and those drawn in compiled kernels from a seed torch's generator gives) and anything else the next
    step draws continue as in a run that was never stopped."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    file = rng_file(path, rank)
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "wb") as f:  # on disk before COMPLETE is, as the train state is
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def restore_rng_state(path: Path, rank: int, world_size: int = 1) -> str | None:
    """Sets this rank's generators from checkpoint ``path``. Returns None if every rank of the job can
    (rank 0, which prints it, looks for all of them), else why not: a checkpoint written before
    generators were saved, by a job with fewer ranks, or a file that does not load. A rank without its
    state goes on from its seed, and the masks it draws differ from an uninterrupted run's."""
    missing = [r for r in range(world_size) if not rng_file(path, r).is_file()]
    try:
        state = torch.load(rng_file(path, rank), weights_only=True) if rank not in missing else None
    except Exception:  # noqa: BLE001 (damaged: the run goes on, and says so)
        state, missing = None, sorted({*missing, rank})
    if state is not None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    if not missing:
        return None
    ranks = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing[0]}-{missing[-1]}"
    return (f"{path.name} holds no readable random-generator state for {ranks} (written by an older accelrun or "
            "a job with fewer ranks): dropout masks after it differ from an uninterrupted run's")


def complete_checkpoints(ckpt_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints in ``ckpt_dir``, oldest step first (damaged ones left out)."""
    return checkpoints_and_damaged(ckpt_dir)[0]


def checkpoints_and_damaged(ckpt_dir: Path) -> tuple[list[CheckpointInfo], list[tuple[CheckpointInfo, str]]]:
    """Complete checkpoints in ``ckpt_dir``, and those marked complete whose files were damaged since
    (with why), each oldest step first."""
    if not ckpt_dir.is_dir():
        return [], []
    good, bad = [], []
    for p in ckpt_dir.glob(f"{PREFIX}*"):
        info = read_info(p)
        if info is None:
            continue
        why = damage(p)
        if why is None:
            good.append(info)
        else:
            bad.append((info, why))
    return sorted(good, key=lambda i: i.step), sorted(bad, key=lambda b: b[0].step)


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded whole, or None: unreadable metadata, a shard
    file missing or shorter than the metadata says (a copy cut short, a full disk, a torn file system)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any reason the metadata cannot be read is damage
        return f"its metadata cannot be read ({type(e).__name__})"
    needed: dict[str, int] = {}
    for where in metadata.storage_data.values():
        needed[where.relative_path] = max(needed.get(where.relative_path, 0), where.offset + where.length)
    for name, size in sorted(needed.items()):
        try:
            have = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if have < size:
            return f"{name} is {have:,} bytes, its metadata needs {size:,} (truncated)"
    return None


def read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if it is complete, else None."""
    marker, state = path / COMPLETE, path / TRAIN_STATE
    if not (marker.is_file() and state.is_file()):
        return None
    try:
        saved = json.loads(state.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return CheckpointInfo(path, int(saved["step"]), _current_hash(saved.get("training_hash", ""), path),
                          marker.stat().st_mtime)


def _current_hash(saved: str, path: Path) -> str:
    """A checkpoint's training hash as this version computes it: one written before the timeouts left the
    hash (``resolve.NOT_TRAINING_KEYS``) is recognised by its run folder's config.yaml, so such a run
    still resumes."""
    config = path.parent.parent / "config.yaml"
    try:
        stamp = config.stat().st_mtime_ns
    except OSError:
        return saved
    before, now = _hashes_of(config, stamp)
    return now if before is not None and saved == before else saved


@functools.lru_cache(maxsize=4096)
def _hashes_of(config: Path, stamp: int) -> tuple[str | None, str | None]:
    """(the training hash before 2026-12-07, today's) of a run's config.yaml: read once per version of the
    file (resume lists every checkpoint of every run of a name, several times in a setup)."""
    import yaml

    from accelrun.config.resolve import training_hash_before_2026_12_07, training_hash_of

    try:
        values = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None, None
    if not isinstance(values, dict):
        return None, None
    return training_hash_before_2026_12_07(values), training_hash_of(values)


def remove_partial(ckpt_dir: Path) -> list[Path]:
    """Delete folders a killed save left behind; returns them."""
    left = sorted(ckpt_dir.glob(".tmp-*")) if ckpt_dir.is_dir() else []
    for p in left:
        shutil.rmtree(p, ignore_errors=True)
    return left


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
