"""Each compiler test starts from an empty Dynamo cache: compiled code (and recompile counts) from
another test, keyed by the same code objects, must not leak into it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def refusing_compiler(tmp_path, monkeypatch):
    """A C++ compiler on the PATH that refuses every source (``ACCELRUN_CXX``), and an empty kernel
    cache: a hand-written kernel's library then cannot be built."""
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo fakecc 1.0; exit 0; fi\necho refused >&2; exit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("ACCELRUN_CXX", str(fake))
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "cache"))
    return fake
