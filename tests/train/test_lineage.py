"""One run identity across restarts: lineage, a second process refused, retention over the history,
crash versus kill in `runs list`."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.report.lineage import history
from accelrun.report.rundata import load_run
from accelrun.report.rundir import create_run_dir, hold_run_lock
from accelrun.report.runs_index import list_run_rows
from accelrun.train.checkpoint import complete_checkpoints
from accelrun.train.entry import train
from accelrun.train.lineage import RunAlreadyContinued, claim_continuation
from tests.conftest import DEFAULT_CONFIG


def run(overrides, **kw):
    return train(load_config(DEFAULT_CONFIG, overrides), command="test", **kw)


def test_a_run_stopped_twice_is_one_history_of_three_segments(tiny, tmp_path):
    recipe = tiny(12, "checkpoint.every=2", "checkpoint.keep=2", "name=hist")
    first = run(recipe, stop_after_step=5).run_dir
    second = run(recipe, stop_after_step=9).run_dir
    third = run(recipe)
    assert third.status == "finished"
    assert history(third.run_dir) == [first, second, third.run_dir]
    lineage = json.loads((third.run_dir / "lineage.json").read_text())
    assert lineage["segment"] == 3 and lineage["root"] == str(first) and lineage["from_step"] == 8
    claim = json.loads((first / "continued-by.json").read_text())
    assert claim["run"] == str(second) and claim["pid"] == os.getpid() and claim["from_step"] == 4
    assert third.report["history"] == [str(first), str(second), str(third.run_dir)]
    assert "hist" in (third.run_dir / "report.md").read_text() and " → " in (third.run_dir / "report.md").read_text()
    # checkpoint.keep = 2 counts the whole history: only the two newest remain, in the last folder.
    kept = [c.step for d in (first, second, third.run_dir) for c in complete_checkpoints(d / "checkpoints")]
    assert kept == [10, 12]
    assert not (first / "checkpoints").exists() and not (second / "checkpoints").exists()  # emptied: gone
    rows = {r.path: r for r in list_run_rows(tmp_path / "runs", "hist")}
    assert [rows[str(d)].status for d in (first, second, third.run_dir)] == ["continued", "continued", "finished"]
    # each stopped folder's report.md says who went on (it said "interrupted", "alone (no restarts)")
    for stopped, by, step in ((first, second, 4), (second, third.run_dir, 8)):
        lines = (stopped / "report.md").read_text().splitlines()
        assert lines[0].startswith("# ") and not lines[1] and not lines[3], lines[:5]
        assert lines[2].startswith(f"> **continued** by {by} from its checkpoint of step {step}: "), lines[:5]
    assert rows[str(third.run_dir)].segment == 3


def test_a_second_process_cannot_continue_a_run_a_live_one_continues(tiny, tmp_path):
    recipe = tiny(8, "checkpoint.every=2", "name=twice")
    cut = run(recipe, stop_after_step=3).run_dir
    # Another process (here: a lock held by this one) has claimed the run and is training.
    other = create_run_dir(tmp_path / "runs", "twice")
    with hold_run_lock(other):
        claim_continuation(cut, other, 2)
        with pytest.raises(RunAlreadyContinued) as e:
            run(recipe)
        assert e.value.exit_code == 2 and f"PID {os.getpid()}" in str(e.value) and str(other) in str(e.value)
    # Once that process is gone without a checkpoint of its own, the run can be continued again.
    resumed = run(recipe)
    assert resumed.report["resumed_from"].endswith("step-000002")
    assert json.loads((cut / "continued-by.json").read_text())["run"] == str(resumed.run_dir)


def test_a_crash_is_told_apart_from_a_kill(tiny, tmp_path, monkeypatch):
    import accelrun.train.loop as loop

    killed = run(tiny(6, "checkpoint.every=2", "name=killed"), stop_after_step=3).run_dir

    class Boom(RuntimeError):
        pass

    real = loop.save_checkpoint

    def save_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise Boom("disk on fire")

    monkeypatch.setattr(loop, "save_checkpoint", save_then_fail)
    with pytest.raises(Boom):
        run(tiny(6, "checkpoint.every=2", "name=crashed"))
    monkeypatch.undo()
    crashed = load_run(next((tmp_path / "runs" / "crashed").iterdir()))
    assert crashed.status == "crashed" and load_run(killed).status == "interrupted"
    assert "disk on fire" in json.loads((crashed.path / "crashed.json").read_text())["error"]
    # Continued, each keeps how it ended: `runs list` does not hide the crash behind "continued".
    run(tiny(6, "checkpoint.every=2", "name=crashed"))
    run(tiny(6, "checkpoint.every=2", "name=killed"))
    rows = {r.path: r for r in list_run_rows(tmp_path / "runs")}
    assert (rows[str(crashed.path)].status, rows[str(crashed.path)].continued_after) == ("continued", "crashed")
    assert (rows[str(killed)].status, rows[str(killed)].continued_after) == ("continued", "interrupted")
    shown = CliRunner().invoke(cli, ["runs", "list", str(tmp_path / "runs")], terminal_width=300).output
    assert "continued after a crash" in shown and "continued after an interruption" in shown


def test_resuming_from_a_named_folder_of_the_same_training_continues_that_run(tiny, tmp_path):
    """`checkpoint.resume=<run folder>` of the same training hash is that run's next segment (as under
    `auto`): the earlier folder is `continued`, so `auto` cannot continue it a second time."""
    recipe = tiny(8, "checkpoint.every=2", "name=named")
    cut = run(recipe, stop_after_step=3).run_dir
    resumed = run([*recipe, f"checkpoint.resume={cut}"])
    assert resumed.status == "finished" and resumed.report["resumed_from"].endswith("step-000002")
    assert history(resumed.run_dir) == [cut, resumed.run_dir]
    assert json.loads((cut / "continued-by.json").read_text())["run"] == str(resumed.run_dir)
    rows = {r.path: r.status for r in list_run_rows(tmp_path / "runs", "named")}
    assert rows == {str(cut): "continued", str(resumed.run_dir): "finished"}
    # Another training (here: more steps) started from that checkpoint is a new run: no link.
    longer = run([*tiny(10, "checkpoint.every=2", "name=named"), f"checkpoint.resume={resumed.run_dir}"])
    assert history(longer.run_dir) == [longer.run_dir] and not (longer.run_dir / "lineage.json").exists()
    # An older checkpoint of a stopped run (a rewind to step 2 of 4): a new run; the named folder keeps its
    # checkpoints (a continuation's retention would have counted them) and gets no claim.
    cut2 = run(tiny(8, "checkpoint.every=2", "name=rewind"), stop_after_step=5).run_dir
    kept = sorted(p.name for p in (cut2 / "checkpoints").iterdir())
    rewound = run([*tiny(8, "checkpoint.every=2", "name=rewind"), f"checkpoint.resume={cut2}/checkpoints/step-000002"])
    assert rewound.status == "finished" and history(rewound.run_dir) == [rewound.run_dir]
    assert sorted(p.name for p in (cut2 / "checkpoints").iterdir()) == kept and not (cut2 / "continued-by.json").exists()


def test_a_fresh_start_names_the_interrupted_run_of_another_training(tiny, tmp_path):
    """Changed train.steps after an interruption: a new training hash, so `auto` starts fresh, and says
    which interrupted run it did not continue and how to start from its weights."""
    from accelrun.train.resume import decide_resume

    cut = run(tiny(8, "checkpoint.every=2", "name=changed"), stop_after_step=3).run_dir
    here = create_run_dir(tmp_path / "runs", "changed")
    decision = decide_resume("auto", tmp_path / "runs" / "changed", here, "another-hash")
    assert decision.checkpoint is None
    assert (f"the stopped run {cut} has checkpoints of another training" in decision.reason
            and f"checkpoint.resume={cut} continues from its newest checkpoint" in decision.reason), decision.reason
    done = run(tiny(8, "checkpoint.every=2", "name=changed"))  # continues it to its end: nothing left to name
    assert done.status == "finished"
    assert "stopped run" not in decide_resume("auto", tmp_path / "runs" / "changed", here, "another-hash").reason


def test_a_stopped_runs_page_says_who_continued_it_once(tmp_path):
    """report.html said "interrupted" and "alone (no restarts)" beside report.md's note (a review)."""
    from accelrun.train.lineage import _say_continued_in_html

    page = tmp_path / "report.html"
    page.write_text("<html><body><h1>accelrun report: x</h1><p>status interrupted</p></body></html>")
    _say_continued_in_html(page, "**continued** by runs/x/2 from its checkpoint of step 4: ...")
    _say_continued_in_html(page, "**continued** by runs/x/3 from its checkpoint of step 4: ...")  # took over
    text = page.read_text()
    assert text.count('<p class="continued">') == 1 and "continued by runs/x/3" in text and "runs/x/2" not in text
    assert text.index("</h1>") < text.index('class="continued"') < text.index("status interrupted")
