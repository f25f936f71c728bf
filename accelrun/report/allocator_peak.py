"""The most bytes of tensors alive at once while some code runs on the CPU, above what was alive before.

A process's peak RSS cannot be reset and counts Python, torch and the allocator's free lists; this
counts what c10's CPU allocator handed out and took back, from the profiler's memory events (every
tensor allocation and free, compiled code's included, in order): the running sum's maximum is the
allocator's peak over the block. CPU tensors only; the profiler slows the block down, so time it
apart.

    with allocator_peak() as peak:
        loss = model(x).sum(); loss.backward()
    peak.bytes  # most bytes alive at once above the block's start
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class AllocatorPeak:
    bytes: int = 0  # the running sum's maximum over the block (allocations minus frees since it began)
    end: int = 0  # the running sum when the block ended: what it left alive
    events: int = 0  # allocation and free events seen (0 means nothing was measured)


@contextmanager
def allocator_peak() -> Iterator[AllocatorPeak]:
    from torch.profiler import ProfilerActivity, profile

    result = AllocatorPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    running = 0
    for e in sorted(memory, key=lambda e: e.start_ns()):
        running += e.nbytes()
        result.bytes = max(result.bytes, running)
    result.end, result.events = running, len(memory)
