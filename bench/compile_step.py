"""The debug Llama's training step (forward, backward, AdamW) under eager, Inductor and accelrun.

All variants live in one process and their steps are interleaved round-robin, so machine noise hits
them alike; figures are medians and ratios of medians (against eager and Inductor). Cold compile = the first step
with empty caches (Dynamo, Inductor's and accelrun's on-disk caches in a fresh temporary folder; each
precision in its own process, since Inductor's in-process caches carry from one precision's compile to
the next: its bf16-mixed cold step took 28.7 s first and 16.6 s after fp32), after one untimed
forward and backward of the model with no compiler, so a process's first trace of the model's code
counts against neither compiler (``warm_the_tracer``).
Warm start and peak memory are measured per variant in a fresh child process that reuses those
caches: its first step's time is the warm start, printed with the time ``compile_model`` took before it
in that process (its imports and the graph cache's setup; nothing for eager); its memory is the peak RSS of its steps (Linux's
high-water mark, reset once the model is built, so imports and setup do not count; where it cannot
be reset, the process's whole peak, marked "(whole process)").

    python bench/compile_step.py                       # fp32 and bf16-mixed
    python bench/compile_step.py --precision fp32 --rounds 30 --executors cpp,aten
    python bench/compile_step.py --variants eager,accelrun --passes max
    python bench/compile_step.py --malloc system           # glibc defaults (faults on every step)
    python bench/compile_step.py --device cuda --executors triton,aten model.dim=1024 model.n_layers=8
    python bench/compile_step.py --variants inductor,accelrun --profile-warm-start /tmp/prof   # where it goes
    python bench/compile_step.py --device cuda --profile-kernels /tmp/prof   # each variant's kernels, by kind
"""

from __future__ import annotations

import argparse
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
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.compile.compile_model import compile_model  # noqa: E402
from accelrun.config import load_config  # noqa: E402
from accelrun.config.schema import CpuMalloc  # noqa: E402
from accelrun.data import build_data  # noqa: E402
from accelrun.dist.context import ParallelContext  # noqa: E402
from accelrun.dist.layout import with_cuda_graph_decision  # noqa: E402
from accelrun.models import build_model, transformer_blocks  # noqa: E402
from accelrun.models.build import training_loss_fn  # noqa: E402
from accelrun.report.stats import bootstrap_ratio_of_medians  # noqa: E402
from accelrun.train.host_malloc import malloc_record, tune_malloc  # noqa: E402
from accelrun.train.optim import build_optimizer  # noqa: E402
from accelrun.train.precision import autocast  # noqa: E402
from bench.kernel_profile import profile_steps, side_by_side, write_tables  # noqa: E402
from bench.rounds import new_process_env  # noqa: E402

VARIANTS = ("eager", "inductor", "accelrun", "thunder")
ONE_PRECISION = "ACCELRUN_BENCH_PRECISION"  # set for the process that runs one precision of `--precision both`


class Variant:
    """One model + optimizer + data stream compiled one way."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        overrides = [f"train.precision={args.precision}", f"compile.passes={args.passes}", f"train.device={args.device}",
                     *args.override,
                     f"compile.executors=[{args.executors}]", f"compile.scope={args.scope}"]  # fmt: skip
        backend = name if name in ("eager", "inductor", "accelrun") else "eager"
        cfg = load_config(REPO / "configs" / "llama.yaml", [*overrides, f"compile.backend={backend}"]).config
        self.name, self.cfg, self.device = name, cfg, torch.device(args.device)
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, self.device, seed=cfg.train.seed)
        t0 = time.perf_counter()
        self.compiled = compile_model(self.model, transformer_blocks(self.model), cfg.compile)
        # compile.cuda_graphs as `accelrun train` decides it for one process (on for CUDA under auto)
        with_cuda_graph_decision(self.compiled, cfg, ParallelContext.single(self.device))
        # Its imports and the graph cache's setup: in a new process, part of the wait for the first step.
        self.compile_model_s = time.perf_counter() - t0
        self.loss_fn = training_loss_fn(self.model)
        if name == "thunder":
            import thunder  # installed by ../shared/peers/install_thunder.sh
            import torch.fx._lazy_graph_module as lazy

            lazy._force_skip_lazy_graph_module_flag = True  # thunder needs eager FX code objects
            jitted = thunder.jit(self.model)
            self.loss_fn = lambda x, y: jitted(x, y)
        self.optimizer = build_optimizer(self.model, cfg.train.optimizer, self.device, sharded=False)
        t = cfg.train
        self.data = build_data(cfg.data, seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed,
                               vocab_size=cfg.model.vocab_size)  # fmt: skip
        self.times: list[float] = []
        self.losses: list[float] = []

    def compiled_line(self) -> str | None:
        """accelrun's one line of what compiled (graphs, regions, CUDA graphs kept or declined and why)."""
        record = getattr(self.compiled, "record", None)
        return record.compiled_line() if record is not None else None

    def graph_cache(self) -> dict | None:
        record = getattr(self.compiled, "record", None)
        return dict(record.graph_cache) if record is not None else None

    def stage_seconds(self) -> dict[str, float]:
        """accelrun's compile stages so far (a warm start: the graph cache's load), rounded."""
        record = getattr(self.compiled, "record", None)
        return {k: round(v, 3) for k, v in record.stage_seconds.items()} if record is not None else {}

    def step(self, count_saved: bool = False) -> float:
        batch = [t.to(self.device) for t in next(self.data)]  # inputs, targets (+ positions: document packing)
        sync(self.device)
        t0 = time.perf_counter()
        with autocast(self.cfg.train.precision, self.device), saved_bytes_counter(count_saved) as saved:
            loss = self.loss_fn(*batch)
        self.saved_bytes = saved.get("bytes")
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach()))
        return dt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def saved_bytes_counter(enabled: bool):
    """Bytes of the distinct tensors autograd keeps for the backward (compiled graphs' saved
    activations included: AOTAutograd saves them through autograd too). Parameters count once."""
    result: dict = {}
    if not enabled:
        yield result
        return
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = total


def available(name: str) -> str | None:
    if name == "thunder":
        try:
            import thunder  # noqa: F401
        except ImportError:
            return "lightning-thunder is not installed (../shared/peers/install_thunder.sh installs it)"
    return None


def child(args: argparse.Namespace) -> None:
    """Warm start and memory of one variant, in a fresh process."""
    v = Variant(args.child, args)
    reset = v.device.type == "cpu" and reset_peak_rss()
    if args.profile_warm_start:  # the host's side of the first step, where a warm start's time goes
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        first = profiler.runcall(v.step)
        path = Path(args.profile_warm_start) / f"warm-start-{args.child}-{args.precision}.txt"
        with open(path, "w") as f:
            f.write(f"first step {first:.3f} s\n")
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(40)
    else:
        first = v.step()
    v.step(count_saved=True)
    cache = v.graph_cache()
    if v.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(v.device) / 2**20  # the device's, not the host's
    else:
        peak = (peak_rss_kib() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
    print(json.dumps({"warm_start_s": first, "compile_model_s": v.compile_model_s, "peak_rss_mib": peak, "whole_process": not reset and v.device.type == "cpu",
                      "saved_mib": v.saved_bytes / 2**20,
                      "graph_cache": {k: cache[k] for k in ("loaded", "compiled", "errors") if k in cache} if cache else None,
                      "stages_s": v.stage_seconds()}))


def reset_peak_rss() -> bool:
    """Restart the kernel's resident-set high-water mark (Linux: clear_refs 5); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_kib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1])
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "both"], default="both")
    p.add_argument("--variants", default="eager,inductor,accelrun,thunder")
    p.add_argument("--rounds", type=int, default=20, help="interleaved timed steps per variant")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per variant after its first")
    p.add_argument("--passes", default="default")
    p.add_argument("--executors", default="cpp,triton,aten", help="accelrun's executors, in priority order")
    p.add_argument("--scope", default="loss")
    p.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then the GPU's max allocated)")
    p.add_argument("--malloc", choices=typing.get_args(CpuMalloc), default="blocks",
                   help="CPU allocator settings of this process, so of every variant alike; blocks is what "
                        "`accelrun train` sets on a CPU (train.cpu_malloc)")
    p.add_argument("override", nargs="*", help="recipe overrides for every variant (model.dim=1024 ...)")
    p.add_argument("--profile-warm-start", metavar="DIR", help="write a cProfile of each variant's warm-start "
                   "first step (the new process's) into DIR, 40 entries by cumulative time")
    p.add_argument("--profile-kernels", metavar="DIR", help="after the timed rounds, profile each variant's steps "
                   "and write its kernels' own time per step into DIR, with a table by kind of kernel")
    p.add_argument("--profile-steps", type=int, default=5, help="steps profiled per variant (--profile-kernels)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    tune_malloc(args.malloc)
    if args.child:
        return child(args)
    args.precision = os.environ.get(ONE_PRECISION, args.precision)
    if args.precision == "both":  # one process per precision: each one's compile is cold in-process too
        for precision in ("fp32", "bf16-mixed"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:]], env={**os.environ, ONE_PRECISION: precision},
                           check=True)  # fmt: skip
        return
    torch.set_num_threads(torch.get_num_threads())
    cache = Path(tempfile.mkdtemp(prefix="accelrun-bench-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["ACCELRUN_CACHE_DIR"] = str(cache / "accelrun")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}; caches under {cache}")
    print(f"host malloc (every variant): {malloc_record(args.malloc)}")
    run_one(args)


def warm_the_tracer(args: argparse.Namespace) -> None:
    """Trace and differentiate a step of the model once through Dynamo and AOTAutograd with no compiler
    (``aot_eager``), before any variant's cold first step: what a process pays the first time it traces
    this code (imports, Dynamo's own caches) then counts against neither compiler, instead of against
    whichever goes first."""
    v = Variant("eager", args)
    batch = [t.to(v.device) for t in next(v.data)]
    with autocast(v.cfg.train.precision, v.device):
        loss = torch.compile(v.loss_fn, backend="aot_eager")(*batch)
    loss.backward()
    torch._dynamo.reset()


def time_variants(names: list[str], args: argparse.Namespace) -> tuple[list[tuple[str, list[float], list[float]]], dict]:
    """(name, step times by round, losses) per variant, and each one's cold first step. The variants (models,
    optimizers, compiled graphs) are gone when this returns, so the new processes that measure warm
    start and memory have the device to themselves."""
    variants, cold = [], {}
    warm_the_tracer(args)
    for name in names:
        torch._dynamo.reset()  # cold: nothing compiled in this process for this variant yet
        v = Variant(name, args)
        cold[name] = v.step()
        variants.append(v)
    for _ in range(args.warmup):  # untimed steps after compiling: the allocator, caches, and accelrun's
        for v in variants:  # cpu_gemm, which times each product layout on its first 10 calls
            v.step()
    for _ in range(args.rounds):
        for v in variants:
            v.times.append(v.step())
    if args.profile_kernels:  # after the timed rounds: the profiler's own cost stays out of them
        tables = [profile_steps(v.name, v.step, args.profile_steps, v.device) for v in variants]
        path = write_tables(tables, Path(args.profile_kernels), args.precision)
        print(f"{side_by_side(tables)}\n(each variant's kernels: {path})")
    for v in variants:
        if line := v.compiled_line():
            print(f"{v.name}: {line}")
        if cache := v.graph_cache():  # what the cold run saved for the warm start to load
            print(f"cold run of {v.name}: graph cache {({k: cache[k] for k in ('saved', 'errors') if k in cache})}")
    return [(v.name, v.times, v.losses) for v in variants], cold


def run_one(args: argparse.Namespace) -> None:
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    skipped = {n: why for n in names if (why := available(n))}
    names = [n for n in names if n not in skipped]
    rows, cold = time_variants(names, args)
    if args.device.startswith("cuda"):  # what the variants held, back to the device for the new processes
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    times = {name: ts for name, ts, _ in rows}
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    eager_median, inductor_median = medians.get("eager"), medians.get("inductor")
    print(f"\n## {args.precision}: {args.rounds} interleaved steps each (accelrun: passes={args.passes}, "
          f"executors=[{args.executors}], scope={args.scope})\n")  # fmt: skip
    memory = "peak GPU memory of the steps (new process)" if args.device.startswith("cuda") else \
        "peak RSS of the steps (new process)"
    print(f"| variant | median step | vs eager | vs inductor (95% interval) | cold compile (first step) | warm start (new process) | "
          f"saved for backward | {memory} | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    warm_cache: dict[str, dict] = {}
    for name, _, losses in rows:
        med = medians[name]
        ratio = f"{eager_median / med:.2f}×" if eager_median else "-"
        vs_inductor = f"{inductor_median / med:.2f}×" if inductor_median else "-"
        if inductor_median and name != "inductor":
            # Paired by round (the variants ran side by side in each), as `accelrun ab` pairs its repeats.
            ci = bootstrap_ratio_of_medians([[t] for t in times["inductor"]], [[t] for t in times[name]], paired=True)
            vs_inductor += f" ({ci.low:.2f}–{ci.high:.2f})"
        extra = measure_in_child(name, args)
        if extra.get("graph_cache"):  # with where the first step's time went beside its own calls
            warm_cache[name] = {**extra["graph_cache"], "stages_s": extra.get("stages_s")}
        nan = float("nan")
        print(f"| {name} | {med * 1000:.0f} ms | {ratio} | {vs_inductor} | {cold[name]:.1f} s | "
              f"{extra.get('warm_start_s', nan):.2f} s (+ {extra.get('compile_model_s', nan):.2f} s before it) | "
              f"{extra.get('saved_mib', nan):.1f} MiB | "
              f"{extra.get('peak_rss_mib', nan):.0f} MiB{' (whole process)' if extra.get('whole_process') else ''} | "
              f"{losses[-1]:.4f} |")  # fmt: skip
    for n, why in skipped.items():
        print(f"| {n} | skipped: {why} | | | | | | | |")
    for name, cache in warm_cache.items():  # whether the warm start loaded its graphs or compiled them again
        print(f"warm start of {name}: graph cache {cache}")
    # Same data, same seed: every variant must compute the same losses (the comparison is of speed only).
    ref_name, _, ref = rows[0]  # (name, times, losses)
    for name, _, losses in rows[1:]:
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref, strict=True))
        print(f"losses {name} vs {ref_name}: max relative difference {worst:.2e} over {len(ref)} steps")


def measure_in_child(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--precision", args.precision, "--passes", args.passes,
           "--executors", args.executors, "--scope", args.scope, "--device", args.device, "--malloc", args.malloc,
           *(["--profile-warm-start", args.profile_warm_start] if args.profile_warm_start else []),
           *args.override]  # fmt: skip
    try:
        out = subprocess.run(cmd, env=new_process_env(), capture_output=True, text=True, timeout=600,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except subprocess.CalledProcessError as e:  # its own error's last lines, not just the command line
        tail = "\n    ".join((e.stderr or "").strip().splitlines()[-5:])
        print(f"(the new process for {name} failed with exit code {e.returncode}:\n    {tail})", file=sys.stderr)
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"(the new process for {name} failed: {e})", file=sys.stderr)
    return {}


if __name__ == "__main__":
    main()
