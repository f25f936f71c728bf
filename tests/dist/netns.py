"""Two "hosts" on this machine: network namespaces joined by a veth pair, each with its own
address. Used by the multi-node test; needs root and iproute2."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"accelrun-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"`ip netns add` is not available here: {getattr(e, 'stderr', e)}"
    return None


@contextmanager
def two_hosts(subnet: str = "10.213.7"):
    """Yields [(namespace, interface, address), ...] for two hosts; removes them afterwards."""
    tag = os.getpid() % 100000
    hosts = [(f"acc{tag}a", f"va{tag}", f"{subnet}.1"), (f"acc{tag}b", f"vb{tag}", f"{subnet}.2")]
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
        (ns_a, if_a, ip_a), (ns_b, if_b, ip_b) = hosts
        _ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
        for ns, iface, addr in hosts:
            _ip("link", "set", iface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _ip("-n", ns, "link", "set", iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
