"""A real job whose ranks the test starts itself, so that each rank can be watched from inside.

The launcher's ranks come from a fork server started once per session (``tests.dist.jobs``); a test
cannot reach into them. Here the test writes the run directory as ``accelrun train`` does
(``config.yaml``, ``env.json``), spawns one process per rank with the variables torchrun's agent
sets, installs a probe in each (``PROBES``), and runs the rank's real entry point,
``accelrun.train.rank.main``: the same setup, loop, collectives and report as a launched job. Each
rank leaves what its probe saw in ``probe-<rank>.json``.

Probes:

- ``collective_device``: the gloo groups declare the ``lazy`` device (torch's lazy-tensor backend,
  which holds real values on this CPU) as the device their collectives take, the way NCCL takes
  CUDA tensors only. Every ``torch.distributed`` collective that accelrun code calls is checked:
  a tensor on another device (a control tensor built on the CPU by default, say) is a violation,
  recorded with its call site. Lazy tensors are then carried over gloo through CPU copies, so the run
  goes on and every site is found in one run. Collectives that torch issues itself (FSDP's, DTensor's,
  the pipeline's sends) are on the training device, which is right, and pass unchecked.
- ``group_timeouts``: the timeout of every process group the rank is in (the world's and the mesh's),
  as setup starts and as the first step starts.
- ``selective_policy``: the keep/recompute decisions of selective activation checkpointing's policy
  (``accelrun.dist.selective_checkpoint``), counted by decision and by pass (forward or backward's rerun).
- ``allocations``: during ``build_setup``, the largest floating-point tensor that any op creates off
  the meta device, the bytes of all the new ones, and the parameters the rank holds at the end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path

from accelrun.config import load_config
from accelrun.report.env import collect_env
from accelrun.report.files import write_json, write_text_atomic
from tests.conftest import DEFAULT_CONFIG
from tests.dist.jobs import tiny_overrides

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single")
# accelrun code that only passes on collectives torch issued (the comm trace re-issues FSDP2's): the
# check goes to whoever called it.
PASS_THROUGH = ("accelrun.dist.comm_overlap",)


def run_ranks(tmp: Path, world: int, steps: int, overrides: list[str], probe: str, timeout_s: float = 300
              ) -> tuple[Path, list[dict]]:
    """Train the tiny recipe with ``overrides`` on ``world`` spawned ranks under ``probe``; returns the run
    directory and each rank's record (``code``: its exit code, and what the probe saw)."""
    resolved = load_config(DEFAULT_CONFIG, tiny_overrides(tmp / "runs", steps, "parallel.timeout_s=120",
                                                          f"parallel.nproc_per_node={world}", *overrides))
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    write_text_atomic(resolved.to_yaml(), run_dir / "config.yaml")
    write_json(collect_env(), run_dir / "env.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=_rank, args=(str(run_dir), rank, world, port, probe)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    records = []
    for rank, p in enumerate(procs):
        path = run_dir / f"probe-{rank}.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        records.append({"exitcode": p.exitcode, **record})
    return run_dir, records


def _rank(run_dir: str, rank: int, world: int, port: int, probe: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    seen: dict = {}
    {"collective_device": _watch_collectives, "allocations": _watch_allocations,
     "group_timeouts": _watch_group_timeouts, "selective_policy": _watch_selective_policy}[probe](seen)
    from accelrun.train.rank import main

    code = main([run_dir])
    write_json({"code": code, **seen}, Path(run_dir) / f"probe-{rank}.json")
    sys.exit(code)


def _watch_collectives(seen: dict) -> None:
    import torch
    import torch._lazy.ts_backend
    import torch.distributed as dist

    from accelrun.dist import collective

    torch._lazy.ts_backend.init()
    collective.BACKEND_DEVICE_TYPE["gloo"] = "lazy"
    seen.update(checked=0, violations=[])

    def tensors_in(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors_in(v)

    def on_cpu(value, moved):
        if isinstance(value, torch.Tensor) and value.device.type == "lazy":
            moved.append((value, value.cpu()))
            return moved[-1][1]
        if isinstance(value, list):
            return [on_cpu(v, moved) for v in value]
        return value

    def guard(name, real):
        def collective_call(*args, **kwargs):
            caller = sys._getframe(1)
            while caller.f_globals.get("__name__") in PASS_THROUGH:
                caller = caller.f_back
            if caller.f_globals.get("__name__", "").startswith("accelrun."):
                seen["checked"] += 1
                for t in tensors_in([*args, *kwargs.values()]):
                    if t.device.type != "lazy":
                        where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                        seen["violations"].append(f"{name} at {where}: a tensor on {t.device}, the group's device "
                                                  "is lazy")
            moved: list = []
            args = [on_cpu(a, moved) for a in args]
            kwargs = {k: on_cpu(v, moved) for k, v in kwargs.items()}
            work = real(*args, **kwargs)
            if moved:
                if work is not None:
                    work.wait()
                for lazy, cpu in moved:
                    lazy.copy_(cpu)
            return work

        return collective_call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, guard(name, getattr(dist, name)))


def _watch_allocations(seen: dict) -> None:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import accelrun.train.run as run

    seen.update(largest_alloc_numel=0, largest_alloc_op="", new_float_bytes=0)

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    def storage(t) -> int | None:
        t = local(t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.untyped_storage().data_ptr()
        return None

    class Allocations(TorchDispatchMode):
        """Floating-point tensors created off the meta device: the largest, and the bytes of every
        output whose storage is none of its inputs' (views and in-place ops create none)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {storage(t) for t in tree_leaves((args, kwargs))}
            for t in tree_leaves(out):
                t = local(t)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                    if t.numel() > seen["largest_alloc_numel"]:
                        seen.update(largest_alloc_numel=t.numel(), largest_alloc_op=str(func))
                    if storage(t) not in inputs:
                        seen["new_float_bytes"] += t.untyped_storage().nbytes()
            return out

    build_setup = run.build_setup

    def watched(*args, **kwargs):
        with Allocations():
            s = build_setup(*args, **kwargs)
        parts = s.pipeline.modules if s.pipeline is not None else [s.model]
        local = {}
        for part in parts:
            for name, p in part.named_parameters():
                t = p._local_tensor if isinstance(p, DTensor) else p
                local[name] = (t.numel(), t.element_size(), str(t.device))
        seen.update(local_params=local)
        return s

    run.build_setup = watched


def _watch_group_timeouts(seen: dict) -> None:
    import torch
    from torch.distributed.distributed_c10d import _world

    import accelrun.train.run as run

    def timeouts() -> list[float]:
        return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in list(_world.pg_map)]

    build_setup, run_loop = run.build_setup, run.run_loop

    def setup(*args, **kwargs):
        seen["setup"] = timeouts()
        return build_setup(*args, **kwargs)

    def loop(*args, **kwargs):
        seen["steps"] = timeouts()
        return run_loop(*args, **kwargs)

    run.build_setup, run.run_loop = setup, loop


def _watch_selective_policy(seen: dict) -> None:
    from accelrun.dist.selective_checkpoint import SelectivePolicy

    decide = SelectivePolicy.__call__

    def counted(self, ctx, func, *args, **kwargs):
        decision = decide(self, ctx, func, *args, **kwargs)
        key = f"{'recompute' if ctx.is_recompute else 'forward'} {decision.name} {func.overloadpacket.__name__}"
        seen[key] = seen.get(key, 0) + 1
        return decision

    SelectivePolicy.__call__ = counted
