"""Every node of a job trains the recipe its own launcher resolved, or none does.

Each node's ``accelrun train`` resolves its own recipe and writes the job folder's ``config.yaml``; on a
shared folder the last node to write wins, and every rank trains that one. Two nodes started with other
overrides (a trial: ``train.steps=20`` on one, ``train.steps=30 train.optimizer.lr=1e-3`` on the other)
joined one job silently, and the first node printed a normal ``done:`` for a run it had not asked for.
Each launcher leaves the hash it resolved where its ranks find it; the ranks compare them once the
process group is up, and every rank stops with the same recipe error if they differ.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from accelrun.config.errors import ConfigError
from accelrun.dist.rank_failures import LOGS
from accelrun.dist.stop import launcher_token, set_launcher_identity


def _launched_file(run_dir: Path, token: str) -> Path:
    return run_dir / LOGS / f"launched-{socket.gethostname()}-{token}.training-hash"


def leave_launched_hash(run_dir: Path, training_hash: str) -> None:
    """The launcher's side: the training hash of the recipe this node resolved (before its ranks start).
    The training hash, not the config's: nodes may differ in where and how often they report."""
    set_launcher_identity()
    path = _launched_file(run_dir, launcher_token() or "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(training_hash)


def check_nodes_agree(run_dir: Path) -> None:
    """A rank's side, after ``init_process_group``: a ``ConfigError`` on every rank when the nodes'
    launchers resolved different recipes (nothing to check where a launcher left no hash)."""
    token = launcher_token()
    try:
        mine = _launched_file(run_dir, token).read_text().strip() if token else None
    except OSError:
        mine = None
    seen: list[Any] = [None] * dist.get_world_size()  # (host, hash or None) of every rank
    dist.all_gather_object(seen, (socket.gethostname(), mine))
    by_hash: dict[str, set[str]] = {}
    for host, h in seen:
        if h is not None:
            by_hash.setdefault(h, set()).add(host)
    if len(by_hash) > 1:
        said = "; ".join(f"training hash {h} on {', '.join(sorted(hosts))}" for h, hosts in sorted(by_hash.items()))
        raise ConfigError(f"the nodes of this job started from different recipes ({said}): start every node "
                          "with the same recipe and overrides")
