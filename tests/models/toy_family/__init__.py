"""A toy model family, laid out as a real one is (``accelrun/models/families/<name>/``), so that a test
shows what adding a family takes: this folder and one line in ``FAMILIES``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # SPEC imports torch; a family's folder (its torch-free ``shape`` module) imports without it.
    if name == "SPEC":
        from tests.models.toy_family.spec import SPEC

        return SPEC
    raise AttributeError(name)
