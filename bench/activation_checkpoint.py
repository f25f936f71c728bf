"""Activation checkpointing none / selective / full on this CPU: one step's memory and the step time, beside
the planner's predicted memory for the same recipe.

The default recipe (configs/llama.yaml: the debug Llama, compiled with accelrun) trains under each mode
in this process. Memory is the CPU allocator's peak during one forward and backward above what was alive
as it began (parameters, gradients, optimizer state): the step's own memory, from the profiler's memory
events (``accelrun.train.step_memory``), not the process's RSS. The planner's figure is its live terms
less those three. Step time is the median of the timed steps (forward, backward, AdamW), the modes taking
turns round by round so that a neighbour's load falls on all of them alike. Expected: selective's memory
between none's and full's, its step time closer to none's (backward reruns 3 of a block's 7 matmuls,
full all of them).

    python bench/activation_checkpoint.py                          # the recipe's batch, 20 timed steps
    python bench/activation_checkpoint.py --steps 3 train.micro_batch=2 train.global_batch=2   # a smoke run
    python bench/activation_checkpoint.py compile.backend=eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.config import load_config  # noqa: E402
from accelrun.plan import predict  # noqa: E402
from accelrun.train.step_memory import measure_step, predicted_step_bytes  # noqa: E402

MODES = ("none", "selective", "full")
# Memory terms only: any cluster will do; this one needs no calibration of the machine.
PLAN_CLUSTER = ["cluster.device=h100-sxm", "cluster.nodes=1", "cluster.devices_per_node=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode, after the warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="times each mode is built, measured and timed, in turn")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every mode (train.micro_batch=4 ...)")
    a = ap.parse_args()
    cfgs = {m: load_config(REPO / "configs" / "llama.yaml", ["train.device=cpu", *PLAN_CLUSTER, *a.overrides,
                                                             f"train.activation_checkpoint.mode={m}"]).config
            for m in MODES}
    memory: dict[str, int] = {}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for mode in MODES:
            torch._dynamo.reset()
            got = measure_step(cfgs[mode], timed_steps=a.steps)
            memory[mode] = got.measured_bytes  # exact (allocations are deterministic): the last round's
            times[mode] += got.step_s
    planned = {m: predicted_step_bytes(predict(cfgs[m])) for m in MODES}
    c = cfgs["none"]
    mib = 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model dim {c.model.dim} x {c.model.n_layers} "
          f"layers, micro-batch {c.train.micro_batch} x {c.train.seq_len} tokens, compile.backend={c.compile.backend}, "
          f"{c.train.precision}")
    print("memory: the CPU allocator's peak during one step above parameters, gradients and optimizer state; "
          "planned: the plan's same terms")
    print(f"{'mode':<10} {'measured':>10} {'x none':>7} {'planned':>10} {'x none':>7} {'plan/meas':>9} "
          f"{'step':>9} {'x none':>7}")
    for m in MODES:
        meas, plan = memory[m] / memory["none"], planned[m] / planned["none"]
        step = statistics.median(times[m]) if times[m] else float("nan")
        none_step = statistics.median(times["none"]) if times["none"] else float("nan")
        print(f"{m:<10} {memory[m] / mib:>6.1f} MiB {meas:>7.2f} {planned[m] / mib:>6.1f} MiB {plan:>7.2f} "
              f"{plan / meas:>9.2f} {step * 1e3:>6.0f} ms {step / none_step:>7.2f}")


if __name__ == "__main__":
    main()
