"""accelrun's C++ attention kernel (compile/fused/attention.py) against ATen's CPU flash attention (what
eager PyTorch and Inductor run), forward and forward+backward, on the shapes the benches train.

Both run in one process, interleaved call by call, on the same inputs; figures are medians and the
ratio of medians (> 1: accelrun faster). K/V have the model's key/value heads: ATen gets them repeated
to the query heads (how the models call it), accelrun's kernel takes them as they are.

    python bench/attention_cpu.py
    python bench/attention_cpu.py --rounds 50 --dtypes fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelrun.compile.fused.attention import attention  # noqa: E402

# (name, batch, query heads, key/value heads, sequence, head_dim)
SHAPES = [
    ("debug Llama (configs/llama.yaml)", 16, 6, 2, 256, 32),
    ("torchtitan's debug Llama 3", 8, 16, 16, 2048, 16),
    ("bench/compile_step_hf.py", 4, 4, 2, 256, 64),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(B: int, H: int, G: int, S: int, D: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Median milliseconds of ATen's and accelrun's forward (no grad) and forward+backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=gen).to(dtype).requires_grad_() for h in (H, G, G))
    grad = torch.randn(B, H, S, D, generator=gen).to(dtype)

    def aten(backward: bool) -> None:
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                             is_causal=True)  # fmt: skip
        if backward:
            out.backward(grad)

    def ours(backward: bool) -> None:
        out = attention(q, k, v, D**-0.5, True)
        if backward:
            out.backward(grad)

    variants = {"aten_f": (aten, False), "ours_f": (ours, False), "aten_fb": (aten, True), "ours_fb": (ours, True)}
    times: dict[str, list[float]] = {key: [] for key in variants}
    for r in range(rounds + 2):
        for key, (fn, backward) in variants.items():
            with torch.set_grad_enabled(backward):
                dt = timed(lambda: fn(backward))  # noqa: B023 (called at once)
            if r >= 2:  # the first two rounds warm caches (and build the kernel)
                times[key].append(dt)
    return {key: statistics.median(ts) * 1000 for key, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; causal attention, medians of {args.rounds}")
    print(f"{'shape':36s} {'dtype':5s} {'ATen fwd':>9s} {'ours fwd':>9s} {'ratio':>6s} "
          f"{'ATen f+b':>9s} {'ours f+b':>9s} {'ratio':>6s}")  # fmt: skip
    for name, B, H, G, S, D in SHAPES:
        for dname in args.dtypes.split(","):
            med = measure(B, H, G, S, D, DTYPES[dname], args.rounds)
            print(f"{name:36s} {dname:5s} {med['aten_f']:7.2f}ms {med['ours_f']:7.2f}ms {med['aten_f'] / med['ours_f']:5.2f}x "
                  f"{med['aten_fb']:7.2f}ms {med['ours_fb']:7.2f}ms {med['aten_fb'] / med['ours_fb']:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
