"""Context parallelism on CPU ranks (gloo): peak memory per rank and step time, cp=2 against one process.

Each variant is a real ``accelrun train`` process (two ranks through torchrun's elastic agent for cp=2)
on a long sequence. On a CPU the memory figure is the process's peak resident set (ru_maxrss), which
includes Python, torch and the model's state before any activation exists; so every variant also runs
at a short sequence (same model, same everything else) and the difference, the memory the long
sequence's training adds, is shown beside the total. Target: cp=2's added memory per rank ≤ 0.6 × one
process's.

    python bench/cp_memory.py
    python bench/cp_memory.py --seq-len 8192 --steps 6 model.dim=512

Measured on this project's 2-core CPU machine (other jobs running beside it), seq_len 8192, debug
Llama of dim 256, 4 layers, 8 heads over 2 key/value heads, one thread per rank:

    layout             peak RSS      added  added ×      step  step ×
    one process          1658 MiB   1149 MiB     1.00   10079 ms    1.00
    cp=2 (2 ranks)       1073 MiB    654 MiB     0.57    9910 ms    0.98

(0.56 and 0.61 in two other runs. Step times are blurred by a test suite running beside them: cp=2's
steps took 9.1-10.3 s in the three runs, one process's 10.1-25.4 s (14.3 s, × 0.65, in a quieter one
earlier). Added memory 0.60-0.63 before the K/V gather's whole-sequence temporaries were cut. Where
a rank's peak goes, from glibc's mallinfo2 at the step's phases: the bytes live at the step's peak
are 0.51 of one process's, 384 vs 752 MiB above what both hold between steps. The rest is heap
fragmentation: under train.cpu_malloc=tuned every block of a step comes from glibc's main heap,
which ends 300-400 MiB larger than the most ever live at once, about as much in either layout, so it
weighs more in the cp rank's smaller figure and varies by some tens of MiB between ranks and runs.
Not gloo's buffers: the other threads' arenas hold about 30 MiB at either length;
train.cpu_malloc=system fragments the same.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIG = REPO / "configs" / "llama.yaml"
BASE = ["train.device=cpu", "model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2",
        "model.ffn_dim=768", "model.max_seq_len=16384", "train.global_batch=1", "train.micro_batch=1",
        "checkpoint.enabled=false", "report.progress=none", "report.warmup_steps=2", "train.threads=1"]
VARIANTS = {"one process": ["parallel.nproc_per_node=1"],
            "cp=2 (2 ranks)": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.cp=2"]}
SHORT = 256


def run(runs: Path, name: str, overrides: list[str]) -> dict:
    """One ``accelrun train`` in a process of its own: a peak RSS is a process's whole life."""
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    cmd = [sys.executable, "-m", "accelrun.cli.main", "train", str(CONFIG), *overrides,
           f"report.runs_dir={runs}", f"name={name}"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (run_dir,) = (runs / name).iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    per_rank = report.get("mem_peak_bytes_per_rank") or [report["mem_peak_bytes"]]
    return {"mem": max(per_rank), "step_s": report["step_time_s"]["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, layout) in enumerate(VARIANTS.items()):
            common = [*BASE, *layout, f"train.steps={a.steps}", *a.overrides]
            long = run(Path(tmp), f"v{i}-long", [*common, f"train.seq_len={a.seq_len}"])
            short = run(Path(tmp), f"v{i}-short", [*common, f"train.seq_len={SHORT}"])
            rows[label] = (long, long["mem"] - short["mem"])
    one_long, one_added = rows["one process"]
    mib = 2**20
    print(f"seq_len {a.seq_len}, {a.steps} steps, peak RSS per rank (the largest rank); added = long − seq_len {SHORT}")
    print(f"{'layout':<16} {'peak RSS':>10} {'added':>10} {'added ×':>8} {'step':>9} {'step ×':>7}")
    for label, (long, added) in rows.items():
        print(f"{label:<16} {long['mem'] / mib:>8.0f} MiB {added / mib:>6.0f} MiB {added / one_added:>8.2f} "
              f"{long['step_s'] * 1e3:>7.0f} ms {long['step_s'] / one_long['step_s']:>7.2f}")


if __name__ == "__main__":
    main()
