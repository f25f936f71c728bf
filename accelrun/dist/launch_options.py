"""How this node joins a job (its rank among the nodes, the rendezvous, restarts): read by
``accelrun train`` before anything imports torch, so that a recipe's mistake is reported in a
fraction of a second instead of after torch's distributed launcher has loaded (``dist.launch``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchOptions:
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    local_addr: str | None = None
