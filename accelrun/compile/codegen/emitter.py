"""A tiny source writer: lines at the current indentation, and indented blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Emitter:
    def __init__(self, indent: str = "    ") -> None:
        self._lines: list[str] = []
        self._depth = 0
        self._indent = indent

    def line(self, text: str = "") -> None:
        self._lines.append(self._indent * self._depth + text if text else "")

    def lines(self, text: str) -> None:
        for line in text.strip("\n").splitlines():
            self.line(line)

    @contextmanager
    def block(self, header: str | None = None, close: str | None = None) -> Iterator[None]:
        if header is not None:
            self.line(header)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if close is not None:
                self.line(close)

    def source(self) -> str:
        return "\n".join(self._lines) + "\n"
