"""Errors a user causes and can fix (no torch import, so every layer can raise them).

The CLI prints a ``UserError`` as one message and exits with its ``exit_code``; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's recipe, data or files. ``messages``: one line per problem."""

    exit_code = 2

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class DataError(UserError, ValueError):
    """Bad or missing data, or a data state that does not match the data it is applied to.

    Messages name the recipe key involved (``data.paths``, ``model.vocab_size``) and the values
    found, so the CLI can print them as they are (exit code 2, no traceback).
    """


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite; nothing was saved after the last good step."""

    exit_code = 3

    def __init__(self, step: int, what: str, value: float, last_checkpoint: object | None):
        self.step, self.last_checkpoint = step, last_checkpoint
        kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
        super().__init__(
            f"{what} became {value} at step {step}; training stopped and nothing was saved after it; {kept}. "
            "Lower train.optimizer.lr, raise train.lr_schedule.warmup_steps or set train.grad_clip."
        )


class CollectiveTimeout(UserError):
    """A collective waited longer than ``parallel.timeout_s``: some rank is gone, stuck or far behind."""

    exit_code = 1
    every_rank = True  # the rank that waited is the one that knows: each prints its own

    def __init__(self, rank: int, step: int, phase: str, timeout_s: int, cause: BaseException):
        detail = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        super().__init__(
            f"rank {rank}: a collective in {phase} at step {step} waited more than parallel.timeout_s = "
            f"{timeout_s} s for the other ranks and gave up ({detail}). Another rank is dead, stuck or much "
            "slower; its own log says which."
        )
