"""Chat fine-tuning on 2 FSDP ranks gives the one-process losses although the ranks keep different numbers
of assistant targets each step: each micro-batch is weighted by its share of the step's targets
(accelrun/train/token_mean.py), so data-parallel averaging yields the mean over the whole step's targets."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from tests.conftest import REPO
from tests.data.chat_helpers import CHATS, save_chat_tokenizer, write_chats
from tests.dist import jobs
from tests.models.hf_helpers import save_tiny_hf

pytest.importorskip("transformers", reason="the chat model folder is written with transformers")


def _chat_run(tmp_path: Path, name: str, *more: str) -> list[dict]:
    folder, chats = tmp_path / "model", tmp_path / "chats.jsonl"
    if not folder.exists():
        save_tiny_hf(folder)
        save_chat_tokenizer(folder)
        write_chats(chats, CHATS * 4)
    overrides = [f"model.hf={folder}", f"data.paths=[{chats}]", f"report.runs_dir={tmp_path / 'runs'}",
                 f"name={name}", "train.device=cpu", "train.seq_len=32", "train.global_batch=4", "train.steps=3",
                 "report.warmup_steps=1", "report.progress=none", "compile.backend=eager", "data.packing=concat",
                 "checkpoint.enabled=false", "checkpoint.hf_on_finish=false", *more]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        result = jobs.train(load_config(REPO / "configs" / "hf-chat.yaml", overrides), command="test")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert result.status == "finished"
    return read_metrics(result.run_dir / "metrics.jsonl")


def test_two_fsdp_ranks_give_the_one_process_chat_losses(tmp_path):
    one = _chat_run(tmp_path, "one")
    two = _chat_run(tmp_path, "two", *jobs.FSDP2)
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=jobs.LOSS_RTOL)
    # Rank 0's targets (two's loss_tokens) are not half of the step's in some step: the weights matter.
    assert any(2 * b["loss_tokens"] != a["loss_tokens"] for a, b in zip(one, two, strict=True))
