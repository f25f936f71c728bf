"""The one error type of the data package: a problem the user can fix in the recipe or on disk."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from accelrun.errors import DataError  # defined there so that torch-free layers can raise it


@contextmanager
def as_data_error(*kinds: type[Exception]) -> Iterator[None]:
    """Errors of ``kinds`` (the torch-free config readers' own: a tokenizer or chat template file) raised
    inside become a ``DataError`` with the same one-line message."""
    try:
        yield
    except kinds as e:
        raise DataError(str(e)) from None


__all__ = ["DataError", "as_data_error"]
