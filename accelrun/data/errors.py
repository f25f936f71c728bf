"""The one error type of the data package: a problem the user can fix in the recipe or on disk."""

from __future__ import annotations

from accelrun.errors import UserError


class DataError(UserError, ValueError):
    """Bad or missing data, or a data state that does not match the data it is applied to.

    Messages name the recipe key involved (``data.paths``, ``model.vocab_size``) and the values
    found, so the CLI can print them as they are (exit code 2, no traceback).
    """
