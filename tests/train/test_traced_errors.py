"""A model's own error met while torch.compile traces it: one message with the error and the model's line
(it was some 230 lines of Dynamo's and fake tensors' frames), exit 1."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from accelrun.train.traced_errors import (
    ModelFailedWhileTraced,
    NotOneGraph,
    model_error_message,
    named_model_errors,
)


class TransposedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).transpose(1, 2))  # the mistake: (B, 8, T) @ (8, 16)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_shape_error_in_the_model_is_one_message_naming_its_line():
    from accelrun.torch_private import fake_tensor_log

    torch._dynamo.reset()
    model = torch.compile(TransposedHead(), backend="eager")
    kept = Kept()
    fake_tensor_log.addHandler(kept)  # (torch's loggers do not pass records on to the root's handlers)
    try:
        with pytest.raises(ModelFailedWhileTraced) as raised, named_model_errors("eager"):
            model(torch.zeros(2, 5, dtype=torch.long))
    finally:
        fake_tensor_log.removeHandler(kept)
    message = str(raised.value)
    assert raised.value.exit_code == 1
    assert "the model's code failed while torch.compile traced it (compile.backend = eager): RuntimeError: " in message
    assert "must have same reduction dim" in message  # torch's own words for the mistake
    assert f"at {__file__}:" in message and "in forward: return self.head(self.emb(tokens).transpose(1, 2))" in message
    assert "compile.backend=eager runs the model untraced" in message
    # the fake tensors' traceback of the same failure, printed first and 150 lines long, is left out
    assert not [m for m in kept.messages if "failed while attempting" in m]


class Clamped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.abs().max() > 1e3:  # a branch on the data
            h = h / 1e3
        return h


def test_a_break_under_fullgraph_is_one_recipe_error_naming_the_line():
    """A new user's compile.fullgraph=true over a data-dependent branch: Dynamo's 97-line traceback, exit 1."""
    torch._dynamo.reset()
    model = torch.compile(Clamped(), backend="eager", fullgraph=True)
    with pytest.raises(NotOneGraph) as raised, named_model_errors("accelrun", fullgraph=True):
        model(torch.ones(2, 4))
    message = str(raised.value)
    assert raised.value.exit_code == 2
    assert message.startswith("compile.fullgraph = true, but torch.compile cannot trace the model as one graph: "
                              "Data-dependent branching"), message
    assert f"at {__file__}:" in message and "in forward: if h.abs().max() > 1e3:" in message
    assert "Hint: " in message and "compile.fullgraph=false lets it break the graph there" in message
    assert len(message.splitlines()) == 4
    torch._dynamo.reset()  # without fullgraph the break is Dynamo's to make: nothing raised
    torch.compile(Clamped(), backend="eager")(torch.ones(2, 4))


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.abs().mean().item() > 0.5:  # a value read from a tensor, then compared
            h = h * 0.9
        return h


def test_a_branch_on_an_item_under_fullgraph_is_the_same_recipe_error():
    """Dynamo raises a UserError there ("Could not guard on data-dependent expression zuf0 > 0.5"), not
    Unsupported: a compiler engineer's trial got its traceback and exit 1."""
    torch._dynamo.reset()
    model = torch.compile(ReadsAValue(), backend="eager", fullgraph=True)
    with (torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(NotOneGraph) as raised,
          named_model_errors("accelrun", fullgraph=True)):
        model(torch.ones(2, 4))
    message = str(raised.value)
    assert raised.value.exit_code == 2 and "zuf0" not in message, message
    assert "the code branches on a value read from a tensor" in message
    assert f"at {__file__}:" in message and "in forward: if h.abs().mean().item() > 0.5:" in message
    torch._dynamo.reset()


def test_other_errors_pass_through_and_the_log_is_whole_again():
    from accelrun.torch_private import fake_tensor_log

    filters = list(fake_tensor_log.filters)
    with pytest.raises(ValueError, match="not the model's"), named_model_errors("accelrun"):
        raise ValueError("not the model's")
    assert fake_tensor_log.filters == filters


def test_a_built_in_family_s_line_is_named_and_accelrun_s_own_frames_are_not():
    import traceback
    from pathlib import Path

    import accelrun

    root = Path(accelrun.__file__).parent
    family, compiler = root / "models" / "families" / "llama" / "model.py", root / "compile" / "backend.py"
    error = RuntimeError("failed: got RuntimeError('a and b must have same reduction dim')")
    error.real_stack = traceback.StackSummary.from_list(
        [(str(family), 120, "forward", "h = self.attn(x)"), (str(compiler), 10, "__call__", "")])
    message = model_error_message(error, "accelrun")
    assert "RuntimeError: a and b must have same reduction dim" in message
    assert f"at {family}:120 in forward: h = self.attn(x)" in message
