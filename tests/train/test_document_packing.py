"""data.packing = document: each document's per-token losses, computed packed by accelrun (compiled by its
backend, the default recipe's compile settings), equal transformers' ``LlamaForCausalLM`` run on that document
alone with the same weights (fp32, 1e-5), and the kernel behind it keeps attention inside each document."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accelrun.config import load_config
from accelrun.data.document_packing import IGNORE_INDEX, DocumentBatch
from accelrun.data.loader import TokenBatchIterator
from accelrun.models.document_attention import document_attention, flex_document_attention
from accelrun.train.setup import build_setup
from tests.conftest import DEFAULT_CONFIG
from tests.models.hf_helpers import save_tiny_hf
from tests.train.document_parity import EOS, document_pieces, document_stream, transformers_losses

RTOL = 1e-5
# Varied lengths: several documents per window, some windows cut a document, one longer than a window.
LENGTHS = [5, 17, 3, 40, 9, 1, 22, 12, 31, 7, 2, 19, 70, 11, 6, 25, 14, 8, 33, 4]


def test_document_attention_equals_masked_attention_forward_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 0, 1, 2]])
    doc = (positions == 0).cumsum(1)
    # The dense block-causal mask exists only here, as the reference.
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    got = document_attention(q, k, v, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Plain causal attention over the row differs: the documents really were kept apart.
    assert (F.scaled_dot_product_attention(q, k, v, is_causal=True) - got).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: flex_attention called without torch.compile
def test_flex_attention_kernel_keeps_documents_apart():
    # CUDA's kernel; torch's uncompiled reference runs it here (FlexAttention has no CPU backward).
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8) for _ in range(3))
    positions = torch.cat([torch.arange(13), torch.arange(20), torch.arange(7)]).repeat(2, 1)
    positions[1, 5:] = torch.arange(35)
    want = torch.cat([document_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], positions[b : b + 1])
                      for b in range(2)])
    got = flex_document_attention(q, k, v, positions, 8**-0.5, compiled=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_windows_carry_positions_and_mask_the_target_that_crosses_a_boundary():
    stream = document_stream([3, 4, 6])  # documents [0, 3), [3, 7), [7, 13)
    it = TokenBatchIterator(stream, seq_len=6, micro_batch=2, seed=0, shuffle=False, packing="document")
    batch = next(it)
    assert isinstance(batch, DocumentBatch)
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]  # window 2 starts mid-document
    tokens = stream.tokens.long()
    assert batch.targets[0].tolist() == [*tokens[1:3].tolist(), IGNORE_INDEX, *tokens[4:7].tolist()]
    assert batch.targets[1].tolist() == [IGNORE_INDEX, *tokens[8:13].tolist()]
    assert (batch.inputs[batch.targets == IGNORE_INDEX] == EOS).all()  # each document's EOS predicts nothing


def _packed_setup(tmp_path, hf_dir, *overrides):
    """The default recipe's compile settings on the tiny HF folder, one process, fp32."""
    resolved = load_config(DEFAULT_CONFIG, [
        "train.device=cpu", f"model.hf={hf_dir}", "train.seq_len=48", "train.micro_batch=2", "train.global_batch=2",
        "train.precision=fp32", "report.progress=none", f"report.runs_dir={tmp_path / 'runs'}", *overrides])
    assert resolved.config.compile.backend == "accelrun"  # the default recipe's compiler
    return build_setup(resolved, tmp_path / "run")


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """kind -> (a tiny transformers folder of that family, its model), made on first use."""
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp("hf") / kind
            made[kind] = (folder, save_tiny_hf(folder, kind))
        return made[kind]

    return get


@pytest.fixture
def hf_llama(hf_folders):
    return hf_folders("llama")


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_packed_losses_equal_transformers_per_document_compiled(tmp_path, hf_folders, kind):
    hf_dir, hf_model = hf_folders(kind)
    s = _packed_setup(tmp_path, hf_dir)
    data = TokenBatchIterator(document_stream(LENGTHS), seq_len=48, micro_batch=2, seed=0, packing="document")
    for _ in range(2):
        inputs_BT, targets_BT, positions_BT = next(data)
        assert max(len(document_pieces(row)) for row in positions_BT) > 2
        # Per-token: the compiled blocks (the training graph: grad enabled) and the output layer, against every
        # document alone in HF.
        logits_BTV = s.model(inputs_BT, positions_BT=positions_BT).detach()
        got_BT = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(), reduction="none").view_as(inputs_BT)
        want_BT = transformers_losses(hf_model, inputs_BT, targets_BT, positions_BT)
        torch.testing.assert_close(got_BT, want_BT, rtol=RTOL, atol=1e-6)
        # The training loss (the compiled loss head): the mean over the targets in the loss.
        kept = targets_BT != IGNORE_INDEX
        loss = s.loss_fn(inputs_BT, targets_BT, positions_BT)
        torch.testing.assert_close(loss.detach(), want_BT[kept].mean(), rtol=RTOL, atol=0)
        loss.backward()  # the backward op runs too (the joint graph holds it)
    record = s.compile_record
    record.refresh_dynamo()
    assert record.dynamo_graphs == 2, record.dynamo_graphs  # the blocks' graph and the loss head's
    assert not record.graph_breaks, record.graph_breaks
    assert not record.fallbacks, record.fallbacks


def test_train_on_text_files_with_document_packing_walks_the_users_path(tmp_path, hf_llama):
    """`accelrun train` on text files (one document each) with data.packing=document and evaluation: the first
    step's loss, and the validation loss (a learning rate too small to move the weights at 1e-5), are
    transformers' means over the same windows, each document alone; compiled, no compiler warning."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli
    from accelrun.data.build import build_data, build_eval_data
    from accelrun.report.metrics import read_metrics

    hf_dir, hf_model = hf_llama
    docs = tmp_path / "docs"
    docs.mkdir()
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(LENGTHS):
        (docs / f"{i:02d}.txt").write_bytes(bytes(torch.randint(97, 123, (n,), generator=g).tolist()))
    overrides = ["train.device=cpu", f"model.hf={hf_dir}", "data.source=text", f"data.paths=[{docs}/*.txt]",
                 "data.packing=document", "train.seq_len=48", "train.micro_batch=2", "train.global_batch=2",
                 "train.precision=fp32", "eval.every=1", "eval.split=0.3", "eval.steps=1", "report.progress=none",
                 f"report.runs_dir={tmp_path / 'runs'}", "checkpoint.resume=none", "train.lr_schedule.warmup_steps=1",
                 "train.optimizer.lr=1e-12"]
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *overrides, "train.steps=2"])
    assert r.exit_code == 0, r.output
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    metrics = read_metrics(run_dir / "metrics.jsonl")

    cfg = load_config(DEFAULT_CONFIG, overrides).config
    batch = next(build_data(cfg.data, seq_len=48, micro_batch=2, seed=cfg.train.seed, vocab_size=cfg.model.vocab_size,
                            eval_cfg=cfg.eval))
    assert isinstance(batch, DocumentBatch) and max(len(document_pieces(row)) for row in batch.positions) > 2
    want_BT = transformers_losses(hf_model, *batch)
    kept = batch.targets != IGNORE_INDEX
    assert metrics[0]["loss"] == pytest.approx(float(want_BT[kept].mean()), rel=RTOL)
    (held_out,) = list(build_eval_data(cfg.data, cfg.eval, seq_len=48, micro_batch=2, seed=cfg.train.seed,
                                       vocab_size=cfg.model.vocab_size))
    assert isinstance(held_out, DocumentBatch)
    want_BT = transformers_losses(hf_model, *held_out)
    assert metrics[0]["val_loss"] == pytest.approx(float(want_BT[held_out.targets != IGNORE_INDEX].mean()), rel=RTOL)
    compiler = __import__("json").loads((run_dir / "report.json").read_text())["compiler"]
    assert compiler["dynamo_graphs"] >= 2 and not compiler["warnings"], compiler


def test_moe_packed_logits_equal_each_document_alone():
    # No transformers folder reads into accelrun's MoE, so the reference is the same model on each document
    # alone (no capacity: which tokens an expert drops would depend on the batch).
    from accelrun.models.families.moe.model import MoE, MoEArgs

    torch.manual_seed(0)
    model = MoE(MoEArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, n_experts=4,
                        experts_per_token=2, moe_ffn_dim=24)).eval()
    model.init_weights(seed=0)
    tokens_BT = torch.randint(0, 64, (2, 24))
    positions_BT = torch.cat([torch.arange(7), torch.arange(12), torch.arange(5)]).repeat(2, 1)
    positions_BT[1] = torch.cat([torch.arange(3), torch.arange(21)])
    with torch.no_grad():
        packed_BTV = model(tokens_BT, positions_BT=positions_BT)
        for b in range(2):
            for start, stop in document_pieces(positions_BT[b]):
                alone_1SV = model(tokens_BT[b : b + 1, start:stop])
                torch.testing.assert_close(packed_BTV[b, start:stop], alone_1SV[0], rtol=1e-5, atol=1e-5)


def test_compile_explain_shows_document_attention_in_the_compiled_graphs(tmp_path, tiny):
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, n in enumerate(LENGTHS[:8]):
        (docs / f"{i}.txt").write_text("ab" * n)
    r = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1), "compile.backend=accelrun",
                                 "train.global_batch=2", "train.micro_batch=2", "data.source=text",
                                 f"data.paths=[{docs}/*.txt]", "data.packing=document"])
    assert r.exit_code == 0, r.output
    assert "2 Dynamo graph(s), 0 graph break(s)" in " ".join(r.output.split())
    (dump,) = (tmp_path / "runs").glob("*/*/compile")
    (forward,), (backward,) = ((dump / f"g0.{part}").glob("*_input.py") for part in ("forward", "backward"))
    assert "accelrun.document_attention.default" in forward.read_text()
    assert "accelrun.document_attention_backward.default" in backward.read_text()


def test_token_files_without_a_document_index_exit_2_before_a_run_directory(tmp_path):
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "a.txt").write_text("one document\n" * 50)
    tok = tmp_path / "a.tok"
    assert CliRunner().invoke(cli, ["data", "prepare", str(tmp_path / "a.txt"), "-o", str(tok)]).exit_code == 0
    recipe = [str(DEFAULT_CONFIG), "train.device=cpu", "data.source=tokens", f"data.paths=[{tok}]",
              "data.packing=document", "train.seq_len=16", "train.micro_batch=1", "train.global_batch=1",
              f"report.runs_dir={tmp_path / 'runs'}"]
    assert CliRunner().invoke(cli, ["validate", *recipe]).exit_code == 0  # prepared with its index
    tok.with_suffix(".docs").unlink()
    want = (f"error: {tok}: no document index (a.docs) beside it, and data.packing = document (override "
            "'data.packing=document') reads one; prepare it again with accelrun data prepare, or use data.packing: concat")
    for command in ("validate", "train"):
        r = CliRunner().invoke(cli, [command, *recipe])
        errors = [line for line in r.output.splitlines() if line.startswith("error")]
        assert r.exit_code == 2 and errors == [want], r.output
    assert not (tmp_path / "runs").exists()
