"""The per-device peak FLOP/s that MFU divides by: declared, looked up, measured, or plainly unknown.

Never guessed silently. Every :class:`Peak` says where its number came from, and when there is no
number it says why and how to give one (``report.peak_tflops`` in the recipe).

Example::

    peak = resolve_peak(torch.device("cpu"), "fp32", declared_tflops=None)
    print(peak.tflops, peak.source)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from accelrun.report.files import write_json
from accelrun.report.gpu_table import find_gpu_entry, why_not_listed
from accelrun.report.machine_load import BUSY_WARNING, CpuWindow

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16-mixed")
NO_PROBE_ENV = "ACCELRUN_NO_PEAK_PROBE"
CACHE_DIR_ENV = "ACCELRUN_CACHE_DIR"
BUSY_PEAK = "measured on a busy machine"  # how a probe's source starts when others used the CPU meanwhile


def is_upper_bound(report: dict) -> bool:
    """Whether a run's MFU (report.json) divides by a CPU peak probed while others used the CPU, which
    understates the machine: the MFU is then an upper bound."""
    return str((report.get("peak") or {}).get("source", "")).startswith(BUSY_PEAK)
HOW_TO_DECLARE = "declare the per-device peak in the recipe as report.peak_tflops (TFLOP/s)"

# The CPU probe: square matmuls of PROBE_SIZE (halved while one takes too long), timed in repeats of
# about PROBE_REPEAT_S, the best repeat kept, the whole probe held under about PROBE_BUDGET_S.
PROBE_SIZE = 1024
PROBE_MIN_SIZE = 128
PROBE_REPEATS = 5
PROBE_REPEAT_S = 0.2
PROBE_BUDGET_S = 2.0
# 2: entries record the other processes' CPU share during the probe; 3: fp32 probes time oneDNN beside MKL
PROBE_CACHE_VERSION = 3


@dataclass(frozen=True)
class Peak:
    """A per-device peak rate. ``tflops`` is None when unknown; ``detail`` then says what to do."""

    tflops: float | None
    source: str
    detail: str = ""
    cache_file: str | None = None  # where a measured peak is cached (None: not measured)

    def to_dict(self) -> dict:
        return {"tflops": self.tflops, "source": self.source, "detail": self.detail, "cache_file": self.cache_file}


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def lookup_gpu_peak(name: str, precision: str) -> Peak:
    """The datasheet peak of a GPU named as ``torch.cuda.get_device_name`` names it.

    Pure: reads only the built-in table. fp32 uses the non-tensor-core FP32 figure (no TF32);
    bf16-mixed uses the dense BF16 tensor-core figure. An unlisted name, or a listed GPU without a
    figure for this precision, gives ``Peak(None, "unknown", <why, and how to declare one>)``.

    >>> lookup_gpu_peak("NVIDIA A100-SXM4-80GB", "bf16-mixed").tflops
    312.0
    """
    _check_precision(precision)
    entry = find_gpu_entry(name)
    if entry is None:
        return Peak(None, "unknown", f"{why_not_listed(name)}; MFU is left out: {HOW_TO_DECLARE}")
    source = f"table: {entry.entry} ({entry.cited_for(precision)})"
    if precision == "bf16-mixed":
        if entry.bf16_tflops is None:
            return Peak(None, "unknown",
                        f"{entry.entry} has no bf16 tensor cores and its datasheet gives no bf16 peak; "
                        f"MFU is left out: {HOW_TO_DECLARE}")
        return Peak(entry.bf16_tflops, source, "dense BF16 tensor-core peak (no sparsity)")
    return Peak(entry.fp32_tflops, source,
                "FP32 non-tensor-core peak: fp32 matmuls run without TF32 at torch's default precision")


def resolve_peak(
    device: torch.device,
    precision: str,
    declared_tflops: float | None,
    cache_dir: Path | None = None,
) -> Peak:
    """The peak TFLOP/s of one ``device`` running at ``precision`` ("fp32" or "bf16-mixed").

    In order: (a) the recipe's declared ``report.peak_tflops``; (b) a CUDA/ROCm GPU found in the
    built-in datasheet table (:func:`lookup_gpu_peak`); (c) on a CPU, a measured ``torch.mm`` probe
    in the run's dtype with the current ``torch.get_num_threads()`` (call this after the run has set
    its thread count), cached per machine in ``cache_dir`` (default ``$ACCELRUN_CACHE_DIR`` or
    ``~/.cache/accelrun``); (d) anything else: ``tflops=None`` with the reason.

    On a CPU the probe gives the best *achievable* matmul rate, not a datasheet peak, so CPU MFU reads
    as "fraction of the best achievable matmul rate", and is higher than a datasheet-based MFU would be.
    ``ACCELRUN_NO_PEAK_PROBE=1`` skips the probe (and its cache): the peak is then unknown.
    """
    import torch

    _check_precision(precision)
    device = torch.device(device)
    if declared_tflops is not None:
        if declared_tflops <= 0:
            raise ValueError(f"report.peak_tflops must be positive, got {declared_tflops}")
        return Peak(float(declared_tflops), "declared (report.peak_tflops)",
                    f"declared in the recipe for {precision} on {device.type}")
    if device.type == "cuda":
        peak = lookup_gpu_peak(torch.cuda.get_device_name(device), precision)
        if (peak.tflops is not None and precision == "fp32"
                and torch.get_float32_matmul_precision() != "highest"):
            peak = Peak(peak.tflops, peak.source,
                        peak.detail + "; but float32 matmul precision is "
                        f"{torch.get_float32_matmul_precision()!r} (TF32 may be on), so this peak "
                        f"understates the device: {HOW_TO_DECLARE}")
        return peak
    if device.type == "cpu":
        if os.environ.get(NO_PROBE_ENV, "") not in ("", "0"):
            return Peak(None, "unknown",
                        f"the CPU matmul probe is off ({NO_PROBE_ENV}=1); MFU is left out: {HOW_TO_DECLARE}")
        return measure_cpu_peak(precision, cache_dir=cache_dir)
    return Peak(None, "unknown",
                f"no datasheet table or probe for device type {device.type!r}; MFU is left out: "
                f"{HOW_TO_DECLARE}")


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "accelrun"


def cpu_model_name() -> str:
    """The CPU's "model name" from /proc/cpuinfo, else ``platform.processor()``, else "unknown CPU"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _probe_dtype(precision: str) -> torch.dtype:
    """The dtype whose products set the peak. bf16-mixed on a CPU without bf16 matrix kernels: fp32, the
    fastest way such a CPU multiplies bf16 values (the compiler's cpu_half_gemm runs them so); a bf16
    probe would time ATen's generic loop there, and MFU would read 40x over 100%."""
    import torch

    from accelrun.torch_private import cpu_has_half_gemm

    if precision != "bf16-mixed":
        return torch.float32
    return torch.bfloat16 if cpu_has_half_gemm(torch.bfloat16) else torch.float32


def measure_cpu_peak(precision: str, cache_dir: Path | None = None) -> Peak:
    """Measured (or cached) best ``torch.mm`` rate on this CPU; see :func:`resolve_peak`.

    A probe taken while other processes used more than ``BUSY_WARNING`` of the CPU measures them as
    much as the CPU: it serves this run only (its MFU is then an upper bound) and is never cached. A
    cached entry that measures less than a cached entry with fewer threads was taken under load by an
    older accelrun (or before the machine quietened): it is stale and measured again.
    """
    import torch

    dtype = _probe_dtype(precision)
    dtype_name = str(dtype).removeprefix("torch.")
    cpu, threads = cpu_model_name(), torch.get_num_threads()
    key = {"cpu": cpu, "threads": threads, "dtype": dtype_name, "torch": torch.__version__,
           "version": PROBE_CACHE_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir if cache_dir is not None else default_cache_dir()) / "peak" / f"cpu-{digest}.json"

    cached = _read_cache(path, key)
    stale = _implausible_against(cached, path.parent) if cached is not None else None
    busy, saved = None, True
    if cached is not None and stale is None:
        result, how = cached, f"read from the cache, measured {cached['measured_at']}"
    else:
        window = CpuWindow()
        result = _probe(dtype)
        share = window.others_share()
        result["others_cpu_share"] = None if share is None else round(share, 3)
        result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        how = f"measured now in {result['probe_s']:.2f} s" + (f" ({stale})" if stale else "")
        if share is not None and share > BUSY_WARNING:
            busy = share
            how += " on a busy machine, for this run only (not cached)"
        else:
            try:
                write_json({"key": key, **result}, path)
            except OSError as e:  # a read-only home must not stop a run; the figure is still good
                how += f" (not cached: {e})"
                saved = False
    n = result["size"]
    if precision == "bf16-mixed" and dtype != torch.bfloat16:
        dtype_name += " (this CPU has no bf16 matrix kernels: its fastest bf16 products are fp32 GEMMs)"
    on_threads = f"{threads} thread{'' if threads == 1 else 's'}"
    load = result.get("others_cpu_share")
    # Said of the probe, not of now: a cached figure was measured at another time (a run beside a busy
    # neighbour read "1 thread ... other processes used 1% ... meanwhile" two lines after "other processes
    # are using 1.0 core(s)", found by a new user).
    when = f", measured {result['measured_at']}" if result.get("measured_at") else ""
    load_text = (f"other processes used {load:.0%} of the CPU while it was probed{when}" if load is not None
                 else f"load unknown{when}")
    # The probe times one product with each library it tries (fp32: torch.mm and oneDNN) and keeps the
    # faster; the source names the one whose rate the peak is.
    library = result.get("library", "torch.mm")
    probe = f"{dtype_name} {n}x{n} matrix product probe, {library}'s rate"
    if library != "torch.mm":
        probe += " (faster than torch.mm's here)"
    if busy is not None:
        source = f"{BUSY_PEAK}: {probe} on {cpu}, {on_threads}, {load_text}; not cached, so MFU is an upper bound"
    else:
        source = (f"measured: {probe} on {cpu}, {on_threads}, {load_text} "
                  + (f"(cached {path})" if saved else "(not cached: its cache cannot be written)"))
    by_library = result.get("tflops_by_library", {})
    libraries = (f"; fastest of {', '.join(f'{k} {v:.3f}' for k, v in by_library.items())} TFLOP/s"
                 if len(by_library) > 1 else "")  # fmt: skip
    detail = (f"{how}; best of {result['repeats']} repeats{libraries}. An achievable matmul rate, not a "
              "datasheet peak: CPU MFU is the fraction of the best achievable matmul rate")
    return Peak(result["tflops"], source, detail, cache_file=None if busy is not None or not saved else str(path))


def _implausible_against(entry: dict, folder: Path) -> str | None:
    """Why a cached entry cannot be right, or None: fewer threads, cached for the same CPU, dtype and
    torch, measured a higher rate than this entry's threads. An entry measured quietly after that other
    one is trusted (some CPUs do lose with more threads), so a re-measurement settles it once."""
    mine = entry["key"]
    for path in folder.glob("cpu-*.json"):
        try:
            other = json.loads(path.read_text(encoding="utf-8"))
            theirs = other["key"]
            fewer = int(theirs["threads"]) < int(mine["threads"])
            rate = float(other["tflops"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        same = all(theirs.get(k) == mine.get(k) for k in ("cpu", "dtype", "torch", "version"))
        if not (same and fewer and rate > entry["tflops"]):
            continue
        settled = entry.get("others_cpu_share") is not None and entry["measured_at"] >= other.get("measured_at", "")
        if not settled:
            return (f"the cached {mine['threads']}-thread peak {entry['tflops']:.3g} TFLOP/s was below the cached "
                    f"{theirs['threads']}-thread {rate:.3g}: taken under load, so measured again")
    return None


def _read_cache(path: Path, key: dict) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (isinstance(data, dict) and data.get("key") == key
          and isinstance(data.get("tflops"), (int, float)) and data["tflops"] > 0
          and isinstance(data.get("size"), int) and "measured_at" in data and "repeats" in data)
    return data if ok else None


def _multipliers(dtype: torch.dtype) -> dict[str, Callable]:
    """What a run may multiply ``dtype`` matrices with, by name: ``torch.mm``, and for fp32 also oneDNN's
    linear, which the compiler's cpu_gemm pass runs a product through where it is faster than MKL (so
    a peak of torch.mm's alone could read below what the run achieves)."""
    import torch

    from accelrun.torch_private import onednn_linear

    found: dict[str, Callable] = {"torch.mm": torch.mm}
    if dtype == torch.float32 and onednn_linear() is not None:
        from accelrun.compile.gemm_choice import onednn_mm

        found["oneDNN"] = onednn_mm
    return found


def _probe(dtype: torch.dtype) -> dict:
    """Best-of-repeats TFLOP/s on square matrices of the fastest of ``_multipliers`` (timed in turns),
    within about PROBE_BUDGET_S."""
    import torch

    multipliers = _multipliers(dtype)
    start = time.perf_counter()
    n = PROBE_SIZE
    # Its own generator: a draw from torch's would shift a run's dropout masks on the first run on a
    # machine (the peak is measured then, and read from the cache after), so one seed gave two curves.
    gen = torch.Generator().manual_seed(0)
    while True:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        for _ in range(2):  # warm-up: first calls pay for allocation and kernel selection
            for multiply in multipliers.values():
                multiply(a, b)
        t0 = time.perf_counter()
        torch.mm(a, b)
        one = time.perf_counter() - t0
        # Keep several repeats inside the budget: shrink while one matmul is too slow for that.
        if one * PROBE_REPEATS <= PROBE_BUDGET_S / 2 or n <= PROBE_MIN_SIZE:
            break
        n //= 2
    per_repeat = max(1, round(PROBE_REPEAT_S / max(one, 1e-9)))
    best = dict.fromkeys(multipliers, 0.0)
    repeats = 0
    while repeats < PROBE_REPEATS:
        if repeats >= 1 and time.perf_counter() - start + len(multipliers) * per_repeat * one > PROBE_BUDGET_S:
            break
        for name, multiply in multipliers.items():  # in turns: a slow spell of the machine hits each
            t0 = time.perf_counter()
            for _ in range(per_repeat):
                multiply(a, b)
            elapsed = time.perf_counter() - t0
            best[name] = max(best[name], 2.0 * n**3 * per_repeat / elapsed / 1e12)
        repeats += 1
    fastest = max(best, key=best.get)
    return {"tflops": best[fastest], "size": n, "repeats": repeats, "matmuls_per_repeat": per_repeat,
            "library": fastest, "tflops_by_library": best, "probe_s": round(time.perf_counter() - start, 3)}
