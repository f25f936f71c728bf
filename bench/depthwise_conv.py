"""accelrun's depthwise 1-d convolution kernel (compile/fused/depthwise_conv.py) against ATen's
convolution and its backward (oneDNN on a CPU: what eager PyTorch and Inductor both call), forward and
backward (the input's, the weight's and the bias's gradients), on shapes users train.

Both run in one process with ``accelrun train``'s allocator settings, interleaved call by call on the
same inputs; figures are medians, and the ratio of medians (> 1: accelrun faster) with a 95% bootstrap
interval (calls resampled in pairs).

    python bench/depthwise_conv.py
    python bench/depthwise_conv.py --rounds 60 --dtypes fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accelrun.compile.fused.depthwise_conv  # noqa: E402, F401  (registers torch.ops.accelrun.depthwise_conv1d*)
from accelrun.report.stats import bootstrap_ratio_of_medians  # noqa: E402
from accelrun.train.host_malloc import tune_malloc  # noqa: E402

# (name, batch, channels, length, taps, padding)
SHAPES = [
    ("user_models.py's conv mixer", 16, 256, 256, 3, 2),
    ("user_models.py's short convolutions", 16, 512, 256, 4, 3),
    ("Mamba-130m's (d_inner 1536, d_conv 4)", 4, 1536, 1024, 4, 3),
    ("a ConvNeXt-style 1-d mixer", 8, 512, 512, 7, 3),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(B: int, C: int, T: int, K: int, P: int, dtype: torch.dtype, rounds: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((B, C, T), (C, 1, K), (C,)))
    gy = torch.randn(B, C, T + 2 * P - K + 1, generator=gen).to(dtype)
    calls = {
        "aten forward": lambda: torch.ops.aten.convolution(x, w, b, [1], [P], [1], False, [0], C),
        "accelrun forward": lambda: torch.ops.accelrun.depthwise_conv1d(x, w, b, P),
        "aten backward": lambda: torch.ops.aten.convolution_backward(gy, x, w, [C], [1], [P], [1], False, [0], C,
                                                                     [True, True, True]),
        "accelrun backward": lambda: torch.ops.accelrun.depthwise_conv1d_backward(gy, x, w, P, True, True, True),
    }  # fmt: skip
    for fn in calls.values():  # the library built and loaded, each layout met once
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(timed(fn))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    tune_malloc("blocks")
    print(f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds; ms, median")
    print(f"{'shape':58s} {'dtype':5s} {'ATen fwd':>8s} {'ours':>6s} {'x (95%)':>17s} {'ATen bwd':>8s} {'ours':>6s} "
          f"{'x (95%)':>17s}")  # fmt: skip
    for name, B, C, T, K, P in SHAPES:
        for dname in args.dtypes.split(","):
            t = measure(B, C, T, K, P, DTYPES[dname], args.rounds)
            cells = []
            for kind in ("forward", "backward"):
                aten, ours = t[f"aten {kind}"], t[f"accelrun {kind}"]
                ci = bootstrap_ratio_of_medians([[v] for v in aten], [[v] for v in ours], paired=True)
                ratio = statistics.median(aten) / statistics.median(ours)
                cells.append(f"{statistics.median(aten) * 1e3:8.2f} {statistics.median(ours) * 1e3:6.2f} "
                             f"{ratio:5.2f} ({ci.low:4.2f}-{ci.high:4.2f})")  # fmt: skip
            print(f"{f'{name} ({B}, {C}, {T}) K{K}':58s} {dname:5s} {cells[0]} {cells[1]}")


if __name__ == "__main__":
    main()
