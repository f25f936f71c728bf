"""Lists and tuples as users type them (issue 30, item 4): one value where a one-item list is meant is
taken as that list; anything else that is not a list gets the spelling that works, in the form it was
written (an override, or a line in a file)."""

from __future__ import annotations

import pytest

from accelrun.config import ConfigError, load_config
from tests.conftest import DEFAULT_CONFIG


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def test_one_path_is_a_one_item_list(tmp_path):
    corpus = tmp_path / "corpus.txt"
    cfg = load_config(DEFAULT_CONFIG, ["data.source=text", f"data.paths={corpus}", "report.trackers=tensorboard"]).config
    assert cfg.data.paths == [str(corpus)] and cfg.report.trackers == ["tensorboard"]


@pytest.mark.parametrize("value, spelling", [
    ("0.9,0.95", "'train.optimizer.betas=[0.9, 0.95]'"),
    ("0.9", "'train.optimizer.betas=[0.9, 0.95]'"),  # one number for a pair: the pair, defaults shown
])
def test_a_tuple_override_says_the_spelling_that_works(value, spelling):
    msg = error_of(DEFAULT_CONFIG, [f"train.optimizer.betas={value}"])
    assert msg.startswith(f"override 'train.optimizer.betas={value}': train.optimizer.betas: input should be a valid tuple")
    assert msg.endswith(f"write it in brackets, quoted for the shell: {spelling}"), msg


def test_an_optional_pair_gets_a_pair():
    msg = error_of(DEFAULT_CONFIG, ["report.profile_steps=3"])
    assert msg.endswith("'report.profile_steps=[3, 3]'"), msg


def test_a_tuple_in_a_file_says_the_yaml_spelling(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"extends: [{DEFAULT_CONFIG}]\ntrain:\n  optimizer:\n    betas: 0.9,0.95\n")
    msg = error_of(p)
    assert msg.startswith(f"{p.resolve()}:4: train.optimizer.betas") and msg.endswith("betas: [0.9, 0.95]"), msg
