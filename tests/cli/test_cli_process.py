"""The installed ``accelrun`` command in a real process: exit codes and preemption (SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import DEFAULT_CONFIG, REPO, TINY


def accelrun(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    return subprocess.Popen([sys.executable, "-m", "accelrun.cli.main", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_bad_value_exits_2_without_traceback():
    p = accelrun("validate", str(DEFAULT_CONFIG), "train.steps=-3")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2, out
    assert "train.steps: input should be greater than 0" in out and "Traceback" not in out


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    runs = tmp_path / "runs"
    args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=100000", "checkpoint.every=100000",
            f"report.runs_dir={runs}", "report.progress=lines", "report.log_every=1", "train.threads=1"]
    p = accelrun(*args)
    metrics = None
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        found = list(runs.glob("*/*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            metrics = found[0]
            break
        time.sleep(0.2)
    assert metrics is not None, "training did not start"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143, out
    run_dir = metrics.parent
    assert not (run_dir / "report.json").exists()
    (ckpt,) = list((run_dir / "checkpoints").glob("step-*"))
    saved_step = json.loads((ckpt / "train_state.json").read_text())["step"]
    assert saved_step >= 3 and "preempted" in out
    # The same command again continues after the saved step (here: just a few more steps).
    p = accelrun(*[a if a != "train.steps=100000" else f"train.steps={saved_step + 2}" for a in args],
                 "checkpoint.resume=" + str(run_dir))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert f"resuming from {ckpt}" in out.replace("\n", "")
