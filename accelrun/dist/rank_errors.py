"""User errors of ranks, handed back to the process that launched them.

Only rank 0 prints a user error (every rank usually hits the same one). But when another rank hits it
first and exits, the agent stops rank 0 before it can print, and the user would see only exit code 2.
So each rank that stops on a user error also leaves a record in a folder the launcher made; after
the job the launcher prints whatever no rank printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelrun.dist.rank_failures import attempt, latest_start_procs


def leave_record(folder: Path, rank: int, messages: list[str], printed: bool) -> None:
    """Written after the rank printed (if it prints): a rank stopped in between means a message
    shown twice, never one lost."""
    record = {"rank": rank, "messages": messages, "printed": printed, "pid": os.getpid(), "attempt": attempt()}
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"rank-{rank}.json")  # whole records only: the launcher may read any time


def unprinted_messages(folder: Path) -> list[str]:
    """Messages of the ranks' records that no rank printed, each once, in rank order: of the group's
    latest start only. A record a rank of an earlier start left, which a restarted rank that failed
    otherwise did not write over, is not this failure's (under --max-restarts a user error of the first
    start was printed at the end of a job whose last start was killed). The latest start is the
    newest any rank recorded, in its process record or its user error's."""
    records = []
    for path in folder.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    newest_record = max((r.get("attempt", 0) for r in records), default=0)
    procs = latest_start_procs(folder, newer_than=newest_record)
    latest = max([newest_record, *(p.get("attempt", 0) for p in procs.values())])
    # A start after a node rejoined keeps the restart count: a rank's record from before it is told
    # apart by its process, where that rank recorded one.
    pids = {rank: p.get("pid") for rank, p in procs.items()}
    records = [r for r in records if r.get("attempt", 0) == latest and pids.get(r.get("rank"), r.get("pid")) == r.get("pid")]
    records.sort(key=lambda r: r["rank"])
    printed = {m for r in records if r["printed"] for m in r["messages"]}
    out: list[str] = []
    for r in records:
        out += [m for m in r["messages"] if m not in printed and m not in out]
    return out
