"""The fallback executor: a region's ATen ops run one by one, as eager PyTorch runs them."""

from __future__ import annotations

from accelrun.compile.executors.base import Executor, RegionFn, register_executor
from accelrun.compile.regions import Region


@register_executor
class AtenExecutor(Executor):
    name = "aten"
    keeps_aten_ops = True

    def decline_reason(self, region: Region) -> str | None:
        return None  # anything the graph holds is an ATen op, so this always works

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        return region.gm
