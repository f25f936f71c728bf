"""data.packing = document against every layout of 8 ranks: validate and the planner's search accept the same
ones (those without pipeline or context parallelism, which do not carry the documents' positions yet), a
refusal names data.packing and the layout's key, and train's own setup builds every rank of an accepted one."""

from __future__ import annotations

import pytest

from accelrun.config import ConfigError, load_config
from accelrun.config.compose import apply_override, compose_file
from accelrun.config.resolve import resolve_config_path
from accelrun.config.search import search_path
from accelrun.config.validate import validate
from accelrun.dist.dry_run import dry_run
from accelrun.plan.search import _candidate
from tests.conftest import DEFAULT_CONFIG
from tests.dist.test_layout_agreement import LAYOUTS, MODEL, _text

DOCUMENTS = ["data.source=text", "data.paths=[corpus.txt]", "data.packing=document"]


def _accepts(overrides: list[str]) -> tuple[bool, str]:
    try:
        load_config(DEFAULT_CONFIG, overrides)
        return True, ""
    except ConfigError as e:
        return False, str(e)


def _search_accepts(overrides: list[str], values: dict) -> bool:
    dirs = search_path()
    base = compose_file(resolve_config_path(DEFAULT_CONFIG, dirs), dirs)
    for text in overrides:
        apply_override(base, text)
    candidate = _candidate(base, values)
    try:
        validate(candidate.data, candidate.sources)
        return True
    except ConfigError:
        return False


def test_document_packing_layouts_agree_with_validate_search_and_train():
    built = 0
    for values in LAYOUTS:
        layout = _text(values)
        concat_ok, _ = _accepts([*MODEL, *layout])
        overrides = [*MODEL, *DOCUMENTS]
        ok, refusal = _accepts([*overrides, *layout])
        carried = values["parallel.pp"] == 1 and values["parallel.cp"] == 1
        assert ok == (concat_ok and carried), (layout, refusal)
        if concat_ok and not carried:
            key = "parallel.pp" if values["parallel.pp"] > 1 else "parallel.cp"
            assert f"data.packing = document (override 'data.packing=document') with {key} =" in refusal, refusal
        assert _search_accepts(overrides, values) == ok, layout
        if ok and values["parallel.dp_shard"] == 8 // values["parallel.tp"]:  # one per tp degree: seconds each
            rows = dry_run(load_config(DEFAULT_CONFIG, [*overrides, *layout]))
            assert rows and all(r.params > 0 for r in rows)
            built += 1
    assert built >= 4


@pytest.mark.parametrize(("key", "value"), [("data.source", "synthetic"), ("eval.every", "5")])
def test_document_packing_refuses_what_cannot_carry_documents(key, value):
    ok, refusal = _accepts([*MODEL, *DOCUMENTS, f"{key}={value}", "parallel.nproc_per_node=1",
                            *([] if key != "data.source" else ["data.paths=[]"])])
    assert not ok and "data.packing = document (override 'data.packing=document')" in refusal and key in refusal
