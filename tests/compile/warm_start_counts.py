"""Run by test_warm_start.py in a fresh process each time: one training step of the tiny Llama through
accelrun's Triton executor (Triton's interpreter), the graph cache and launch tuning (a fake H100 and a
fake timer standing in for CUDA events). Prints, as JSON, what this process lowered and tuned."""

from __future__ import annotations

import json
import sys

from accelrun.compile import backend as backend_module
from accelrun.compile import lower
from accelrun.compile.codegen import launch_tuning
from accelrun.compile.executors.triton import TritonExecutor

counts = {"lower_regions": 0, "triton_compiles": 0, "tune": 0, "timers": 0, "timed": 0, "cache_hits": 0}


def counted(name, fn):
    def run(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return run


def fake_timer(module, buffers, slots, program, repeats=10):
    counts["timers"] += 1

    def time_launch(launch):
        counts["timed"] += 1
        return 1.0 + launch.num_warps * 0.1  # fewer warps are faster: not the defaults

    return time_launch


launch_tuning.can_time = lambda: True
launch_tuning.current_device_key = lambda: launch_tuning.DeviceKey("fake H100", (9, 0), "test")
launch_tuning.CudaEventTimer = fake_timer
launch_tuning.tune = counted("tune", launch_tuning.tune)
backend_module.lower_regions = counted("lower_regions", backend_module.lower_regions)
lower.lower_regions = counted("lower_regions", lower.lower_regions)  # what a graph loaded unlowered calls
TritonExecutor.compile = counted("triton_compiles", TritonExecutor.compile)
read = launch_tuning.TuningCache.read


def counting_read(self, device):
    found = read(self, device)
    counts["cache_hits"] += found is not None
    return found


launch_tuning.TuningCache.read = counting_read

from tests.compile.test_graph_cache import step  # noqa: E402  (after the patches)

# 2 x 8 tokens: Triton's interpreter runs the loss head's reductions element by element in Python
# (4 x 32 took a minute a process).
loss, grads, record = step("compile.backend=accelrun", "compile.scope=loss", "compile.executors=[triton,aten]",
                           shape=(2, 8))
json.dump({**counts, "loss": loss.item(), "grad_sum": sum(float(g.double().sum()) for g in grads.values()),
           "graphs_loaded": record.graphs_loaded(), "regions": record.regions_per_executor(),
           # AOTAutograd's partitioner (0.3 s of imports): a process that compiles nothing needs none of it
           "partitioner_imported": "torch._functorch.partitioners" in sys.modules}, sys.stdout)
