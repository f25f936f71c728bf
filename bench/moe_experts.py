"""Mixture-of-experts speed: the grouped expert path against a loop over experts, and a 2-rank MoE
training step with expert parallelism (ep = 2) against experts replicated (ep = 1, FSDP over 2 ranks).

1. Experts alone, one process: forward + backward of one MoE layer's experts on routed tokens.
   Variants: ``loop`` (a Python loop over experts, each gathering its tokens by a boolean mask: the
   naive way), ``split_mm`` (the CPU default: each expert's rows split off by count), ``padded_bmm``
   and ``grouped_mm`` (accelrun.models.families.moe.experts.grouped_swiglu). Interleaved round-robin;
   medians and ratios of medians against the loop. ``--skew`` loads the experts unevenly, as a
   trained router does (the debug MoE's first steps: the busiest expert 2-3x the mean).
2. Training steps, 2 ranks on this machine (gloo): ``accelrun train configs/moe.yaml`` with
   ep = 2 and with ep = 1, alternated; median steady step time from each run's report.json.

    python bench/moe_experts.py                        # both parts
    python bench/moe_experts.py --part experts --tokens 8192 --dim 512 --ffn 1024 --experts 16
    python bench/moe_experts.py --part experts --skew 2.5     # uneven experts
    python bench/moe_experts.py --part ep --steps 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.models.families.moe.experts import grouped_swiglu, route  # noqa: E402


def loop_over_experts(x_ND, top_x_NK, gates_NK, w1, w3, w2):
    """The naive layer: each expert picks its tokens by a mask, computes, scatters back."""
    y = torch.zeros_like(x_ND)
    for e in range(w1.shape[0]):
        tok, slot = (top_x_NK == e).nonzero(as_tuple=True)
        h = F.silu(x_ND[tok] @ w1[e]) * (x_ND[tok] @ w3[e])
        y = y.index_add(0, tok, (h @ w2[e]) * gates_NK[tok, slot, None])
    return y


def grouped(impl):
    def run(x_ND, logits_NX, k, w1, w3, w2):
        r = route(logits_NX, 1, x_ND.shape[0], k, None)
        out = grouped_swiglu(x_ND[r.token_A], r.counts_X, w1, w3, w2, impl=impl)
        return torch.zeros_like(x_ND).index_add(0, r.token_A, out * r.gate_A[:, None])
    return run


def bench_experts(a) -> None:
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.dim, requires_grad=True)
    # Expert e's logits shifted by skew * (its place in [-1, 1]): the last experts take more tokens.
    logits = torch.randn(a.tokens, a.experts) + a.skew * torch.linspace(-1, 1, a.experts)
    ws = [(torch.randn(a.experts, a.dim, a.ffn) * 0.02).requires_grad_(),
          (torch.randn(a.experts, a.dim, a.ffn) * 0.02).requires_grad_(),
          (torch.randn(a.experts, a.ffn, a.dim) * 0.02).requires_grad_()]
    probs = logits.softmax(-1)
    top_p, top_x = probs.topk(a.k, -1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    variants = {
        "loop": lambda: loop_over_experts(x, top_x, gates, *ws),
        "split_mm": lambda: grouped("split_mm")(x, logits, a.k, *ws),
        "padded_bmm": lambda: grouped("padded_bmm")(x, logits, a.k, *ws),
        "grouped_mm": lambda: grouped("grouped_mm")(x, logits, a.k, *ws),
    }
    with torch.no_grad():  # same numbers first (fp32)
        ref = variants["loop"]()
        for name, f in variants.items():
            err = float((f() - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, (name, err)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(a.warmup + a.reps):
        for name, f in variants.items():
            t = time.perf_counter()
            f().square().sum().backward()
            times[name].append(time.perf_counter() - t)
            for w in (x, *ws):
                w.grad = None
    med = {n: statistics.median(v[a.warmup:]) for n, v in times.items()}
    load = F.one_hot(top_x, a.experts).sum((0, 1)).float()
    print(f"\nexperts, forward + backward: {a.tokens} tokens × top-{a.k} of {a.experts} experts, dim {a.dim}, "
          f"expert width {a.ffn}, fp32, {torch.get_num_threads()} threads, median of {a.reps} (interleaved); "
          f"busiest expert {float(load.max() / load.mean()):.2f}x the mean (--skew {a.skew})")
    print(f"{'variant':<12} {'ms':>9} {'vs loop':>8}")
    for n in variants:
        print(f"{n:<12} {med[n] * 1e3:>9.1f} {med['loop'] / med[n]:>7.2f}×")


def bench_ep(a) -> None:
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    common = ["configs/moe.yaml", "parallel.nproc_per_node=2", f"train.steps={a.steps}", "checkpoint.enabled=false",
              "report.progress=none", "report.warmup_steps=3", *a.override]
    medians: dict[str, list[float]] = {"ep=2": [], "ep=1 (replicated, FSDP)": []}
    with tempfile.TemporaryDirectory() as runs:
        for r in range(a.rounds):
            for name, ep in (("ep=2", 2), ("ep=1 (replicated, FSDP)", 1)):
                cmd = [sys.executable, "-m", "accelrun.cli.main", "train", *common, f"parallel.ep={ep}",
                       f"report.runs_dir={runs}", f"name=ep{ep}-r{r}"]
                subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
                (run_dir,) = (Path(runs) / f"ep{ep}-r{r}").iterdir()
                report = json.loads((run_dir / "report.json").read_text())
                medians[name].append(report["step_time_s"]["median"])
    print(f"\nMoE training step (configs/moe.yaml, 2 ranks, gloo), {a.steps} steps per run, {a.rounds} runs each "
          f"(alternated); median steady step time per run")
    base = statistics.median(medians["ep=1 (replicated, FSDP)"])
    print(f"{'layout':<26} {'step ms (runs)':<28} {'median ms':>10} {'vs ep=1':>8}")
    for name, v in medians.items():
        m = statistics.median(v)
        runs_ms = ", ".join(f"{t * 1e3:.0f}" for t in v)
        print(f"{name:<26} {runs_ms:<28} {m * 1e3:>10.0f} {base / m:>7.2f}×")
    print("command: accelrun train " + " ".join(common) + " parallel.ep=2 (and parallel.ep=1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["experts", "ep", "all"], default="all")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--skew", type=float, default=0.0, help="uneven experts: 2.5 makes the busiest ~2.5x the mean")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("override", nargs="*", help="key=value overrides for the training runs (part ep)")
    a = p.parse_args()
    if a.part in ("experts", "all"):
        bench_experts(a)
    if a.part in ("ep", "all"):
        bench_ep(a)


if __name__ == "__main__":
    main()
