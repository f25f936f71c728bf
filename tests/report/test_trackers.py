"""report.trackers: what each tracker wrote, read back with that library's own reader."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from accelrun.report.trackers import TrackerMissing, check_trackers
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG, TINY


def _run(tiny, tracker: str):
    resolved = load_config(DEFAULT_CONFIG, tiny(4, f"report.trackers=[{tracker}]", "eval.every=2",
                                                 "checkpoint.enabled=false"))
    result = train(resolved, command="test")
    assert result.status == "finished"
    return result.run_dir, read_metrics(result.run_dir / "metrics.jsonl"), result.report


def test_tensorboard_events_hold_every_step(tiny):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows, report = _run(tiny, "tensorboard")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    for key in ("lr", "grad_norm", "step_time_s", "tokens_per_s", "mem_peak_bytes"):
        assert len(acc.Scalars(f"train/{key}")) == 4, key
    assert [e.step for e in acc.Scalars("train/val_loss")] == [2, 4]
    assert acc.Scalars("final/final_loss")[0].value == pytest.approx(report["final_loss"], rel=1e-6)
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()  # the resolved config
    assert '"dim": 64' in text and '"trackers"' in text


def test_wandb_offline_run_files(tiny, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir, rows, report = _run(tiny, "wandb")
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    # wandb's own service process writes the file; on a busy machine it may still be at it when finish()
    # has returned (CI saw an empty history twice), so read until the run's records are there.
    deadline = time.monotonic() + 60
    while True:
        history, config_keys, summary = [], set(), {}
        for data in _wandb_records(files[0].read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "config":
                config_keys |= {_key(i) for i in rec.config.update}
            elif kind == "summary":
                summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        if (len(history) >= len(rows) and "final_final_loss" in summary) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    assert [h["val_loss"] for h in history if "val_loss" in h] == pytest.approx([rows[1]["val_loss"],
                                                                                 rows[3]["val_loss"]])
    assert {"train.optimizer.lr", "model.dim"} <= config_keys
    assert summary["final_final_loss"] == pytest.approx(report["final_loss"], rel=1e-6)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_records(raw: bytes):
    """The protobuf records of a .wandb file. wandb >= 0.2x has no Python reader (its Go core reads
    them): a 7-byte header (":W&B", ident, version), then LevelDB's log format: 32 KiB blocks of chunks
    (crc32c u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last); a block's tail under 7 bytes
    is padding. The records are parsed with wandb's own protobuf classes."""
    if len(raw) < 7:  # wandb's service has not written the header yet
        return
    assert raw[:4] == b":W&B", raw[:8]
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        if pos + 7 + length > len(raw):  # a chunk still being written: the records up to it
            return
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield parts
            parts = b""


def test_mlflow_file_store(tiny, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker sets it for its file store
    from mlflow.tracking import MlflowClient

    run_dir, rows, report = _run(tiny, "mlflow")
    client = MlflowClient(tracking_uri=(run_dir / "mlflow").resolve().as_uri())
    exp = client.get_experiment_by_name("accelrun")
    (run,) = client.search_runs([exp.experiment_id])
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert [m.step for m in sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)] \
        == [2, 4]
    assert run.data.params["model.dim"] == "64"
    assert run.data.metrics["final_final_loss"] == pytest.approx(report["final_loss"], rel=1e-6)
    assert run.info.status == "FINISHED"


def test_a_missing_tracker_package_exits_2_naming_pip(tiny, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrackerMissing, match="pip install wandb"):
        check_trackers(["wandb"])
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=1", "report.trackers=[wandb]",
                                 f"report.runs_dir={tiny(1)[-1].split('=', 1)[1]}"])
    assert r.exit_code == 2 and "pip install wandb" in r.output, r.output
