import os

import pytest

from accelrun.report import rundir
from accelrun.report.rundir import RUN_ID, create_run_dir, list_runs


def test_run_dirs_are_unique_across_rapid_calls(tmp_path):
    made = [create_run_dir(tmp_path / "runs", "demo") for _ in range(50)]
    assert len(set(made)) == 50
    for p in made:
        assert p.is_dir() and p.parent == tmp_path / "runs" / "demo" and RUN_ID.match(p.name)
        assert not any(p.iterdir())


def test_collision_draws_a_new_id(tmp_path, monkeypatch):
    ids = iter(["aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: next(ids))
    epoch = rundir.time.gmtime(0)
    monkeypatch.setattr(rundir.time, "gmtime", lambda: epoch)
    first = create_run_dir(tmp_path, "x")
    second = create_run_dir(tmp_path, "x")
    assert first.name == "19700101-000000-aaaaaa"
    assert second.name == "19700101-000000-bbbbbb"


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden"])
def test_bad_names_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="run name"):
        create_run_dir(tmp_path, bad)


def test_list_runs_newest_first(tmp_path):
    for name, stamp in [("a", "20240101-000000"), ("a", "20250101-000000"), ("b", "20240601-000000")]:
        (tmp_path / name / f"{stamp}-abcdef").mkdir(parents=True)
    (tmp_path / "a" / "not-a-run").mkdir()
    assert [p.name[:8] for p in list_runs(tmp_path)] == ["20250101", "20240601", "20240101"]
    assert [p.parent.name for p in list_runs(tmp_path)] == ["a", "b", "a"]
    assert [p.name[:8] for p in list_runs(tmp_path, "a")] == ["20250101", "20240101"]
    assert list_runs(tmp_path, "missing") == []
    assert list_runs(tmp_path / "nowhere") == []


def test_list_runs_same_second_uses_mtime(tmp_path):
    older = tmp_path / "a" / "20250101-000000-ffffff"
    newer = tmp_path / "a" / "20250101-000000-000000"
    older.mkdir(parents=True)
    newer.mkdir()
    os.utime(older, ns=(1_000_000_000, 1_000_000_000))
    os.utime(newer, ns=(2_000_000_000, 2_000_000_000))
    assert list_runs(tmp_path, "a") == [newer, older]
