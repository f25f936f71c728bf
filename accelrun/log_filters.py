"""Leaving one kind of a library's log record off the console, for a block of code."""

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
