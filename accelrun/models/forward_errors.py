"""A user's forward that fails on its own sizes: told apart from other failures, and said in one line.

``validate`` runs a user's forward on meta tensors and ``train`` runs it once on a sequence to count its
FLOPs, both eagerly, before anything is compiled. Where torch says sizes disagree there (a view to 7
heads of a width of 60), the model's own sizes (its ``model.kwargs``) are wrong: the first step would
fail the same way, so it is a recipe error (exit 2), not a crash.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

# torch's words for sizes that do not fit each other, whatever the device.
_SIZES_DISAGREE = re.compile(r"is invalid for input of size|shapes cannot be multiplied|must match the size of "
                             r"tensor|size mismatch|Expected size .* but got|is not divisible by")


def sizes_disagree(e: BaseException) -> bool:
    return isinstance(e, (RuntimeError, ValueError)) and bool(_SIZES_DISAGREE.search(str(e)))


def said(e: BaseException) -> str:
    """``Type: first line`` of an error (160 characters at most)."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


def users_line(e: BaseException) -> str:
    """`` (at file:line)``: the innermost frame of the error outside torch and accelrun (the user's)."""
    import torch

    ours = (Path(torch.__file__).parent, Path(__file__).parents[1])
    user = [f for f in traceback.extract_tb(e.__traceback__)
            if not any(Path(f.filename).is_relative_to(root) for root in ours)]
    return f" (at {user[-1].filename}:{user[-1].lineno})" if user else ""
