"""A SIGTERM before a run's steps (the command's first second: its imports, the recipe's checks) ends
the command with 143 as before, but says so: a trial's job killed then exited without a word."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from accelrun.dist import stop

# The console script pip writes (named accelrun, so the CLI knows it is the command), signalled once
# the CLI module is in: a real preemption lands in the subcommands' imports or the recipe's checks.
CONSOLE_SCRIPT = """
import os, signal, sys, time
sys.argv[1:] = sys.argv[1:] or ["train", "configs/llama.yaml"]
from accelrun.cli.main import main  # noqa: F401
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("not stopped")
"""


def test_sigterm_before_any_step_says_so_and_exits_143(tmp_path):
    script = tmp_path / "accelrun"
    script.write_text(CONSOLE_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "accelrun: stopped by SIGTERM before any step ran: nothing to save (exit 143)" in done.stderr
    assert "not stopped" not in done.stdout
    # a command that trains no run of its own (ab: its variants are processes of their own) says no more
    done = subprocess.run([sys.executable, str(script), "ab", "configs/llama.yaml"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143 and "accelrun: stopped by SIGTERM nothing of its own to save" not in done.stderr
    assert "accelrun: stopped by SIGTERM: nothing of its own to save (exit 143)" in done.stderr, done.stderr


def test_importing_the_cli_leaves_sigterm_alone():
    """A program that imports the CLI (tests through click's runner) keeps its own SIGTERM handling."""
    code = "import signal, accelrun.cli.main; print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize(("entered", "said"), [(0, "before any step ran"), (1, "after the run's last step")])
def test_the_message_says_whether_a_run_came_before(monkeypatch, entered, said):
    monkeypatch.setattr(stop, "_runs_entered", entered)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child dies of it (os._exit), as the command does
        sys.stderr = os.fdopen(write, "w")
        stop._stopped_outside_runs(signal.SIGTERM, None)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    said_there = os.read(read, 4096).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 143
    assert said in said_there
