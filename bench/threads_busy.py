"""The default recipe's step time with torch's default threads against the adaptive choice
(accelrun/train/threads.py), on a quiet machine and beside one busy 1-thread process.

Each case is a fresh `accelrun train` process (eager, so compiling does not enter the figures),
cases interleaved round by round; the figure is the report's median steady step time.

    python bench/threads_busy.py                 # 3 rounds, 30 steps each
    python bench/threads_busy.py --rounds 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def spin(stop) -> None:  # the neighbour: one thread, always busy
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1_000_003


def median_step_ms(threads: str, steps: int, runs: Path) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "accelrun.cli.main", "train", str(REPO / "configs" / "llama.yaml"),
           f"train.steps={steps}", "compile.backend=eager", "checkpoint.enabled=false", "checkpoint.resume=none",
           "report.progress=none", f"report.runs_dir={runs}", "report.warmup_steps=5"]
    if threads != "adaptive":
        cmd.append(f"train.threads={threads}")
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "ACCELRUN_FIXED_THREADS": "0"})
    run_dir = max(runs.glob("*/*/report.json"), key=lambda p: p.stat().st_mtime).parent
    report = json.loads((run_dir / "report.json").read_text())
    env = json.loads((run_dir / "env.json").read_text())
    return report["step_time_s"]["median"] * 1e3, env["cpu"]["torch_threads"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    cases = [("quiet", str(cores)), ("quiet", "adaptive"), ("busy", str(cores)), ("busy", "adaptive")]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    chosen: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for load, threads in cases:
                stop = mp.Event()
                neighbour = mp.Process(target=spin, args=(stop,)) if load == "busy" else None
                if neighbour:
                    neighbour.start()
                try:
                    ms, n = median_step_ms(threads, args.steps, Path(tmp))
                finally:
                    if neighbour:
                        stop.set()
                        neighbour.join()
                times[load, threads].append(ms)
                chosen[load, threads] = n
                print(f"round {r + 1}: {load:<5} threads={threads:<8} -> {n} thread(s), {ms:.0f} ms", flush=True)
    print("\n| machine | threads | took | median step (ms) | vs torch's default |\n| --- | --- | ---: | ---: | ---: |")
    for load, threads in cases:
        base = statistics.median(times[load, str(cores)])
        m = statistics.median(times[load, threads])
        print(f"| {load} | {threads} | {chosen[load, threads]} | {m:.0f} | {base / m:.2f}× |")


if __name__ == "__main__":
    main()
