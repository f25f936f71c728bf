"""The executor interface: who runs each fusion region.

Executors are asked in the recipe's priority order (``compile.executors``). Each either *claims* a
region (returns None from ``decline_reason``) and then compiles it into a callable, or declines with a
reason that ``accelrun compile explain`` shows. ``aten`` never declines: it runs the region's ops one by
one, as eager PyTorch would, so every graph always has an executor.

Code generators (``cpp``, ``triton``) plug in here: subclass ``Executor``, register it, and the
lowering offers them every region.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from accelrun.compile.regions import Region

# A compiled region: takes the region's inputs (tensors, in placeholder order), returns its outputs as
# a tuple in the order of the region's output node.
RegionFn = Callable[..., tuple[torch.Tensor, ...]]


class Executor(ABC):
    name: ClassVar[str]
    # True when compile() spends its time outside the GIL (a compiler subprocess) and is safe to call
    # from several threads: the lowering then compiles this executor's regions concurrently.
    parallel_compile: ClassVar[bool] = False
    # True for the executor that leaves a region's ATen ops in the graph (``aten``): there is nothing to
    # compile, and an error at its first call is the program's, not a compiler's.
    keeps_aten_ops: ClassVar[bool] = False
    # True when compile_batch builds several regions in one go cheaper than one by one (the C++
    # executor: one g++ run, one translation unit, one link for all of a graph's regions).
    batch_compile: ClassVar[bool] = False

    def unavailable_reason(self) -> str | None:
        """Why this executor cannot run at all on this machine (no compiler, no GPU), or None."""
        return None

    @abstractmethod
    def decline_reason(self, region: Region) -> str | None:
        """None to claim the region; otherwise one short reason ("op aten.mm is not pointwise")."""

    @abstractmethod
    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        """Compile a claimed region. May raise; the lowering then records the error as a decline."""

    def compile_batch(self, regions: list[Region], cache_dir: str | None) -> list[RegionFn]:
        """Compile several claimed regions at once (``batch_compile``), one callable each in order. May
        raise; the lowering then compiles them one by one, so one bad region costs only itself."""
        return [self.compile(r, cache_dir) for r in regions]

    def build_ahead(self, regions: list[Region], cache_dir: str | None) -> None:
        """Called with every region this executor claimed in a graph, before the lowering compiles them
        one by one (executors without ``parallel_compile``): a head start on their builds, side by side
        (Triton's kernels), which each ``compile`` then finds done. May raise; nothing depends on it."""
        return None  # most executors have nothing to start early

    def saved_forms(self, regions: list[Region], cache_dir: str | None) -> list[tuple | None] | None:
        """What each region of ``compile_batch(regions)`` will pickle as (its ``__reduce__``), known
        before the build has run: the graph cache then saves a graph whose builds are still running.
        None (for all, or for one region): not known in advance (pickling such a region waits for its
        build). A batch that then fails leaves a saved graph naming a library that never came: loading
        it fails, and the graph is compiled afresh, as for a library gone from the cache."""
        return None


_EXECUTORS: dict[str, type[Executor]] = {}


def register_executor(cls: type[Executor]) -> type[Executor]:
    _EXECUTORS[cls.name] = cls
    return cls


def registered_executors() -> dict[str, type[Executor]]:
    import accelrun.compile.executors  # noqa: F401  (registers the built-ins)

    return dict(_EXECUTORS)
