"""data.packing = document against every layout of 8 ranks: validate and the planner's search accept the same
ones (those without context parallelism, whose ring attention has no document mask yet), a refusal names
data.packing and parallel.cp, and train's own setup builds every rank of accepted ones."""

from __future__ import annotations

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
    built: set[int] = set()  # pipeline degrees whose layouts train's setup built
    for values in LAYOUTS:
        layout = _text(values)
        concat_ok, _ = _accepts([*MODEL, *layout])
        overrides = [*MODEL, *DOCUMENTS]
        ok, refusal = _accepts([*overrides, *layout])
        carried = values["parallel.cp"] == 1
        assert ok == (concat_ok and carried), (layout, refusal)
        if concat_ok and not carried:
            assert "data.packing = document (override 'data.packing=document') with parallel.cp =" in refusal, refusal
        assert _search_accepts(overrides, values) == ok, layout
        # Train's setup on the splits without replication or sequence parallelism (seconds each).
        if ok and values["parallel.dp_replicate"] == 1 and not values["parallel.sequence_parallel"] and (
                values["parallel.pp_schedule"] == "1f1b"):
            rows = dry_run(load_config(DEFAULT_CONFIG, [*overrides, *layout]))
            assert rows and all(r.params > 0 for r in rows)
            built.add(values["parallel.pp"])
    assert built == {1, 2, 4, 8}, built  # with and without pipeline stages


def test_document_packing_refuses_synthetic_data():
    ok, refusal = _accepts([*MODEL, *DOCUMENTS, "data.source=synthetic", "data.paths=[]", "parallel.nproc_per_node=1"])
    assert not ok and refusal == ("data.packing = document (override 'data.packing=document') needs documents, and "
                                  "data.source = synthetic (override 'data.source=synthetic') has none (use concat)")
