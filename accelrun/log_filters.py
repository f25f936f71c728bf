"""Leaving one kind of a library's log record off the console: for a block of code, or for the process."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def records_left_out(logger_name: str, containing: str) -> Iterator[None]:
    """Inside, records of ``logger_name`` whose message contains ``containing`` are dropped; others pass."""
    logger = logging.getLogger(logger_name)

    def keep(record: logging.LogRecord) -> bool:
        return containing not in str(record.msg)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class _LeftOut(logging.Filter):
    def __init__(self, containing: str) -> None:
        super().__init__()
        self.containing = containing

    def filter(self, record: logging.LogRecord) -> bool:
        return self.containing not in str(record.msg)


def leave_out(logger_name: str, containing: str) -> None:
    """From now on in this process, records of ``logger_name`` containing ``containing`` are dropped (once
    added, a second call adds nothing)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _LeftOut) and f.containing == containing for f in logger.filters):
        logger.addFilter(_LeftOut(containing))
