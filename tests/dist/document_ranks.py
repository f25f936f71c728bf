"""Ranks that check document packing from inside: each builds the run's real setup (its layout: FSDP or TP,
compiled by accelrun's backend), reads its share of packed windows, and compares every token's loss with
transformers' ``LlamaForCausalLM`` run on that document alone. Each rank writes ``rank-<r>.json``."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS = 2


def run_ranks(tmp: Path, hf_dir: Path, overrides: list[str], lengths: list[int], world: int = 2,
              timeout_s: float = 300) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = multiprocessing.get_context("spawn")
    args = (str(tmp), str(hf_dir), overrides, lengths, world, port)
    procs = [mp.Process(target=_rank, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    records = []
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
        path = tmp / f"rank-{rank}.json"
        records.append({"exitcode": p.exitcode, **(json.loads(path.read_text()) if path.exists() else {})})
    return records


def _rank(rank: int, tmp: str, hf_dir: str, overrides: list[str], lengths: list[int], world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), ACCELRUN_CACHE_DIR=str(Path(tmp) / f"cache{rank}"),
                      ACCELRUN_NO_PEAK_PROBE="1", ACCELRUN_FIXED_THREADS="1")
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformers

    from accelrun.config import load_config
    from accelrun.data.document_packing import IGNORE_INDEX
    from accelrun.data.loader import TokenBatchIterator
    from accelrun.dist.worker import init_rank
    from accelrun.train.setup import build_setup
    from tests.conftest import DEFAULT_CONFIG
    from tests.train.document_parity import document_stream, transformers_losses

    resolved = load_config(DEFAULT_CONFIG, [
        "train.device=cpu", f"model.hf={hf_dir}", "train.seq_len=48", "train.precision=fp32", "report.progress=none",
        f"parallel.nproc_per_node={world}", "parallel.timeout_s=120", f"report.runs_dir={tmp}/runs", *overrides])
    ctx = init_rank(resolved)
    s = build_setup(resolved, Path(tmp) / "run", ctx)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    data = TokenBatchIterator(document_stream(lengths), seq_len=48, micro_batch=resolved.config.train.micro_batch,
                              seed=0, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, packing="document")
    worst, losses = 0.0, []
    for _ in range(STEPS):
        inputs_BT, targets_BT, positions_BT = next(data)
        if s.pipeline is not None:  # only the mean loss leaves the schedule: one micro-batch per row
            want_BT = transformers_losses(hf_model, inputs_BT, targets_BT, positions_BT)
            kept_BT = targets_BT != IGNORE_INDEX
            want = torch.stack([row[keep].mean() for row, keep in zip(want_BT, kept_BT, strict=True)]).mean()
            losses.append((float(s.pipeline.step(inputs_BT, targets_BT, positions_BT)), float(want)))
            continue
        logits_BTV = s.model(inputs_BT, positions_BT=positions_BT)
        if hasattr(logits_BTV, "full_tensor"):  # a DTensor (TP's output layer)
            logits_BTV = logits_BTV.full_tensor()
        got_BT = F.cross_entropy(logits_BTV.detach().flatten(0, 1), targets_BT.flatten(),
                                 reduction="none").view_as(inputs_BT)
        want_BT = transformers_losses(hf_model, inputs_BT, targets_BT, positions_BT)
        worst = max(worst, ((got_BT - want_BT).abs() / want_BT.abs().clamp_min(1e-6)).max().item())
        with s.loss_context():
            loss = s.loss_fn(inputs_BT, targets_BT, positions_BT)
            loss.backward()
        kept = targets_BT != IGNORE_INDEX
        losses.append((float(loss.detach()), float(want_BT[kept].mean())))
    out = {"worst_rel": worst, "losses": losses, "dp_size": ctx.dp_size, "tp_size": ctx.tp_size,
           "pp_size": ctx.pp_size}
    record = s.compile_record  # None when compile.backend = eager
    if record is not None:
        record.refresh_dynamo()
        out.update(dynamo_graphs=record.dynamo_graphs, graph_breaks=record.graph_breaks,
                   fallbacks=[f.line() for f in record.fallbacks])
    (Path(tmp) / f"rank-{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()
