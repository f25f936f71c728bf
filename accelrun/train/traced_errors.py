"""A model's own error met while torch.compile traces it, said in the few lines eager PyTorch would use.

Dynamo runs the model's code on fake tensors before anything is compiled, so a mistake in the model
(a matrix product of mismatched sizes) surfaces there, as Dynamo's ``TorchRuntimeError``: some 230
lines of Dynamo's and fake tensors' frames and logs, the user's line near the end. ``named_model_errors``
turns it into one message: the error, the user's file and line, and what to try. The exit code stays a
crash's (1), not a recipe error's (2): it may also be torch.compile's own mistake, which
``compile.backend=eager`` tells apart.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import accelrun
from accelrun.errors import UserError

_LIBRARIES = (str(Path(torch.__file__).parent) + os.sep, str(Path(accelrun.__file__).parent) + os.sep)
# Model code inside accelrun (a built-in family, or one a user added there) is named as a user's is.
_FAMILIES = str(Path(accelrun.__file__).parent / "models" / "families") + os.sep
# The error Dynamo met, as it quotes it: "... got RuntimeError('a and b must have same reduction dim ...')"
_QUOTED_ERROR = re.compile(r"got (\w+)\((['\"])(.*?)\2\)", re.DOTALL)


_DATA_DEPENDENT = "data-dependent expression"  # Dynamo's words for a guard on a value read from a tensor


class ModelFailedWhileTraced(UserError):
    exit_code = 1  # most likely the model's own bug, possibly torch.compile's: not a recipe error (2)


class NotOneGraph(UserError):
    """``compile.fullgraph = true`` over a model Dynamo must break: the recipe asks what the model cannot give."""


@contextmanager
def named_model_errors(backend: str, fullgraph: bool = False) -> Iterator[None]:
    """Inside, a model's error met while Dynamo traces it becomes ``ModelFailedWhileTraced``, and the
    fake tensors' log of it (a traceback per failure, before Dynamo's own) is left out. Under
    ``fullgraph``, what Dynamo would have broken the graph at becomes ``NotOneGraph`` (exit 2)."""
    from accelrun.torch_private import (
        DynamoTorchRuntimeError,
        DynamoUnsupported,
        DynamoUserError,
        fake_tensor_log,
    )

    quiet = _DropMetaFailures()
    fake_tensor_log.addFilter(quiet)
    try:
        yield
    except DynamoTorchRuntimeError as e:
        raise ModelFailedWhileTraced(model_error_message(e, backend)) from e
    except (DynamoUnsupported, DynamoUserError) as e:
        # (a branch on a tensor's value is a UserError under fullgraph: Dynamo cannot guard on it)
        if not fullgraph or (isinstance(e, DynamoUserError) and _DATA_DEPENDENT not in str(e)):
            raise
        raise NotOneGraph(not_one_graph_message(e)) from e
    finally:
        fake_tensor_log.removeFilter(quiet)


def not_one_graph_message(e: Exception) -> str:
    """Dynamo's reason for the break, the model's line, its first hint, and the way out."""
    lines = [line.strip() for line in (getattr(e, "msg", None) or str(e)).strip().splitlines() if line.strip()]
    reason = lines[0] if lines else type(e).__name__
    if _DATA_DEPENDENT in reason:  # Dynamo's words name its own symbols ("zuf0 > 0.5"), not the model's code
        reason = "the code branches on a value read from a tensor (.item(), or a tensor used as a bool)"
    hint = next((line for line in lines if line.startswith("Hint:")), "")
    return (f"compile.fullgraph = true, but torch.compile cannot trace the model as one graph: {reason}"
            f"{_model_frame(e)}" + (f"\n  {hint}" if hint else "") +
            "\n  compile.fullgraph=false lets it break the graph there and run that part eagerly.")


def _model_frame(e: Exception) -> str:
    """``at file:line in function: code`` of the innermost of the model's own frames, or ""."""
    frames = [f for f in getattr(e, "real_stack", None) or []
              if not f.filename.startswith(_LIBRARIES) or f.filename.startswith(_FAMILIES)]
    if not frames:
        return ""
    f = frames[-1]
    return f"\n  at {f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def model_error_message(e: Exception, backend: str) -> str:
    """The error, where the model's code raised it, and what to try."""
    text = getattr(e, "msg", None) or str(e)
    quoted = _QUOTED_ERROR.search(text)
    error = f"{quoted.group(1)}: {quoted.group(3)}" if quoted else text.strip().splitlines()[0]
    where = _model_frame(e)
    return (f"the model's code failed while torch.compile traced it (compile.backend = {backend}): {error}{where}\n"
            "  Most likely it fails in eager PyTorch too: compile.backend=eager runs the model untraced, with "
            "PyTorch's own error; ACCELRUN_DEBUG=1 shows torch.compile's whole trace.")


class _DropMetaFailures(logging.Filter):
    """Fake tensors log each failed op with its traceback before raising it ("failed while attempting to
    run meta for aten.mm.default"): what ``named_model_errors`` says in one line is printed 150 lines
    long before it. ACCELRUN_DEBUG=1 keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return os.environ.get("ACCELRUN_DEBUG") == "1" or not str(record.msg).startswith("failed while attempting")
