"""The one error type of the data package: a problem the user can fix in the recipe or on disk."""

from __future__ import annotations

from accelrun.errors import DataError  # noqa: F401 (defined there so that torch-free layers can raise it)
