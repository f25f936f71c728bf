"""Leaving one kind of a library's log record off the console: for a block of code, or for the process."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _LeftOut(logging.Filter):
    def __init__(self, containing: str) -> None:
        super().__init__()
        self.containing = containing

    def filter(self, record: logging.LogRecord) -> bool:
        return self.containing not in str(record.msg)


@contextlib.contextmanager
def records_left_out(logger_name: str, containing: str) -> Iterator[None]:
    """Inside, records of ``logger_name`` whose message contains ``containing`` are dropped; others pass."""
    logger, left_out = logging.getLogger(logger_name), _LeftOut(containing)
    logger.addFilter(left_out)
    try:
        yield
    finally:
        logger.removeFilter(left_out)


def leave_out(logger_name: str, containing: str) -> None:
    """From now on in this process, records of ``logger_name`` containing ``containing`` are dropped (once
    added, a second call adds nothing)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _LeftOut) and f.containing == containing for f in logger.filters):
        logger.addFilter(_LeftOut(containing))
