"""Python's cyclic garbage collector paused while accelrun compiles or loads a graph.

A collection of the oldest generation walks every object the process holds, and a training process
holds millions (torch's and transformers' modules, the model). Compiling and loading allocate enough
to trigger several such walks: in a new process loading transformers' Llama from the graph cache,
they took 0.28 of the 0.37 s the load took (torch deep-copies the loaded entry); in a cold compile of
it, about 0.45 of 3.5 s. What a compile leaves behind in cycles is collected after it, as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside; nests, and leaves the collector as it found it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
