"""The planner's user error, in a module of its own: the cluster description and the calibration
cache both raise it, and the cluster reads the calibration cache."""

from __future__ import annotations

from accelrun.errors import UserError


class PlanError(UserError):
    """A recipe or cluster description the planner cannot plan; the message names the key."""
