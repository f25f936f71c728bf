"""transformers' own LlamaForCausalLM (random weights from a local config, nothing downloaded): one
training step (forward, backward, AdamW) under eager, Inductor and accelrun, fp32 and bf16.

The sibling of ``compile_step.py`` (the project's Llama) for model code nobody here wrote. Variants
live in one process, their steps interleaved round-robin so machine noise hits them alike; figures
are medians and ratios of medians (> 1: faster than the one compared with), with a 95% bootstrap
interval of the ratio to Inductor's (rounds resampled in pairs). With ``--lengths`` a sample is one
cycle through the lengths, its steps summed (``rounds.per_cycle``; until 2026-12-06 single steps of
every length were pooled, and the median compared whichever lengths sorted into the middle), the
table's step is a cycle's median over its steps, and each length's own ratio follows.

Each variant trains the model as ``accelrun train`` trains a user's model: built with its head and loss
as one step (``models.causal_lm_head``, since 2026-12-06; before, the loss was cross-entropy of the
logits the model returned), the loss ``training_loss_fn``'s. accelrun compiles the model as
``accelrun train`` does (``compile_model`` with ``--scope``, by default the recipe's ``auto``: the
repeated decoder layers, one graph for all, and the head with the cross-entropy as another, where
they fuse, both through the graph cache);
Inductor compiles the whole loss function, model and cross-entropy (its best case, as
``torch.compile`` of a training step). Until 2026-12-04 the timed rounds and the cold step compiled
the whole model with transformers' own loss (``labels=``) for accelrun too, which ``accelrun train``
does not do: on the AVX2 machine that was 1.133x Inductor a step against 1.113x by layers, and a
2.9 s cold step against 1.4 s. Until 2026-12-03 every call also built transformers' KV cache.

Cold compile = each compiled variant's first step with empty caches: each dtype runs in its own process (Inductor's in-process caches carry
from one dtype's compile to the next: its bf16 cold step took 32 s first and 18 s after fp32) with
Inductor's and accelrun's on-disk caches (the attention kernel's included) in a fresh folder, after
one untimed trace of the same model with no compiler (``aot_eager``), so the first trace of
transformers' code in a process (about 0.9 s of lazy imports and Dynamo's own caches) counts against
neither compiler instead of against whichever goes first. bf16 = the model's
weights and activations in bf16 (AdamW on bf16 parameters), which is how such models are usually
fine-tuned on a CPU.

    python bench/compile_step_hf.py
    python bench/compile_step_hf.py --malloc system          # glibc's defaults instead of accelrun train's
    python bench/compile_step_hf.py --dtypes fp32 --rounds 20 --hidden 512 --layers 4 --seq 512
    python bench/compile_step_hf.py --dtypes fp32 --rounds 60 --lengths 96,128,160,192,224,256 --warm-starts 0
    python bench/compile_step_hf.py --dtypes fp32 --vocab 32000 --seq 1024 --rounds 12 --warm-starts 0 \
        --variants inductor,accelrun-logits,accelrun     # what the head and loss as one graph are worth
    python bench/compile_step_hf.py --dtypes fp32 --vocab 32000 --seq 1024 --peak-memory --fill-steps 4 \
        --variants eager,inductor,accelrun-logits,accelrun

Warm start: after the timed rounds, each variant's first step in new processes (``--warm-starts``):
eager's, and accelrun's (compiled as above) with the caches a first process filled. That process runs
``--fill-steps`` steps, as an earlier training run would have (until 2026-12-04 it ran one, fewer than
cpu_gemm needs to choose its products' library, so every warm start timed them again).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelrun.compile.compile_model import compile_model  # noqa: E402
from accelrun.config.schema import CompileConfig, CpuMalloc, OptimizerConfig  # noqa: E402
from accelrun.models.build import training_loss_fn, transformer_blocks  # noqa: E402
from accelrun.models.causal_lm_head import attach_loss_head, detach_loss_head  # noqa: E402
from accelrun.report.stats import bootstrap_ratio_of_medians  # noqa: E402
from accelrun.train.host_malloc import malloc_record, tune_malloc  # noqa: E402
from accelrun.train.optim import build_optimizer  # noqa: E402
from bench.rounds import (  # noqa: E402
    interleaved_rounds,
    new_process_env,
    per_length_ratio,
    rounds_for_cycles,
    samples_and_step,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ONE_DTYPE = "ACCELRUN_BENCH_DTYPE"  # set for the process that runs one dtype of several


def build(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq,
                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype)
    attach_loss_head(model)  # as `accelrun train` builds a user's model (accelrun.models.build)
    return model


def warm_the_tracer(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One untimed forward and backward of a copy of ``model`` through Dynamo and AOTAutograd with no
    compiler: what tracing this code costs a process the first time counts against no variant."""
    torch.compile(training_loss_fn(copy.deepcopy(model)), backend="aot_eager")(*batch).backward()
    torch._dynamo.reset()


def accelrun_config(args: argparse.Namespace) -> CompileConfig:
    return CompileConfig(backend="accelrun", scope=args.scope, passes=args.passes, executors=args.executors.split(","))


def next_token_batch(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from a row of ``seq + 1`` tokens, as ``accelrun train``'s data loader makes them."""
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.name, self.model = name, copy.deepcopy(model)
        # AdamW as `accelrun train` builds it on a CPU (fused), the same for every variant, as in
        # bench/compile_step.py; until 2026-11-28 torch's default here (one kernel per parameter and op).
        self.opt = build_optimizer(self.model, OptimizerConfig(lr=1e-4), torch.device("cpu"), sharded=False)
        self.record, self.description = None, name
        if name == "accelrun-logits":  # accelrun without the head attached: the logits whole, the loss eager
            detach_loss_head(self.model)
        if name.startswith("accelrun"):
            # precision fp32: bf16 here is the model's own weights, which compile_model reads itself
            compiled = compile_model(self.model, transformer_blocks(self.model), accelrun_config(args),
                                     precision="fp32")  # fmt: skip
            self.record, self.description = compiled.record, compiled.description
        self.fn = training_loss_fn(self.model)
        if name == "inductor":
            self.fn = torch.compile(self.fn)
        self.times: list[float] = []
        self.first = 0.0

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        loss = self.fn(*batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def run(args: argparse.Namespace, dname: str) -> None:
    dtype = DTYPES[dname]
    model = build(args, dtype)
    cache = Path(tempfile.mkdtemp(prefix="accelrun-bench-hf-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["ACCELRUN_CACHE_DIR"] = str(cache / "accelrun")  # the attention kernel's library too
    variants = [Variant(n, model, args) for n in args.variants.split(",")]
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [args.seq] * 4
    batches = [next_token_batch(torch.randint(0, args.vocab, (args.batch, n + 1), generator=g)) for n in lengths]
    warm_the_tracer(model, batches[0])
    cycle = len(batches) if args.lengths else 1  # one sample a cycle through the lengths
    rounds = rounds_for_cycles(args.rounds, cycle)
    warm = interleaved_rounds(variants, batches, max(args.warmup, len(batches) - 1), rounds)  # every length met
    samples, med = {}, {}
    for v in variants:
        samples[v.name], med[v.name] = samples_and_step(v.times, cycle)
    shape = f"seq {args.seq}" if not args.lengths else f"seq {args.lengths} in turn"
    print(f"\ntransformers LlamaForCausalLM {dname}: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"{shape}, {rounds} interleaved rounds after {warm}, {torch.get_num_threads()} threads; accelrun: "
          f"{next((v.description for v in variants if v.name == 'accelrun'), '-')}")  # fmt: skip
    step = "mean step" if args.lengths else "median step"  # a cycle's median over its steps
    print(f"{'variant':15s} {'cold compile':>12s} {'vs inductor':>11s} {step:>12s} {'vs eager':>9s} "
          f"{'vs inductor':>12s} {'95% interval':>14s}")
    inductor = next((v for v in variants if v.name == "inductor"), None)
    for v in variants:
        vs_ind = f"{med['inductor'] / med[v.name]:.3f}x" if inductor else "-"
        interval = "-"
        if inductor is not None and v is not inductor:
            # Paired by round (the variants ran side by side in each): a slow spell of the machine
            # slows both sides of the ratio instead of widening its interval, as in `accelrun ab`.
            ci = bootstrap_ratio_of_medians([[t] for t in samples["inductor"]], [[t] for t in samples[v.name]],
                                            paired=True)  # fmt: skip
            interval = f"{ci.low:.3f}-{ci.high:.3f}"
        cold_ratio = f"{v.first / inductor.first:.3f}x" if inductor and v.name != "eager" else "-"
        print(f"{v.name:15s} {v.first:11.2f}s {cold_ratio:>11s} {med[v.name] * 1000:10.1f}ms "
              f"{med.get('eager', med[v.name]) / med[v.name]:8.2f}x {vs_ind:>12s} {interval:>14s}")  # fmt: skip
    if args.lengths and inductor is not None:
        for v in variants:
            if v is not inductor:
                print(f"  {v.name} vs inductor by length (median steps): " + ", ".join(
                    f"{n}: {per_length_ratio(inductor.times, v.times, i, len(lengths)):.3f}x"
                    for i, n in enumerate(lengths)))  # fmt: skip
    for v in variants:
        if v.record is not None:
            s = v.record.summary()
            print(f"{v.name}: {s['dynamo_graphs']} graph(s), regions {s['regions_per_executor']}, "
                  f"{len(s['fallbacks'])} fallback(s), warnings {s['warnings']}")  # fmt: skip
    if args.warm_starts:
        warm_starts(args, dname, cache / "warm")


def warm_starts(args: argparse.Namespace, dname: str, cache: Path) -> None:
    """A new process's first step (model built, then one forward and backward timed), each in its own
    child: eager; accelrun as `accelrun train` compiles this model (``compile_model`` with ``--scope``,
    the graph cache on), once to fill the caches (``--fill-steps`` steps) and then ``--warm-starts``
    times loading them."""
    def child(variant: str, steps: int = 1) -> dict:
        return run_child(args, variant, dname, steps, cache)

    filled = child("accelrun", args.fill_steps)
    eager = [child("eager")["first_step_s"] for _ in range(args.warm_starts)]
    warm = [child("accelrun") for _ in range(args.warm_starts)]
    loaded = [w["graph_cache"].get("loaded", 0) for w in warm]
    print(f"new process, first step (median of {args.warm_starts}): eager {statistics.median(eager):.2f} s; accelrun "
          f"{statistics.median(w['first_step_s'] for w in warm):.2f} s with its caches warm, after "
          f"{statistics.median(w['compile_model_s'] for w in warm):.2f} s in compile_model ({warm[0]['compiled']}; "
          f"graphs loaded: {loaded}; the process that filled them: first step {filled['first_step_s']:.2f} s of "
          f"{args.fill_steps}, {filled['graph_cache']}, cpu_gemm layouts left undecided: {filled['undecided']})")


def child(args: argparse.Namespace) -> None:
    """A new process's first step (``warm_starts``) of ``--fill-steps``, printed as JSON."""
    from accelrun.compile import gemm_choice

    tune_malloc(args.malloc)
    model = build(args, DTYPES[args.dtypes])
    record, what = None, args.child
    if args.child == "accelrun-logits":
        detach_loss_head(model)
    t0 = time.perf_counter()
    if args.child.startswith("accelrun"):
        compiled = compile_model(model, transformer_blocks(model), accelrun_config(args), precision="fp32")
        record, what = compiled.record, compiled.description
    compile_model_s = time.perf_counter() - t0  # its imports and the graph cache's setup: part of the wait
    loss_fn = training_loss_fn(model)
    if args.child == "inductor":
        loss_fn = torch.compile(loss_fn)
    inputs, targets = next_token_batch(
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)))
    gc.freeze()  # as `accelrun train` does before its first step (train/loop.py), for both variants
    times = []
    for _ in range(args.fill_steps):
        t0 = time.perf_counter()
        loss_fn(inputs, targets).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    # and undoes afterwards: objects left frozen at exit are never freed, and Triton's bindings then
    # print a screen of "nanobind: leaked ..." lines
    gc.unfreeze()
    undecided = len(gemm_choice.undecided_layouts())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"first_step_s": times[0], "compile_model_s": compile_model_s, "graph_cache": record.graph_cache if record else {}, "compiled": what,
                      "undecided": undecided, "peak_rss_mib": peak_mib}))  # fmt: skip


def peak_memory(args: argparse.Namespace, dname: str) -> None:
    """Each variant's peak resident memory over ``--fill-steps`` steps, each in a process of its own (one
    process's peak covers whatever ran in it)."""
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="accelrun-bench-hf-memory-") as cache:
            peak = run_child(args, variant, dname, args.fill_steps, Path(cache))["peak_rss_mib"]
        print(f"{dname} {variant:15s} peak resident memory over {args.fill_steps} steps: {peak:,.0f} MiB")


def run_child(args: argparse.Namespace, variant: str, dname: str, steps: int, cache: Path) -> dict:
    """``child`` in a new process, with this run's model and compile settings and ``cache`` for both
    compilers' caches: its JSON."""
    cmd = [sys.executable, __file__, "--child", variant, "--dtypes", dname, "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch", str(args.batch),
           "--seq", str(args.seq), "--scope", args.scope, "--passes", args.passes, "--executors", args.executors,
           "--fill-steps", str(steps)]  # fmt: skip
    env = new_process_env(ACCELRUN_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--variants", default="eager,inductor,accelrun",
                    help="of eager, inductor, accelrun, accelrun-logits (accelrun on the model without its head "
                         "attached: the logits whole and the loss eager, as before 2026-12-06)")
    ap.add_argument("--executors", default="cpp,aten")
    ap.add_argument("--passes", default="default")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lengths", help="sequence lengths the batches take in turn (comma-separated), as a user's "
                                      "own data without packing; the warm start keeps --seq")
    ap.add_argument("--warmup", type=int, default=10,
                    help="untimed steps per variant after its first (accelrun's cpu_gemm times each product "
                         "layout on its first 10 calls)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--malloc", choices=typing.get_args(CpuMalloc), default="blocks",
                    help="CPU allocator settings of this process, so of every variant alike; blocks is what "
                         "`accelrun train` sets on a CPU (train.cpu_malloc), as bench/compile_step.py does")
    ap.add_argument("--warm-starts", type=int, default=3,
                    help="new processes timed for the warm start, each variant (0: none)")
    ap.add_argument("--fill-steps", type=int, default=12,
                    help="steps of the process that fills the caches the warm starts load, as an earlier "
                         "training run would have: cpu_gemm decides a product layout's library after 10 calls "
                         "of it (each decoder layer calls each of its layouts once a step)")
    ap.add_argument("--scope", default="auto", choices=typing.get_args(CompileConfig.model_fields["scope"].annotation),
                    help="accelrun's compile.scope (auto: what `accelrun train` picks for this model)")
    ap.add_argument("--child", choices=["eager", "inductor", "accelrun", "accelrun-logits"], help=argparse.SUPPRESS)
    ap.add_argument("--peak-memory", action="store_true",
                    help="instead of timing: each variant's peak resident memory, a process each")
    args = ap.parse_args()
    if args.child:
        return child(args)
    dtypes = [d for d in os.environ.get(ONE_DTYPE, args.dtypes).split(",") if d]
    if unknown := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"--dtypes: unknown {', '.join(unknown)} (known: {', '.join(DTYPES)})")
    if args.peak_memory:
        for dname in dtypes:
            peak_memory(args, dname)
        return
    if len(dtypes) > 1:  # one process per dtype: each one's compile is cold in-process too
        for dname in dtypes:
            subprocess.run([sys.executable, __file__, *sys.argv[1:]], env={**os.environ, ONE_DTYPE: dname}, check=True)
        return
    tune_malloc(args.malloc)
    print(f"host malloc (every variant): {malloc_record(args.malloc)}")
    run(args, dtypes[0])


if __name__ == "__main__":
    main()
