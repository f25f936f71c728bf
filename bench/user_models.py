"""Models written the way users write them (tests/compile/user_models.py), trained eager, through
Inductor and through accelrun as ``accelrun train model.custom=...`` compiles them: a training step
(forward, backward, AdamW) per variant in interleaved rounds, median step times, and each compiler's
ratio to eager and to Inductor with a paired 95% bootstrap interval; the cold first step too.

``nanogpt`` is nanoGPT's model as its README trains it (dropout 0.1); ``nanogpt-p0`` the same without
dropout, which separates what drawing dropout's masks in kernels (the cpu_dropout pass) gives from
the rest; ``nanogpt-tril`` that one with its causal mask written as users often do, a (T, T)
``tril`` mask given to SDPA (ATen's attention until 2026-12-07, the C++ kernel since). ``moe`` is a top-1 mixture of experts routed by boolean masks (``x[mask]``), whose experts
see a different number of tokens on every call; ``moe-indexed`` the same routed by indices
(``torch.where``, ``index_add``), traced whole. The rest are the test suite's models at dim 256:
``mha`` (``nn.MultiheadAttention`` under a float causal mask, no list of the model's own blocks),
``encoder`` / ``encoder-causal`` (torch.nn's ``TransformerEncoder`` given a causal mask without and
with ``is_causal=True``: the first reads the mask on the host every call, a graph break),
``conv-mixer`` (depthwise and pointwise ``Conv1d`` with ``GroupNorm``), ``short-conv`` (gated short
causal convolutions, kernel 4, as Mamba writes its mixer's, without the scan), ``plain-mlp`` (no list at
all), ``gru`` and ``lstm`` (torch.nn's recurrent modules, which run eagerly at a graph break). Each model runs in a process of its own (compiler
caches empty, in a temporary directory), every variant with the host allocator ``accelrun train``
sets on a CPU (``train.cpu_malloc`` blocks; until 2026-12-05 afternoon glibc's, ``--malloc system``,
which the nanoGPT figures of that morning used).

    python bench/user_models.py                                   # every model
    python bench/user_models.py --models moe,moe-indexed --rounds 30
    python bench/user_models.py --models conv-mixer --variants eager,accelrun --regions   # C++ regions vs ATen
    python bench/user_models.py --models nanogpt --rounds 30 --batch 16 --seq 256
    python bench/user_models.py --models nanogpt-p0 --lengths 96,128,160,192,224,256   # lengths change
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.compile.compile_model import compile_model  # noqa: E402
from accelrun.config.schema import CompileConfig, CpuMalloc, OptimizerConfig  # noqa: E402
from accelrun.models.build import training_loss_fn, transformer_blocks  # noqa: E402
from accelrun.report.stats import bootstrap_ratio_of_medians  # noqa: E402
from accelrun.train.host_malloc import malloc_record, tune_malloc  # noqa: E402
from accelrun.train.optim import build_optimizer  # noqa: E402
from bench.rounds import interleaved_rounds, per_length_ratio, rounds_for_cycles, samples_and_step  # noqa: E402
from tests.compile.user_models import (  # noqa: E402
    GRULM,
    ConvMixer,
    EncoderLM,
    IndexedMoE,
    LSTMStack,
    MHAModel,
    NanoGPT,
    PlainMLP,
    RoutedMoE,
    ShortConvLM,
)

VOCAB = 320  # nanoGPT's character-level Shakespeare has 65; a byte-level corpus a few hundred
MODELS = {
    "nanogpt": lambda: NanoGPT(vocab=VOCAB, dim=128, layers=3, heads=4, dropout=0.1),
    "nanogpt-p0": lambda: NanoGPT(vocab=VOCAB, dim=128, layers=3, heads=4, dropout=0.0),
    "nanogpt-tril": lambda: NanoGPT(vocab=VOCAB, dim=128, layers=3, heads=4, dropout=0.0, tril_mask=True),
    "moe": lambda: RoutedMoE(n_experts=4, vocab=VOCAB, dim=256),
    "moe-indexed": lambda: IndexedMoE(n_experts=4, vocab=VOCAB, dim=256),
    "mha": lambda: MHAModel(n_layers=4, vocab=VOCAB, dim=256),
    "encoder": lambda: EncoderLM(n_layers=4, vocab=VOCAB, dim=256),
    "encoder-causal": lambda: EncoderLM(n_layers=4, vocab=VOCAB, dim=256, causal_hint=True),
    "conv-mixer": lambda: ConvMixer(depth=4, vocab=VOCAB, dim=256),
    "short-conv": lambda: ShortConvLM(n_layers=4, vocab=VOCAB, dim=256),
    "plain-mlp": lambda: PlainMLP(vocab=VOCAB, dim=256),
    "gru": lambda: GRULM(vocab=VOCAB, dim=256),
    "lstm": lambda: LSTMStack(n_layers=2, vocab=VOCAB, dim=256),
}
VARIANTS = ("eager", "inductor", "accelrun")
# Variants a model cannot run under this torch, and why: a crash would take the model's other
# variants with it (they share a process so that their rounds interleave).
CRASHES = {("conv-mixer", "inductor", "2.13."): "torch 2.13's Inductor corrupts the heap in this model's backward "
                                                 "(glibc aborts the process; pytorch/pytorch#181618)"}


class Variant:
    def __init__(self, name: str, model: torch.nn.Module) -> None:
        self.name, self.model = name, copy.deepcopy(model)
        self.opt = build_optimizer(self.model, OptimizerConfig(lr=1e-4), torch.device("cpu"), sharded=False)
        self.description, self.record = name, None
        if name != "eager":  # as `accelrun train` compiles a user's model: compile.scope auto
            compiled = compile_model(self.model, transformer_blocks(self.model), CompileConfig(backend=name),
                                     precision="fp32")  # fmt: skip
            self.description = f"{name}: {compiled.description}"
            self.record = compiled.record
        self.fn = training_loss_fn(self.model)
        self.times: list[float] = []
        self.first = 0.0

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.fn(*batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


class RegionTimes:
    """``--regions``: each C++ region of accelrun's graphs against the region's own ATen ops, on the
    inputs of its last call, timed in turns after the rounds (operands warm in cache; a step's first
    touch is not in it). It wraps the lowering's first-call check (which holds the region and its ATen
    graph) and the C++ region's call (which sees the inputs), for this process only."""

    def __init__(self) -> None:
        from accelrun.compile import lower
        from accelrun.compile.codegen import cpp

        self.checks: list = []
        self.inputs: dict[int, tuple] = {}
        made = lower.FirstCallCheck.__init__

        def init(check, fn, region, lowering):
            made(check, fn, region, lowering)
            self.checks.append(check)

        def recording(called):
            def call(region, *args):
                self.inputs[id(region)] = args
                return called(region, *args)

            return call

        lower.FirstCallCheck.__init__ = init
        for kind in (cpp.CppRegion, cpp.CppRowsRegion, cpp.CppLengthRegion):  # each defines its own call
            kind.__call__ = recording(kind.__call__)

    def report(self, repeats: int = 7) -> None:
        rows = []
        for check in self.checks:
            args = self.inputs.get(id(check.fn))
            if args is None:
                continue  # not a C++ region, or never called
            times: dict[str, list[float]] = {"cpp": [], "aten": []}
            with torch.no_grad():
                for _ in range(repeats):
                    for which, fn in (("cpp", check.fn), ("aten", check.region.gm)):
                        t0 = time.perf_counter()
                        fn(*args)
                        times[which].append(time.perf_counter() - t0)
            cpp_ms, aten_ms = (statistics.median(times[k]) * 1e3 for k in ("cpp", "aten"))
            ops = [str(n.target).removeprefix("aten.").removesuffix(".default")
                   for n in check.region.gm.graph.nodes if n.op == "call_function"]  # fmt: skip
            rows.append((check.region.id, cpp_ms, aten_ms, ops))
        slower = [r for r in rows if r[1] > r[2]]
        print(f"regions: {len(rows)} in C++, {sum(r[1] for r in rows):.2f} ms against their own ATen ops' "
              f"{sum(r[2] for r in rows):.2f} ms (each called once); slower in C++: {len(slower)}")  # fmt: skip
        for rid, cpp_ms, aten_ms, ops in sorted(slower, key=lambda r: r[2] - r[1])[:5]:
            print(f"  region {rid}: {cpp_ms:.3f} against {aten_ms:.3f} ms, {len(ops)} ops: {', '.join(ops)[:100]}")


def run_one(args: argparse.Namespace, name: str) -> None:
    tune_malloc(args.malloc)
    regions = RegionTimes() if args.regions else None
    torch.manual_seed(0)
    model = MODELS[name]()
    names = []
    for v in args.variants.split(","):
        why = next((why for (m, var, release), why in CRASHES.items()
                    if (m, var) == (name, v) and torch.__version__.startswith(release)), None)  # fmt: skip
        if why:
            print(f"{name}: {v} left out: {why}")
        else:
            names.append(v)
    variants = [Variant(v, model) for v in names]
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [args.seq] * 4
    ids = [torch.randint(0, VOCAB, (args.batch, n + 1), generator=g) for n in lengths]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in ids]
    warmup = max(args.warmup, len(batches) - 1)  # every length met before the timed rounds
    cycle = len(batches) if args.lengths else 1  # one sample a cycle through the lengths
    rounds = rounds_for_cycles(args.rounds, cycle)
    warmup = interleaved_rounds(variants, batches, warmup, rounds)
    samples, med = {}, {}
    for v in variants:
        samples[v.name], med[v.name] = samples_and_step(v.times, cycle)
    shape = f"seq {args.seq}" if not args.lengths else f"seq {args.lengths} in turn"
    print(f"\n{name}: batch {args.batch} x {shape}, {rounds} interleaved rounds after {warmup}, "
          f"{torch.get_num_threads()} threads; host malloc (every variant): {malloc_record(args.malloc)}")  # fmt: skip
    for v in variants:  # what ran, once it has (the record fills as graphs compile)
        print(f"  {v.description}" + (f"; {v.record.compiled_line()}" if v.record is not None else ""))
    step = "mean step" if args.lengths else "median step"  # a cycle's median over its steps
    print(f"{'variant':10s} {'first step':>10s} {step:>12s} {'vs eager (95%)':>24s} {'vs inductor (95%)':>24s}")
    by_name = {v.name: v for v in variants}

    def ratio(base: str, v: Variant) -> str:
        if base not in by_name or base == v.name:
            return "-"
        ci = bootstrap_ratio_of_medians([[t] for t in samples[base]], [[t] for t in samples[v.name]], paired=True)
        return f"{med[base] / med[v.name]:.3f}x ({ci.low:.3f}-{ci.high:.3f})"

    for v in variants:
        print(f"{v.name:10s} {v.first:9.2f}s {med[v.name] * 1e3:10.1f}ms {ratio('eager', v):>24s} "
              f"{ratio('inductor', v):>24s}")  # fmt: skip
    if args.lengths and "eager" in by_name:  # the median over several lengths mixes their steps: each apart
        for v in variants:
            if v.name != "eager":
                print(f"  {v.name} vs eager by length: " + ", ".join(
                    f"{n}: {per_length_ratio(by_name['eager'].times, v.times, i, len(lengths)):.3f}x"
                    for i, n in enumerate(lengths)))  # fmt: skip
    if regions is not None:
        regions.report()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lengths", help="sequence lengths the batches take in turn (comma-separated), as a user's "
                                      "own data without packing: each round's step has the next length")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--malloc", choices=typing.get_args(CpuMalloc), default="blocks",
                    help="the host allocator for every variant: accelrun train's default (blocks), or glibc's (system)")
    ap.add_argument("--regions", action="store_true",
                    help="after the rounds, time each of accelrun's C++ regions against its own ATen ops")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process for one model
    args = ap.parse_args()
    if args.one:
        run_one(args, args.one)
        return
    failed: list[str] = []
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        with tempfile.TemporaryDirectory(prefix="accelrun-bench-user-") as cache:
            env = {**os.environ, "ACCELRUN_CACHE_DIR": f"{cache}/accelrun", "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor"}
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", name], env=env)
        if done.returncode != 0:  # a crash (torch 2.13's Inductor on conv-mixer) costs one model, not the rest
            died = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
            print(f"\n{name}: its process died ({died}); the other models go on")
            failed.append(name)
    if failed:
        sys.exit(f"models whose process died: {', '.join(failed)}")


if __name__ == "__main__":
    main()
