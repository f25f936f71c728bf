"""Per-region benchmark on this CPU: eager PyTorch vs Inductor (torch.compile) vs accelrun's cpp generator.

Each case is one fusion region of a Llama training step at the debug recipe's shapes (batch 16 x
seq 256, dim 192, ffn 512, 6 heads of 32, vocab 512; see recipes/model/debug.yaml). The three
competitors run the same function, interleaved round-robin step by step so that machine noise hits
them alike; the table shows medians and ratios (> 1 means accelrun is faster).

    python bench/regions.py [--steps 50] [--cases rmsnorm_fwd,softmax]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.executors.cpp import CppExecutor
from accelrun.compile.regions import Region

B, T, D, FFN, H, E, V = 16, 256, 192, 512, 6, 32, 512
KV = 2  # key/value heads (grouped-query attention: each serves H // KV query heads)
EPS = 1e-5


def rmsnorm_fwd(x, w):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return (x32 * rstd).type_as(x) * w, rstd


def rmsnorm_bwd(g, x, w, rstd):
    xhat = x * rstd
    grad_w = (g * xhat).sum((0, 1))
    gxhat = g * w
    grad_x = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return grad_x, grad_w


def swiglu(a, b):
    return (torch.nn.functional.silu(a) * b,)


def rope(x, cos, sin):
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return (torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x),)


def rope_backward(g, cos, sin):
    """RoPE's backward: the rotation by -angle."""
    g0, g1 = g.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((g0 * c + g1 * s, g1 * c - g0 * s), dim=-1).flatten(-2)


def qkv_grad(gq, gk, gv, cos, sin):
    """The gradient of the merged q/k/v projection's output from attention's three gradients: the
    repeated key/value heads summed back, RoPE's backward on q and k, and q | k | v side by side."""
    def unrepeat(g):
        return g.unflatten(1, (KV, H // KV)).sum(2).transpose(1, 2)

    gq = rope_backward(gq.transpose(1, 2), cos, sin)
    gk = rope_backward(unrepeat(gk), cos, sin)
    return (torch.cat([gq.flatten(2), gk.flatten(2), unrepeat(gv).flatten(2)], -1),)


def residual_add_norm(x, h, w):
    y = x + h
    return y, rmsnorm_fwd(y, w)[0]


def softmax(x):
    return (torch.softmax(x, -1),)


def cross_entropy(logits, target, ids):
    """Mean loss and its gradient, with the one-hot mask from class ids (arange comes from outside)."""
    m = logits.amax(-1, keepdim=True)
    shifted = logits - m
    total = shifted.exp().sum(-1, keepdim=True)
    onehot = ids == target[:, None]
    picked = torch.where(onehot, shifted, 0.0).sum(-1, keepdim=True)
    loss = (total.log() - picked).mean()
    grad = (shifted.exp() / total - onehot.float()) / logits.shape[0]
    return loss, grad


def adamw(p, g, m, v):
    lr, b1, b2, eps, wd, step = 1e-3, 0.9, 0.95, 1e-8, 0.1, 10
    m2 = m + (1 - b1) * (g - m)
    v2 = v * b2 + (1 - b2) * g * g
    update = (m2 / (1 - b1**step)) / ((v2 / (1 - b2**step)).sqrt() + eps)
    return p * (1 - lr * wd) - lr * update, m2, v2


def gelu(x):
    return (torch.nn.functional.gelu(x),)


def gelu_tanh(x):
    return (torch.nn.functional.gelu(x, approximate="tanh"),)


def gelu_backward(g, x):
    """nn.GELU's backward (erf), as a model of torch.nn blocks runs it; ``gelu_tanh_backward``: GPT-2's
    and Gemma's tanh approximation."""
    return (torch.ops.aten.gelu_backward(g, x),)


def gelu_tanh_backward(g, x):
    return (torch.ops.aten.gelu_backward(g, x, approximate="tanh"),)


def cases() -> dict[str, tuple[Callable, tuple[torch.Tensor, ...]]]:
    x = torch.randn(B, T, D)
    w = torch.randn(D)
    angle = torch.rand(T, E // 2)
    n_params = 1_771_200  # the debug Llama's parameters, as one flat buffer (a multi-tensor update)
    return {
        "rmsnorm_fwd": (rmsnorm_fwd, (x, w)),
        "rmsnorm_bwd": (rmsnorm_bwd, (torch.randn(B, T, D), x, w, rmsnorm_fwd(x, w)[1])),
        "swiglu": (swiglu, (torch.randn(B, T, FFN), torch.randn(B, T, FFN))),
        "rope": (rope, (torch.randn(B, T, H, E), angle.cos(), angle.sin())),
        "residual_add_norm": (residual_add_norm, (x, torch.randn(B, T, D), w)),
        # attention's gradients as SDPA's backward lays them out: (B, H, T, E) views of (B, T, H, E)
        "qkv_grad": (qkv_grad, tuple(torch.randn(B, T, H, E).transpose(1, 2) for _ in range(3))
                     + (angle.cos(), angle.sin())),
        "softmax": (softmax, (torch.randn(B * T, V),)),
        "cross_entropy": (cross_entropy, (torch.randn(B * T, V), torch.randint(0, V, (B * T,)), torch.arange(V))),
        # an nn.GELU MLP's hidden activation (B * T rows of 4 x dim 160)
        "gelu": (gelu, (torch.randn(B * T, 640),)),
        "gelu_tanh": (gelu_tanh, (torch.randn(B * T, 640),)),
        "gelu_bwd": (gelu_backward, (torch.randn(B * T, 640), torch.randn(B * T, 640))),
        "gelu_tanh_bwd": (gelu_tanh_backward, (torch.randn(B * T, 640), torch.randn(B * T, 640))),
        "adamw": (adamw, tuple(torch.randn(n_params) for _ in range(3)) + (torch.rand(n_params),)),
    }


def accelrun_cpp(fn: Callable, args: tuple[torch.Tensor, ...], cache_dir: str) -> Callable:
    gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*args)
    ins = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    outs = [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0]]
    region = Region(0, gm, ins, outs)
    executor = CppExecutor()
    reason = executor.unavailable_reason() or executor.decline_reason(region)
    if reason:
        raise SystemExit(f"cpp declined {fn.__name__}: {reason}")
    compiled = executor.compile(region, cache_dir)
    return lambda *a: compiled(*a)


def check(name: str, want: tuple, got: tuple) -> None:
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cases", default="", help="comma-separated subset")
    args = parser.parse_args()
    chosen = {k: v for k, v in cases().items() if not args.cases or k in args.cases.split(",")}
    cache_dir = tempfile.mkdtemp(prefix="accelrun-bench-")
    rows = []
    for name, (fn, inputs) in chosen.items():
        competitors = {
            "eager": fn,
            "inductor": torch.compile(fn, fullgraph=True),
            "accelrun": accelrun_cpp(fn, inputs, cache_dir),
        }
        want = fn(*inputs)
        for label, f in competitors.items():
            out = f(*inputs)
            check(f"{name}/{label}", want if isinstance(want, tuple) else (want,),
                  out if isinstance(out, tuple) else (out,))
            for _ in range(3):
                f(*inputs)
        times: dict[str, list[float]] = {k: [] for k in competitors}
        for _ in range(args.steps):  # round-robin: every competitor once per step
            for label, f in competitors.items():
                t0 = time.perf_counter()
                f(*inputs)
                times[label].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append((name, med["eager"], med["inductor"], med["accelrun"]))
        print(f"{name}: done", flush=True)
    print(f"\n{torch.get_num_threads()} threads, {args.steps} interleaved steps, median ms")
    print(f"{'region':<20}{'eager':>9}{'inductor':>10}{'accelrun':>10}{'vs eager':>10}{'vs inductor':>13}")
    for name, e, i, a in rows:
        print(f"{name:<20}{e:>9.3f}{i:>10.3f}{a:>10.3f}{e / a:>9.2f}x{i / a:>12.2f}x")


if __name__ == "__main__":
    main()
