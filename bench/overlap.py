"""FSDP's communication on two CPU ranks (gloo), debug Llama: FSDP2 against compiled FSDP without and
with the communication passes.

Variants (each one a real two-rank ``accelrun train`` job, started through torchrun's elastic agent
from this process; rounds interleave the variants so that machine noise hits them alike):

- ``fsdp2``: FSDP2 (hooks gather and reduce outside any graph), eager model;
- ``fsdp2+blocks``: FSDP2 with each block compiled by accelrun (default passes);
- ``compiled``: compiled FSDP, default passes (collectives traced where the code calls them: each
  all-gather waited at once, each reduce-scatter waited at once);
- ``compiled+overlap``: compiled FSDP with ``bucket_collectives`` and ``schedule_overlap``.

Per job: median steady step time and, from the run report (accelrun.dist.comm_overlap, rank 0), the
median exposed communication per step (time blocked on FSDP's collectives), the median busy time (some
collective in flight) and the overlap fraction. Figures below are medians over rounds.

    python bench/overlap.py
    python bench/overlap.py --rounds 3 --steps 10 --bucket-mb 1 --max-inflight-mb 8
    python bench/overlap.py --variants compiled,compiled+overlap train.seq_len=128
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.config import load_config  # noqa: E402
from accelrun.train.entry import train  # noqa: E402

CONFIG = REPO / "configs" / "llama.yaml"
BASE = ["parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=8", "train.threads=1",
        "checkpoint.enabled=false", "report.progress=none", "report.warmup_steps=3"]  # fmt: skip


def variants(bucket_mb: float, inflight_mb: float) -> dict[str, list[str]]:
    comm = (f"{{bucket_collectives: {{bucket_mb: {bucket_mb}}}}}, "
            f"{{schedule_overlap: {{max_inflight_mb: {inflight_mb}}}}}")  # fmt: skip
    default = "fuse_attention, fuse_rmsnorm, fuse_swiglu, fuse_rope, fuse_linear_cross_entropy, dce, cse"
    return {
        "fsdp2": ["compile.backend=eager"],
        "fsdp2+blocks": ["compile.backend=accelrun"],
        "compiled": ["compile.backend=accelrun", "parallel.fsdp_impl=compiled"],
        "compiled+overlap": ["compile.backend=accelrun", "parallel.fsdp_impl=compiled",
                             f"compile.passes=[{default}, {comm}, partition_regions]"],
    }  # fmt: skip


def run_job(runs: Path, name: str, steps: int, overrides: list[str]) -> dict:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        cfg = load_config(CONFIG, [*BASE, f"train.steps={steps}", f"report.runs_dir={runs}", f"name={name}",
                                   *overrides])  # fmt: skip
        result = train(cfg, command="bench/overlap.py")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    report = json.loads((result.run_dir / "report.json").read_text())
    ov = report.get("comm_overlap") or {}
    return {"step": report["step_time_s"]["median"], "exposed": ov.get("exposed_s"), "busy": ov.get("busy_s"),
            "overlap": ov.get("overlap_fraction"), "loss": report["final_loss"]}  # fmt: skip


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--max-inflight-mb", type=float, default=8.0)
    ap.add_argument("--variants", default="fsdp2,fsdp2+blocks,compiled,compiled+overlap")
    ap.add_argument("override", nargs="*", help="recipe overrides for every variant (key=value)")
    args = ap.parse_args()
    os.environ.setdefault("ACCELRUN_NO_PEAK_PROBE", "1")
    table = variants(args.bucket_mb, args.max_inflight_mb)
    names = args.variants.split(",")
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="accelrun-bench-overlap-") as tmp:
        for r in range(args.rounds):
            for n in names:
                res = run_job(Path(tmp), n.replace("+", "-"), args.steps, [*table[n], *args.override])
                results[n].append(res)
                print(f"round {r + 1} {n:18s} step {_ms(res['step'])} ms  exposed {_ms(res['exposed'])} ms  "
                      f"busy {_ms(res['busy'])} ms  overlap {res['overlap']}", flush=True)  # fmt: skip
    print(f"\n{'variant':18s} {'step ms':>9s} {'exposed ms':>11s} {'busy ms':>9s} {'overlap':>8s} {'final loss':>11s}")
    summary = {}
    for n in names:
        rs = results[n]
        s = {k: _med([x[k] for x in rs]) for k in ("step", "exposed", "busy", "overlap", "loss")}
        summary[n] = s
        ov = "-" if s["overlap"] is None else f"{s['overlap']:.2f}"
        print(f"{n:18s} {_ms(s['step']):>9s} {_ms(s['exposed']):>11s} {_ms(s['busy']):>9s} {ov:>8s} "
              f"{s['loss']:11.5f}")  # fmt: skip
    if "compiled" in summary and "compiled+overlap" in summary and summary["compiled"]["exposed"]:
        ratio = summary["compiled+overlap"]["exposed"] / summary["compiled"]["exposed"]
        print(f"\nexposed communication, compiled+overlap / compiled: {ratio:.2f} (target <= 0.5)")
    if "fsdp2" in summary and "compiled+overlap" in summary:
        ratio = summary["compiled+overlap"]["step"] / summary["fsdp2"]["step"]
        print(f"step time, compiled+overlap / fsdp2: {ratio:.2f} (target <= 1.0)")


if __name__ == "__main__":
    main()
