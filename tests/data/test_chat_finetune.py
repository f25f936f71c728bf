"""Chat fine-tuning end to end, as the README's "Your data" section does it: a transformers Llama folder
with a chat tokenizer (built here, nothing downloads) trained on chat jsonl through configs/hf-chat.yaml,
the loss counting only the assistant's tokens, exported, and loaded back by transformers.

The first step's loss is transformers' own cross-entropy over the same batch (before any update), with
the user's targets ignored; metrics.jsonl's loss_tokens are the targets the loader left in the loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accelrun.config import load_config
from accelrun.data import build_data
from accelrun.data.loss_mask import count_loss_targets
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from tests.conftest import REPO
from tests.data.chat_helpers import CHATS, save_chat_tokenizer, write_chats
from tests.models.hf_helpers import save_tiny_hf

transformers = pytest.importorskip("transformers", reason="the chat tests compare against transformers")

STEPS = 3
SMALL = ["train.device=cpu", "train.seq_len=32", "train.global_batch=4", f"train.steps={STEPS}",
         "train.optimizer.lr=1e-3", "report.warmup_steps=1", "report.progress=none"]


@pytest.fixture
def chat_model(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "my-chat-model"
    save_tiny_hf(folder)
    save_chat_tokenizer(folder)
    return folder, write_chats(tmp_path / "chats.jsonl", CHATS * 4)


def _overrides(tmp_path: Path, folder: Path, chats: Path, *more: str) -> list[str]:
    return [f"model.hf={folder}", f"data.paths=[{chats}]", f"report.runs_dir={tmp_path / 'runs'}", *SMALL, *more]


def _batches(cfg):
    """The run's batches, as its loader gives them (the held-out tail left out when it evaluates)."""
    return build_data(cfg.data, seq_len=cfg.train.seq_len, micro_batch=cfg.train.global_batch, seed=cfg.train.seed,
                      vocab_size=cfg.model.vocab_size, eval_cfg=cfg.eval)


def _loss_tokens_per_step(cfg) -> list[int]:
    data = _batches(cfg)
    return [int(count_loss_targets(next(data).targets)) for _ in range(STEPS)]


def test_first_step_loss_is_transformers_masked_loss(chat_model, tmp_path):
    folder, chats = chat_model
    resolved = load_config(REPO / "configs" / "hf-chat.yaml",
                           _overrides(tmp_path, folder, chats, "data.packing=concat", "compile.backend=eager",
                                      "checkpoint.hf_on_finish=false", f"eval.every={STEPS}", "eval.split=0.2"))
    cfg = resolved.config
    result = train(resolved, command="test")
    metrics = read_metrics(result.run_dir / "metrics.jsonl")
    assert math.isfinite(metrics[-1]["val_loss"])  # held-out chats: the mean over their assistant targets
    assert [m["loss_tokens"] for m in metrics] == _loss_tokens_per_step(cfg)
    assert all(0 < m["loss_tokens"] < m["tokens"] for m in metrics)

    inputs_BT, targets_BT = next(_batches(cfg))
    assert (targets_BT == -100).any()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(inputs_BT).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets_BT.flatten(), ignore_index=-100)
    assert metrics[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)

    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["loss_tokens_per_step"] == pytest.approx(sum(m["loss_tokens"] for m in metrics) / STEPS)
    assert "tokens in the loss" in (result.run_dir / "report.md").read_text()


def test_the_recipe_compiles_trains_exports_and_transformers_loads_it(chat_model, tmp_path):
    """configs/hf-chat.yaml (document packing, accelrun's compiler): the fused loss head takes the masked
    targets, and the export is a transformers folder with the chat template."""
    folder, chats = chat_model
    # executors=[aten]: the passes (the fused loss head among them) as the recipe runs them, without
    # compiling C++ kernels into this test's empty cache (seconds that prove nothing here).
    resolved = load_config(REPO / "configs" / "hf-chat.yaml", _overrides(tmp_path, folder, chats,
                                                                       "compile.executors=[aten]"))
    assert (resolved.config.data.packing, resolved.config.compile.backend) == ("document", "accelrun")
    result = train(resolved, command="test")
    metrics = read_metrics(result.run_dir / "metrics.jsonl")
    assert [m["loss_tokens"] for m in metrics] == _loss_tokens_per_step(resolved.config)
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["compiler"]["passes_fired"].get("fuse_linear_cross_entropy") == 1

    exported = result.run_dir / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tok.apply_chat_template(CHATS[0], tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    trained = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(trained, original)  # the export is the fine-tuned model


def _chat_losses(tmp_path: Path, folder: Path, chats: Path, name: str, *more: str) -> list[float]:
    resolved = load_config(REPO / "configs" / "hf-chat.yaml", [
        *_overrides(tmp_path / name, folder, chats, "data.packing=concat", "compile.backend=eager",
                    "checkpoint.hf_on_finish=false"), *more])
    return [m["loss"] for m in read_metrics(train(resolved, command="test").run_dir / "metrics.jsonl")]


def test_gradient_accumulation_keeps_the_mean_over_the_steps_targets(chat_model, tmp_path, monkeypatch):
    """The same 4 windows a step, as one micro-batch or two: the loss and the update are those of the mean over
    all the step's assistant targets (two micro-batches keep different numbers of them), so the runs agree."""
    folder, chats = chat_model
    whole = _chat_losses(tmp_path, folder, chats, "whole")
    halves = _chat_losses(tmp_path, folder, chats, "halves", "train.micro_batch=2")
    assert halves == pytest.approx(whole, rel=1e-5)
    import accelrun.train.loop as loop  # each half's mean / 2 instead: another loss, after step 1 other weights

    monkeypatch.setattr(loop, "uses_token_mean", lambda cfg, pipelined: False)
    assert _chat_losses(tmp_path, folder, chats, "per-half", "train.micro_batch=2") != pytest.approx(whole, rel=1e-4)
