"""`accelrun plan` against `accelrun train` on this machine: predicted step time next to measured.

Each round, for one process and for two FSDP ranks: ``accelrun plan --calibrate`` measures the
machine (as that many devices), ``accelrun plan --json`` predicts the recipe's step on it, and
``accelrun train`` runs the recipe and reports its median steady step. The machine is calibrated
right before and right after its training job and the prediction is the mean of the two (a shared
machine drifts by tens of percent within minutes); rounds repeat the whole. Each command is a child process, exactly
as a user types it.

    python bench/plan_check.py                       # 3 rounds, 40 steps per job
    python bench/plan_check.py --rounds 1 --steps 30 train.seq_len=128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "llama.yaml"
LAYOUTS = {  # name → (devices, overrides)
    "1 process": (1, []),
    "2 FSDP ranks": (2, ["parallel.nproc_per_node=2", "train.micro_batch=8"]),
}


def accelrun(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "accelrun.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"accelrun {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def calibrated_plan(devices: int, overrides: list[str]) -> dict:
    return json.loads(accelrun("plan", "--calibrate", "--devices-per-node", str(devices), str(CONFIG),
                               f"cluster.devices_per_node={devices}", *overrides, "--json"))["plan"]


def one_pair(devices: int, overrides: list[str], steps: int, runs: Path) -> dict:
    """Calibrate, train, calibrate again: the prediction is the mean of the two plans, so that the
    machine's drift during the job moves the prediction the way it moves the measurement."""
    before = calibrated_plan(devices, overrides)
    accelrun("train", str(CONFIG), f"train.steps={steps}", "checkpoint.every=100000", f"report.runs_dir={runs}",
             *overrides)
    after = calibrated_plan(devices, overrides)
    plan = {"step_s": (before["step_s"] + after["step_s"]) / 2,
            "time_s": {k: (before["time_s"].get(k, 0) + after["time_s"].get(k, 0)) / 2 for k in before["time_s"]},
            "spread": (before["step_s"], after["step_s"])}
    report = json.loads(max(runs.glob("*/*/report.json"), key=lambda p: p.stat().st_mtime).read_text())
    measured = report["step_time_s"]["median"]
    comm = (report.get("comm_overlap") or {}).get("exposed_s")
    return {"predicted": plan["step_s"], "measured": measured, "parts": plan["time_s"], "spread": plan["spread"],
            "fsdp_measured": comm, "forward": report["step_breakdown_s"]["forward"],
            "backward": report["step_breakdown_s"]["backward"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every job")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="accelrun-plan-check-") as tmp:
        for r in range(args.rounds):
            for name, (devices, overrides) in LAYOUTS.items():
                row = one_pair(devices, [*overrides, *args.overrides], args.steps, Path(tmp) / f"{r}-{devices}")
                rows[name].append(row)
                print(f"round {r + 1} {name}: predicted {row['predicted'] * 1e3:.0f} ms (before the job "
                      f"{row['spread'][0] * 1e3:.0f}, after {row['spread'][1] * 1e3:.0f}), measured "
                      f"{row['measured'] * 1e3:.0f} ms, predicted/measured {row['predicted'] / row['measured']:.2f}"
                      f"  (plan: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in row["parts"].items()) + ")",
                      flush=True)
    print("\n| layout | predicted ms | measured ms | predicted / measured (each round) |")
    print("| --- | --- | --- | --- |")
    for name, rs in rows.items():
        ratios = [x["predicted"] / x["measured"] for x in rs]
        print(f"| {name} | {statistics.median(x['predicted'] for x in rs) * 1e3:.0f} | "
              f"{statistics.median(x['measured'] for x in rs) * 1e3:.0f} | "
              + ", ".join(f"{q:.2f}" for q in ratios) + f" (within ±25 %: {sum(abs(q - 1) <= 0.25 for q in ratios)}"
              f"/{len(ratios)}) |")


if __name__ == "__main__":
    main()
