"""The messages a logger emits inside a block (torch's loggers do not pass records to the root's handlers)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def logged(logger_name: str) -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
