"""Readable dumps of every graph the compiler sees, one file per pass, for `accelrun compile explain`."""

from __future__ import annotations

import re
from pathlib import Path

from torch import fx


class Dumper:
    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._counter: dict[str, int] = {}

    def graph(self, graph_name: str, label: str, gm: fx.GraphModule) -> None:
        if self.root is None:
            return
        n = self._counter.get(graph_name, 0)
        self._counter[graph_name] = n + 1
        path = self.root / _safe(graph_name) / f"{n:02d}_{_safe(label)}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = f"# {graph_name}, {label}\n"
        path.write_text(header + gm.print_readable(print_output=False, include_stride=True, include_device=True))

    def source(self, graph_name: str, name: str, text: str) -> None:
        if self.root is None:
            return
        path = self.root / _safe(graph_name) / "kernels" / _safe(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
