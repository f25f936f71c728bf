"""Recipe keys that only a CUDA run can honour (``train.float8``, ``parallel.async_tp``): checked before
anything starts, one line a key naming it, where it was set, why, and what to set instead.

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
        # One line for all it lacks (a trial's CPU run printed three errors for the one key).
        tp = par.degrees()["tp"]
        needs = [need for need, met in (
            (f"parallel.tp of 2 or more (here {tp})", tp > 1),
            (f"compile.backend: inductor, whose micro-pipeline pass it is (here {cfg.compile.backend})",
             cfg.compile.backend == "inductor"),
            (f"CUDA GPUs with symmetric memory, NVLink peers (this run trains on the CPU: {device})", on_cuda),
        ) if not met]  # fmt: skip
        if needs:
            out.append(f"parallel.async_tp = true{_where(('parallel', 'async_tp'), sources)} overlaps tensor "
                       f"parallelism's collectives and needs {'; '.join(needs)}; set parallel.async_tp: false"
                       + ("" if not on_cuda else ", or what it needs"))
    return out
