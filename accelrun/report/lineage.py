"""Reading a run's history across restarts (written by ``accelrun.train.lineage``).

    runs/<name>/<id-1>/continued-by.json   who continued this folder: run folder, PID, host, step
    runs/<name>/<id-2>/lineage.json        {"continues": <id-1 folder>, "from_step", "root", "segment"}
    runs/<name>/<id>/crashed.json          the run's process raised (a kill leaves no marker)
"""

from __future__ import annotations

import json
from pathlib import Path

CLAIM = "continued-by.json"
LINEAGE = "lineage.json"
CRASHED = "crashed.json"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def history(run_dir: Path) -> list[Path]:
    """The run folders of ``run_dir``'s history, first segment first, ``run_dir`` last."""
    chain, seen = [run_dir], {run_dir.resolve()}
    while (previous := read_json(chain[0] / LINEAGE).get("continues")) is not None:
        path = Path(previous)
        if path.resolve() in seen or not path.is_dir():  # a moved or deleted segment ends the walk
            break
        chain.insert(0, path)
        seen.add(path.resolve())
    return chain


def continued_by(run_dir: Path) -> Path | None:
    """The run folder that continued ``run_dir``, if one did and it still exists."""
    run = read_json(run_dir / CLAIM).get("run")
    return Path(run) if run and Path(run).is_dir() else None


def crash_error(run_dir: Path) -> str | None:
    record = read_json(run_dir / CRASHED)
    return record.get("error") if record else None
