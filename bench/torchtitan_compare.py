"""accelrun against torchtitan on torchtitan's Llama 3 debug shape (dim 256, 6 layers, 16 heads, ffn 768,
vocab 2048, seq 2048, batch 8: 16,384 tokens a step), one CPU process each, one after another.

    python bench/torchtitan_compare.py                     # fp32, compiled, selective checkpointing (torchtitan's default)
    python bench/torchtitan_compare.py --ac none --steps 30
    python bench/torchtitan_compare.py --eager --ac none
    python bench/torchtitan_compare.py --precision bf16                 # bf16 compute (torchtitan's default)
    python bench/torchtitan_compare.py train.cpu_malloc=lean            # accelrun overrides after the flags

torchtitan runs through the outside launcher in ``../shared/peers/torchtitan/`` (install it once with its
``install.sh``); its figures are its own log's (steady steps after the first 5: tokens/s from the step
timestamps, peak memory = the process's peak RSS, which its CPU shim reports). accelrun's are its
report's (median steady step; peak RSS). Both checkpoint the same way (``--ac``), so the comparison is
like for like: torchtitan's debug recipe defaults to selective checkpointing, which an accelrun run
without checkpointing does not do. Time only on a quiet machine: the load is printed first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER = REPO.parent / "shared" / "peers" / "torchtitan"
SHAPE = ["model.dim=256", "model.n_layers=6", "model.n_heads=16", "model.n_kv_heads=16", "model.ffn_dim=768",
         "model.rope_theta=500000", "model.vocab_size=2048", "train.seq_len=2048", "train.global_batch=8"]
TOKENS_PER_STEP = 8 * 2048
WARMUP = 5  # steps left out of the steady figures, on both sides
AC_MODES = ("selective", "full", "none")  # the same names in both tools


PRECISIONS = {"fp32": ("float32", "fp32"), "bf16": ("bfloat16", "bf16-mixed")}  # torchtitan's, accelrun's


def torchtitan(name: str, steps: int, compiled: bool, ac: str, out: Path, precision: str) -> dict:
    flags = ["--training.mixed_precision_param", PRECISIONS[precision][0], "--training.steps", str(steps)]
    if compiled:
        flags.append("--compile.enable")
    flags.append(f"activation-checkpoint:{ac}")  # a subcommand of torchtitan's tyro CLI, after the flags
    env = {**os.environ, "OUT": str(out)}
    subprocess.run(["bash", str(PEER / "run.sh"), name, *flags], env=env, check=True, capture_output=True)
    stamps, mem = [], []
    for line in (out / f"{name}.log").read_text().splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*step:\s*\d+.*memory:\s*([\d.]+)GiB", line)
        if m:
            stamps.append(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
            mem.append(float(m.group(2)))
    if len(stamps) <= WARMUP + 1:
        log = (out / f"{name}.log").read_text().splitlines()
        why = "raise --steps" if len(stamps) else "it did not train; the end of its log:\n" + "\n".join(log[-15:])
        raise SystemExit(f"torchtitan logged {len(stamps)} steps ({out / f'{name}.log'}): {why}")
    dts = [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:], strict=False)]
    return {"tok_s": TOKENS_PER_STEP / statistics.median(dts), "mem_gib": max(mem)}


def accelrun(name: str, steps: int, compiled: bool, ac: str, out: Path, precision: str, overrides: list[str]) -> dict:
    backend = "compile.backend=accelrun" if compiled else "compile.backend=eager"
    cmd = [sys.executable, "-m", "accelrun.cli.main", "train", str(REPO / "configs" / "llama.yaml"), *SHAPE,
           f"train.steps={steps}", f"train.activation_checkpoint.mode={ac}", backend, "checkpoint.enabled=false",
           f"train.precision={PRECISIONS[precision][1]}", f"report.warmup_steps={WARMUP}", f"report.runs_dir={out}",
           f"name={name}", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    (report,) = (out / name).glob("*/report.json")
    r = json.loads(report.read_text())
    return {"tok_s": r["tokens_per_s"], "mem_gib": r["mem_peak_bytes"] / 2**30, "compiled": r.get("compiled")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ac", choices=AC_MODES, default="selective")
    ap.add_argument("--eager", action="store_true", help="both uncompiled (default: accelrun's compiler vs Inductor)")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("overrides", nargs="*", help="accelrun recipe overrides (train.cpu_malloc=lean ...)")
    a = ap.parse_args()
    if not (PEER / "run.sh").is_file():
        raise SystemExit(f"torchtitan's launcher is not at {PEER}")
    venv = Path(os.environ.get("TT_VENV", "/tmp/torchtitan-venv"))  # where run.sh looks for it
    if not (venv / "bin" / "python").is_file():
        raise SystemExit(f"torchtitan is not installed in {venv} (TT_VENV): run `bash {PEER / 'install.sh'} {venv}` once")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (time on a quiet machine)")
    compiled = not a.eager
    with tempfile.TemporaryDirectory(prefix="accelrun-vs-torchtitan-") as tmp:
        out = Path(tmp)
        tt = torchtitan("torchtitan", a.steps, compiled, a.ac, out, a.precision)
        ar = accelrun("accelrun", a.steps, compiled, a.ac, out, a.precision, a.overrides)
    what = "compiled (Inductor / accelrun)" if compiled else "eager"
    print(f"{a.precision}, {what}, activation checkpointing {a.ac}, {a.steps} steps (steady after {WARMUP})"
          + (f"; accelrun {' '.join(a.overrides)}" if a.overrides else ""))
    print(f"{'':12} {'tokens/s':>10} {'peak GiB':>9}")
    for label, r in (("torchtitan", tt), ("accelrun", ar)):
        print(f"{label:12} {r['tok_s']:10,.0f} {r['mem_gib']:9.2f}")
    print(f"accelrun / torchtitan: tokens/s {ar['tok_s'] / tt['tok_s']:.2f}x, memory {ar['mem_gib'] / tt['mem_gib']:.2f}x")


if __name__ == "__main__":
    main()
