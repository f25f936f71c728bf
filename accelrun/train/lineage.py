"""One run's identity across restarts.

Every start makes a new run folder; a start that continues an earlier run's checkpoint
(``checkpoint.resume: auto``) links the two, so that a run interrupted twice is one history of three
segments, not three runs:

    runs/<name>/<id-1>/continued-by.json   who continued this folder: run folder, PID, host, step
    runs/<name>/<id-2>/lineage.json        {"continues": <id-1 folder>, "from_step", "root", "segment"}

``continued-by.json`` is created exclusively: of two identical commands started together, one
continues the run and the other is refused with the first one's PID (exit 2), instead of both
training from the same checkpoint. Checkpoint retention (``checkpoint.keep``) counts the whole
history, and the reports and ``runs list`` show it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path

from accelrun.errors import UserError
from accelrun.report.files import write_text_atomic
from accelrun.report.lineage import CLAIM, CRASHED, LINEAGE, history, read_json
from accelrun.report.rundir import is_running


class RunAlreadyContinued(UserError):
    pass


def claim_continuation(previous: Path, run_dir: Path, step: int) -> None:
    """Record that ``run_dir`` continues ``previous`` from ``step``; refuse if a live run already does."""
    record = {"run": str(run_dir), "pid": os.getpid(), "host": socket.gethostname(), "from_step": step}
    claim = previous / CLAIM
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        other = read_json(claim)
        other_run = Path(other.get("run", ""))
        if other_run != run_dir and other_run.is_dir() and is_running(other_run):
            raise RunAlreadyContinued(
                f"{previous} is already being continued by PID {other.get('pid')} on {other.get('host')} "
                f"(run {other_run}); wait for it to end, or start fresh with checkpoint.resume=none"
            ) from None
        # That continuation ended without a checkpoint of its own (auto-resume would have taken it): take over.
        write_text_atomic(json.dumps(record, indent=1), claim)
    else:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    _say_continued_in_report(previous, run_dir, step)
    before = read_json(previous / LINEAGE)
    write_text_atomic(json.dumps({
        "continues": str(previous), "from_step": step,
        "root": before.get("root", str(previous)), "segment": int(before.get("segment", 1)) + 1,
    }, indent=1), run_dir / LINEAGE)


CONTINUED_NOTE = "> **continued** by "


def _say_continued_in_report(previous: Path, run_dir: Path, step: int) -> None:
    """A line under the stopped folder's report.md title: it said "interrupted" and "alone (no restarts)"
    after a later run had taken over (a trial's). A continuation that took over from another replaces it."""
    report = previous / "report.md"
    try:
        lines = report.read_text(encoding="utf-8").splitlines()
    except OSError:
        return  # no report (killed): runs list and the lineage files say it
    if len(lines) > 3 and lines[2].startswith(CONTINUED_NOTE):  # said by a continuation that took over
        del lines[2:4]
    note = (f"{CONTINUED_NOTE}{run_dir} from its checkpoint of step {step}: this report covers this folder's "
            "steps; the run goes on there (`accelrun compare` of that folder reads the whole history)")
    at = 2 if len(lines) > 1 and lines[0].startswith("#") and not lines[1] else 0  # under the title
    lines[at:at] = [note, ""]
    with contextlib.suppress(OSError):
        write_text_atomic("\n".join(lines) + "\n", report)
    _say_continued_in_html(previous / "report.html", note.removeprefix("> "))


def _say_continued_in_html(page: Path, note: str) -> None:
    """The same note under report.html's title (replacing one a continuation that took over wrote)."""
    import html
    import re

    try:
        text = page.read_text(encoding="utf-8")
    except OSError:
        return
    text = re.sub(r'<p class="continued">.*?</p>', "", text, count=1, flags=re.DOTALL)
    said = f'<p class="continued">{html.escape(note.replace("**", ""))}</p>'
    text, found = re.subn(r"(<h1>.*?</h1>)", lambda m: m.group(1) + said, text, count=1, flags=re.DOTALL)
    if found:
        with contextlib.suppress(OSError):
            write_text_atomic(text, page)


def mark_crashed(run_dir: Path, error: BaseException | str) -> None:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    try:
        write_text_atomic(json.dumps({"error": str(text).strip()[:2000]}, indent=1), run_dir / CRASHED)
    except OSError:
        pass  # the folder itself may be what failed; the error is reported to the user regardless


def prune_history_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete the history's complete checkpoints in earlier segments beyond the newest ``keep`` of the
    whole history (the current folder prunes its own as it saves). Returns what was deleted."""
    from accelrun.train.checkpoint import complete_checkpoints  # torch: only when a run saves

    earlier = history(run_dir)[:-1]
    if not earlier:
        return []
    everything = [c for d in history(run_dir) for c in complete_checkpoints(d / "checkpoints")]
    newest = sorted(everything, key=lambda c: (c.step, c.created))[-keep:]
    keep_paths = {c.path for c in newest}
    gone = [c.path for d in earlier for c in complete_checkpoints(d / "checkpoints") if c.path not in keep_paths]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    for d in earlier:  # a folder whose checkpoints all went: no empty checkpoints/ to look into
        with contextlib.suppress(OSError):  # not empty (an incomplete one, a user's file): left as it is
            (d / "checkpoints").rmdir()
    return gone
