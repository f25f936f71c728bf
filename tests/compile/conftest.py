"""Each compiler test starts from an empty Dynamo cache: compiled code (and recompile counts) from
another test, keyed by the same code objects, must not leak into it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
