"""Compile one training step of a recipe with accelrun's compiler and time it: `accelrun compile explain`.

One process, the recipe's model, data, precision, activation checkpointing and compile scope; a
parallel layout is not applied (the graphs are one device's, as with ``parallel.*`` degrees of 1),
except ``parallel.fsdp_impl: compiled``, which is applied over a group of one process so that the
graphs hold the parameters' all-gathers and the gradients' reduce-scatters the passes schedule.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from accelrun.compile.compile_model import checkpointed_blocks, compile_model
from accelrun.config import ResolvedConfig
from accelrun.config.preflight import ids_the_logits_cover
from accelrun.data import build_data
from accelrun.dist.activation_checkpoint import apply_activation_checkpointing
from accelrun.dist.layout import decide_cuda_graphs
from accelrun.models import build_model, transformer_blocks
from accelrun.models.build import data_vocab, training_loss_fn
from accelrun.report.machine_load import CpuWindow
from accelrun.train.optim import build_optimizer
from accelrun.train.precision import autocast
from accelrun.train.setup import pick_device, seed_everything


@dataclass
class ExplainedStep:
    record: object  # CompileRecord
    compiled: str  # what was compiled
    first_step_s: float  # includes capture and compilation
    steady_step_s: float  # median of the next few steps
    loss: float
    dump_dir: Path
    others_share: float | None = None  # of the machine's CPU other processes used while it ran (0-1)
    threads: int = 1  # torch's CPU threads the steps ran on


def _compile_sharded_alone(model, blocks, compile_cfg, dump_dir: Path, device: torch.device):
    """Compiled FSDP over a one-process gloo group: the collectives are in the graphs (with one rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from accelrun.dist.compiled_fsdp import compile_sharded
    from accelrun.dist.mesh import MESH_DIMS

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,) * len(MESH_DIMS), mesh_dim_names=MESH_DIMS)
    return compile_sharded(model, blocks, mesh, compile_cfg, dump_dir)


def explain_step(resolved: ResolvedConfig, run_dir: Path, steady_steps: int = 3) -> ExplainedStep:
    cfg = resolved.config
    t = cfg.train
    compile_cfg = cfg.compile.model_copy(update={"backend": "accelrun", "dump": True})
    device = pick_device(t.device)
    _set_threads(t.threads, device)
    seed_everything(t.seed)
    model = build_model(cfg.model, device, seed=t.seed)
    blocks = transformer_blocks(model)
    if t.activation_checkpoint.mode != "none" and (found := checkpointed_blocks(model, blocks)) is not None:
        apply_activation_checkpointing(found, t.activation_checkpoint)  # the blocks training wraps (dist/layout)
    dump_dir = run_dir / "compile"
    sharded = cfg.parallel.fsdp_impl == "compiled"
    if sharded:
        compiled = _compile_sharded_alone(model, blocks, compile_cfg, dump_dir, device)
    else:
        compiled = compile_model(model, blocks, compile_cfg, dump_dir, precision=t.precision)
    # as a training run of one process decides (explain's record said "compile.cuda_graphs = off" under auto)
    decide_cuda_graphs(compiled.record, cfg, device.type, ranks=1, backend="accelrun")
    optimizer = build_optimizer(model, t.optimizer, device, sharded=sharded)
    vocab_size, custom = data_vocab(cfg.model, model)  # as training reads it (train/setup.py)
    data = build_data(cfg.data, seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed,
                      vocab_size=vocab_size, custom=custom)  # fmt: skip
    loss_fn = training_loss_fn(model, ids_the_logits_cover(cfg, vocab_size))

    def step() -> tuple[float, float]:
        # (inputs, targets), and positions under data.packing = document: all go to the model.
        batch_tensors = [x.to(device) for x in next(data)]
        t0 = time.perf_counter()
        with autocast(t.precision, device):
            loss = loss_fn(*batch_tensors)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, float(loss.detach())

    window = CpuWindow()  # a busy neighbour made its timings swing 5x, and it said nothing (a new user)
    first_s, loss = step()
    steady = sorted(step()[0] for _ in range(steady_steps))
    compiled.backend.collect_graph_breaks()
    return ExplainedStep(compiled.record, compiled.description, first_s, steady[len(steady) // 2], loss, dump_dir,
                         window.others_share(), torch.get_num_threads())


def _set_threads(threads: int | None, device: torch.device) -> None:
    """The threads training would take: ``train.threads``, else on a CPU the cores nobody else is using.
    (explain kept torch's default, so its step was 0.5 s where training's was 0.06 on one thread, and
    its busy-machine warning then recommended the very train.threads=1 it ignored.)"""
    from accelrun.train.threads import choose_threads

    if threads is not None:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and os.environ.get("ACCELRUN_FIXED_THREADS") != "1":
        torch.set_num_threads(choose_threads().threads)
