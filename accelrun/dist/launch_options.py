"""How this node joins a job (its rank among the nodes, the rendezvous, restarts): read by
``accelrun train`` before anything imports torch, so that a recipe's mistake is reported in a
fraction of a second instead of after torch's distributed launcher has loaded (``dist.launch``)."""

from __future__ import annotations

from dataclasses import dataclass

RDZV_PORT = 29500  # the rendezvous port accelrun's SLURM and launch commands use, and a fix suggests


@dataclass(frozen=True)
class LaunchOptions:
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    local_addr: str | None = None

    def problems(self, nnodes: int) -> list[str]:
        """What torch's launcher would fail on, late and in a traceback: a node rank the job has no place
        for (it waited two minutes at the rendezvous, then dumped C++ frames) and an endpoint without a
        port (a traceback after the run folder was made). One line each, naming the option and a value
        that would do."""
        out = []
        if self.node_rank is not None and not 0 <= self.node_rank < nnodes:
            out.append(f"--node-rank {self.node_rank}: a job of {nnodes} node(s) (--nnodes, parallel.nnodes) has "
                       f"node ranks 0 to {nnodes - 1}; give each node its own, node 0 the one hosting the rendezvous")
        if self.rdzv_endpoint is not None and (problem := endpoint_problem(self.rdzv_endpoint)):
            out.append(f"--rdzv-endpoint {self.rdzv_endpoint!r}: {problem}")
        return out


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``HOST:PORT`` (or ``[IPV6]:PORT``) is not one, or None; a host alone is one (torch's launcher
    adds its default port)."""
    if endpoint.startswith("["):  # an IPv6 address, in brackets
        host, bracket, rest = endpoint.partition("]")
        host += bracket
        if not bracket or (rest and not rest.startswith(":")):
            return f"expected HOST:PORT, with an IPv6 address in brackets: [::1]:{RDZV_PORT}"
        if not rest:
            return None
        port = rest[1:]
    else:
        host, colon, port = endpoint.rpartition(":")
        if not colon:
            return None
    if not host:
        return f"no host before the port; expected HOST:PORT, e.g. localhost:{port or RDZV_PORT}"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"the port {port!r} is not a number from 0 to 65535; expected HOST:PORT, e.g. {host}:{RDZV_PORT}"
    return None
