"""Readable dumps of every graph the compiler sees, one file per pass, for `accelrun compile explain`."""

from __future__ import annotations

import re
from pathlib import Path

from torch import fx

# torch's printer's words over nodes without a source line: here, nodes accelrun's passes made
TORCH_NO_TRACE = "# No stacktrace found for following nodes"
NO_SOURCE_LINE = "# no source line: made by accelrun's passes or AOTAutograd"


class Dumper:
    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._counter: dict[str, int] = {}
        self._last: dict[str, tuple[str, Path, str]] = {}  # each graph's last dump: text, file, label

    def graph(self, graph_name: str, label: str, gm: fx.GraphModule) -> None:
        if self.root is None:
            return
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        header = f"# {graph_name}, {label}\n"
        last = self._last.get(graph_name)
        if last is not None and last[0] == text and label == "input":
            # A forward's "input" repeated the partition pass that made it, file for file: it replaces that
            # file, saying which pass left it so. (A pass that changed only nodes' metadata, partition_regions
            # before lowering, keeps its file: a user asked for it.)
            last[1].unlink(missing_ok=True)
            n = self._counter[graph_name] - 1
            header = f"# {graph_name}, {label} (as {last[2]} left it)\n"
        else:
            n = self._counter.get(graph_name, 0)
            self._counter[graph_name] = n + 1
        path = self.root / _safe(graph_name) / f"{n:02d}_{_safe(label)}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + text.replace(TORCH_NO_TRACE, NO_SOURCE_LINE))
        self._last[graph_name] = (text, path, label)

    def source(self, graph_name: str, name: str, text: str) -> None:
        if self.root is None:
            return
        path = self.root / _safe(graph_name) / "kernels" / _safe(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
