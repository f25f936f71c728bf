"""Recipe keys that only a CUDA run can honour (``train.float8``, ``parallel.async_tp``): checked before
anything starts, one line each naming the key, where it was set, why, and what to set instead.

A preflight check (``accelrun.config.preflight``): ``train`` runs it with the machine as torch sees it,
``validate`` with the machine counted without torch. The plan does not run it: planning a GPU cluster
from a laptop is what the planner is for.
"""

from __future__ import annotations

from accelrun.config.compose import Source
from accelrun.config.schema import RunConfig
from accelrun.config.validate import source_of
from accelrun.config.yaml_lines import KeyPath


def _where(path: KeyPath, sources: dict[KeyPath, Source]) -> str:
    src = source_of(path, sources)
    return "" if src.kind == "default" else f" ({src})"


def gpu_only_problems(cfg: RunConfig, sources: dict[KeyPath, Source], on_cuda: bool) -> list[str]:
    """One message per GPU-only key this recipe cannot use (on this machine, when ``on_cuda`` is False)."""
    out: list[str] = []
    t, par = cfg.train, cfg.parallel
    device = f"train.device = {t.device}" + ("" if t.device == "cpu" else ", no CUDA device visible")
    if t.float8 and not on_cuda:
        out.append(f"train.float8 = true{_where(('train', 'float8'), sources)}: float8 linear layers need a CUDA GPU "
                   f"with float8 tensor cores (H100 or newer), and this run trains on the CPU ({device}); "
                   "set train.float8: false")
    if par.async_tp:
        where = _where(("parallel", "async_tp"), sources)
        tp = par.degrees()["tp"]
        if tp <= 1:
            out.append(f"parallel.async_tp = true{where}: overlaps tensor parallelism's collectives, and parallel.tp "
                       f"= {tp}; set parallel.tp: 2 (or more), or parallel.async_tp: false")
        if cfg.compile.backend != "inductor":
            out.append(f"parallel.async_tp = true{where}: the overlap is Inductor's micro-pipeline pass, and "
                       f"compile.backend = {cfg.compile.backend}; set compile.backend: inductor, or "
                       "parallel.async_tp: false")
        if not on_cuda:
            out.append(f"parallel.async_tp = true{where}: needs CUDA GPUs with symmetric memory (NVLink peers), and "
                       f"this run trains on the CPU ({device}); set parallel.async_tp: false")
    return out
