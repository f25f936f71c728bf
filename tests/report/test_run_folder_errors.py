"""A run folder that cannot be made is one message naming the path, the reason and the key to change
(exit 2), not an OSError's traceback."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.report.rundir import RunFolderError, create_run_dir, job_run_dir
from tests.conftest import DEFAULT_CONFIG, TINY


@pytest.mark.parametrize("below", ["", "sub"])
def test_runs_dir_that_is_a_file_exits_2(below, tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=1",
                                 f"report.runs_dir={blocker / below if below else blocker}"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and f"{blocker} is a file, not a folder" in r.output, r.output
    assert "set report.runs_dir to a folder you can write" in r.output


@pytest.mark.parametrize("code, why", [(errno.EROFS, "the file system is read-only"),
                                       (errno.EACCES, "permission denied"),
                                       (errno.ENOSPC, "no space left on the device")])
def test_read_only_or_full_file_system(code, why, tmp_path, monkeypatch):
    def refuse(self, *a, **kw):  # as root, permissions cannot make a folder read-only: refuse as the OS would
        raise OSError(code, "refused", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    for make in (lambda: create_run_dir(tmp_path / "runs", "x"), lambda: job_run_dir(tmp_path / "runs", "x", "j1")):
        with pytest.raises(RunFolderError, match=f"report.runs_dir = {tmp_path / 'runs'}: .*: {why}"):
            make()
