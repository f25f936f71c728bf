"""What a rank of a multi-process job needs before it trains: joining the process group (``init_rank``),
its mesh and device, its threads, and the machine facts the launcher's preflight reads.

The rank's entry point (``accelrun.train.rank.run_rank``) is started by the elastic agent
(``accelrun.dist.launch``), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from accelrun.config import ConfigError
from accelrun.config.preflight import Machine, processes_fit, rank_threads
from accelrun.dist.collective import set_group_timeouts
from accelrun.dist.context import ParallelContext, env_rank
from accelrun.dist.mesh import build_mesh, dp_coordinates
from accelrun.torch_private import cpu_has_half_gemm


def machine_as_torch_sees_it() -> Machine:
    """This node's cores and the CUDA devices torch can use: the facts the preflight checks read."""
    return Machine(cores=os.cpu_count() or 1, cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                   cpu_bf16_gemm=cpu_has_half_gemm(torch.bfloat16))


def rank_uses_cuda(cfg) -> bool:
    return torch.cuda.is_available() and cfg.train.device in ("auto", "cuda")


def cpu_rank_threads(nproc_per_node: int) -> int:
    return rank_threads(os.cpu_count() or 1, nproc_per_node)


def check_devices(cfg) -> None:
    """A job of CUDA ranks needs one GPU per process on every node: say so before anything starts."""
    fatal = [f.message for f in processes_fit(cfg, {}, machine_as_torch_sees_it()) if f.fatal]
    if fatal:
        raise ConfigError(fatal)


# NCCL settings a CUDA rank starts with unless the environment sets them: the flight recorder (the last
# collectives of every rank) on, dumped into the run directory when the watchdog sees a timeout, so a
# hung job leaves what each rank was waiting for. The watchdog's handling stays torch's default
# (tear the process down: a rank stuck in a collective cannot be trusted to go on); the agent's failure
# summary then shows the watchdog's message. TORCH_NCCL_BLOCKING_WAIT=1, set by the user, makes the
# timeout an exception in the training thread instead (the loop reports step and phase), at the cost
# of a host-blocking wait on every collective.
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def nccl_environment(run_dir: Path | None) -> dict[str, str]:
    """The NCCL variables a CUDA rank sets for itself (those the environment does not set already)."""
    env = dict(NCCL_FLIGHT_RECORDER)
    if run_dir is not None:  # torch appends the rank to this prefix
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(run_dir / "nccl_flight_recorder" / "rank_")
    return {k: v for k, v in env.items() if k not in os.environ}


def init_rank(resolved, run_dir: Path | None = None) -> ParallelContext:
    cfg = resolved.config
    rank, world, local_rank = env_rank()
    use_cuda = rank_uses_cuda(cfg)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()} "
                              f"CUDA device(s) and parallel.nproc_per_node = {cfg.parallel.nproc_per_node}")
        torch.cuda.set_device(device)
        nccl = nccl_environment(run_dir)
        if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in nccl:
            Path(nccl["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(nccl)  # read when the NCCL process group is created, below
    # GPU ranks too: their host threads (data, the optimizer's CPU work, Python) share the node's cores. A
    # recipe's train.threads is each rank's (set in the launcher only, forked ranks kept torch's default:
    # 2 ranks of `train.threads=1` ran 2 threads each on 2 cores, and env.json said 1; a trial's).
    torch.set_num_threads(cfg.train.threads if cfg.train.threads is not None
                          else cpu_rank_threads(cfg.parallel.nproc_per_node))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # Joining and setting up (rendezvous, building, loading, resuming) may take long on a big job; the
    # training steps' collectives get parallel.timeout_s once setup is done (train.run).
    timeout = timedelta(seconds=cfg.parallel.init_timeout_s)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=_store(rank, world, restarts, timeout),
                            rank=rank, world_size=world, timeout=timeout)
    mesh = build_mesh(cfg.parallel, device.type, world)
    set_group_timeouts(timeout)  # the mesh's own groups start with the backend's default
    dp_rank, dp_size = dp_coordinates(mesh)
    return ParallelContext(rank, world, local_rank, device, mesh, dp_rank, dp_size, tp_size=mesh["tp"].size(),
                           pp_size=mesh["pp"].size(), restart_count=restarts, cp_size=mesh["cp"].size())


def _store(rank: int, world: int, restarts: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this restart of the group.

    After the agent restarts the group, the store still holds the previous group's keys (among
    them each rank's gloo address); a new rank that read those would connect to a dead peer.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
    return dist.PrefixStore(f"accelrun/restart{restarts}", store)
