"""End-to-end runs of the training loop on a tiny model: loss, run directory, resume, failures."""

from __future__ import annotations

import json
import math

import pytest
import torch

from accelrun.compile.codegen.cpp_build import find_compiler
from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from accelrun.train.checkpoint import complete_checkpoints
from accelrun.train.entry import train
from accelrun.train.loop import TrainingDiverged
from tests.conftest import DEFAULT_CONFIG


def run(overrides, **kw):
    return train(load_config(DEFAULT_CONFIG, overrides), command="test", **kw)


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]


def test_loss_falls_and_run_directory_is_complete(tiny):
    result = run(tiny(40, "checkpoint.every=20"))
    d = result.run_dir
    assert result.status == "finished"
    for name in ("config.yaml", "config.sources.txt", "command.txt", "env.json", "metrics.jsonl",
                 "report.json", "report.md"):
        assert (d / name).is_file(), name
    assert d.parent.name == "llama-debug" and d.parent.parent.name == "runs"
    report = json.loads((d / "report.json").read_text())
    assert report["status"] == "finished" and report["steps"] == 40
    assert report["final_loss_mean"] < report["first_loss"] - 1.0, (report["first_loss"], report["final_loss_mean"])
    assert report["config_hash"] in (d / "report.md").read_text()
    malloc = json.loads((d / "env.json").read_text())["cpu"]["malloc"]  # train.cpu_malloc = blocks (default)
    assert f"host malloc: {malloc}" in (d / "report.md").read_text()
    if find_compiler() is None:  # no g++: tuned, and the record says why (tests/train/test_host_blocks.py)
        assert malloc.startswith("blocks unavailable (no C++ compiler") and report["host_blocks"] is None, malloc
    else:
        assert malloc.startswith("blocks: from 1 MiB mapped once") and "tuned: M_MMAP_THRESHOLD" in malloc, malloc
        blocks = report["host_blocks"]  # the run's CPU allocator (this model's tensors are all under 1 MiB)
        assert blocks["small"] > 1000 and blocks["misses"] == 0, blocks
        assert "| host block cache |" in (d / "report.md").read_text()
    assert report["tokens_per_s"] > 0 and report["step_breakdown_s"]["forward"] > 0
    # one rank: its row's peak and the run's are one figure (they differed by the final checkpoint's save)
    assert report["mem_peak_bytes"] == report["mem_peak_bytes_per_rank"][0], report
    assert report["mfu"] is None and "peak unknown" in " ".join(report["notes"])  # probe disabled here
    # What runs list reads where a killed run wrote no report: the same peak as the report's.
    assert json.loads((d / "env.json").read_text())["peak"] == report["peak"]
    rows = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(k in rows[0] for k in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mem_peak_bytes"))
    assert [c.step for c in complete_checkpoints(d / "checkpoints")] == [20, 40]
    assert "train.steps" in (d / "config.sources.txt").read_text()


def test_resume_continues_with_identical_losses(tiny):
    # Uninterrupted reference.
    full = run(tiny(16, "checkpoint.every=5", "name=ref"))
    # Same recipe under another name, "killed" after step 12 (last checkpoint: step 10) ...
    cut = run(tiny(16, "checkpoint.every=5", "name=cut"), stop_after_step=12)
    assert cut.status == "stopped" and not (cut.run_dir / "report.json").exists()
    # its steps have a report (they were in metrics.jsonl only), without the report.json that ends a run
    cut_report = (cut.run_dir / "report.md").read_text()
    assert "- stopped after step 12: this report covers the steps run; checkpoint.resume: auto continues it from " \
        f"{cut.run_dir / 'checkpoints' / 'step-000010'}" in cut_report, cut_report
    assert "· 12 steps" in cut_report and (cut.run_dir / "report.html").is_file()
    # ... then started again with the same command: it continues from step 10.
    resumed = run(tiny(16, "checkpoint.every=5", "name=cut"))
    report = resumed.report
    assert report["resumed_from"].endswith("step-000010") and report["first_step"] == 11
    ref = losses(full.run_dir)
    assert losses(resumed.run_dir) == ref[10:]  # fp32 on the CPU: bit-identical
    assert losses(cut.run_dir) == ref[:12]
    # Its report says which of the run's steps its figures cover, and gives the whole run's, which `runs
    # list` shows (a new user read 27 steps in one and 60 in the other, with nothing telling why).
    whole = report["whole_run"]
    assert (whole["folders"], whole["steps"], whole["first_step"]) == (2, 16, 1), whole
    assert whole["first_loss"] == ref[0] and whole["final_loss"] == ref[-1]
    import statistics

    from accelrun.report.rundata import load_run

    listed = load_run(resumed.run_dir).steady_step_times()  # what runs list and compare take its median of
    assert whole["step_time_median_s"] == statistics.median(listed), (whole, listed)
    rate = next(line for line in (resumed.run_dir / "report.md").read_text().splitlines()
                if line.startswith("| learning rate |"))
    assert "never reached" not in rate, rate  # its rates only fall after the warm-up, which the run passed
    text = (resumed.run_dir / "report.md").read_text()
    assert "· 6 steps in this folder (from step 11) of the run's 16 over 2 folders" in text, text[:300]
    assert "the whole run (16 steps over 2 folders, as `accelrun runs list` and `compare` show it)" in text
    assert full.report["whole_run"] is None and "in this folder" not in (full.run_dir / "report.md").read_text()
    # That run has finished: a fresh launch starts from scratch instead of resuming it.
    again = run(tiny(16, "checkpoint.every=5", "name=cut"))
    assert again.report["resumed_from"] is None and again.report["first_step"] == 1


def test_a_checkpoint_with_the_optimizer_settings_by_group_index_still_resumes(tiny, monkeypatch):
    """Checkpoints written before 2026-12-07 keep the optimizer's settings per group index (the form
    whose indices collided under pipelining); they load as they were written, with identical losses."""
    import torch.distributed.checkpoint as dcp

    import accelrun.train.checkpoint as checkpoint

    full = run(tiny(6, "checkpoint.every=3", "name=ref"))
    monkeypatch.setattr(checkpoint, "FLAT", checkpoint.BY_GROUP_INDEX)  # the writer of before
    cut = run(tiny(6, "checkpoint.every=3", "name=cut"), stop_after_step=4)
    monkeypatch.undo()
    old = cut.run_dir / "checkpoints" / "step-000003"
    assert "optim.param_groups.0.lr" in dcp.FileSystemReader(old).read_metadata().state_dict_metadata
    resumed = run(tiny(6, "checkpoint.every=3", "name=cut"))
    assert resumed.report["resumed_from"].endswith("step-000003")
    assert losses(resumed.run_dir) == losses(full.run_dir)[3:]
    new = resumed.run_dir / "checkpoints" / "step-000006"  # written by name again
    assert "optim.param_groups.0.lr" not in dcp.FileSystemReader(new).read_metadata().state_dict_metadata


def test_auto_resume_skips_a_checkpoint_of_a_different_config(tiny):
    from rich.console import Console

    run(tiny(8, "checkpoint.every=4"), stop_after_step=5)
    console = Console(record=True, width=400)
    other = train(load_config(DEFAULT_CONFIG, tiny(8, "checkpoint.every=4", "train.seed=1")), console=console)
    assert other.report["resumed_from"] is None
    # which value differs is said (a new user was told only that one did)
    said = " ".join(console.export_text().split())
    assert "has checkpoints of another training" in said and "train.seed: 0 there, 1 now" in said, said


def test_a_raised_collective_timeout_resumes_and_so_does_a_checkpoint_hashed_with_the_timeouts(tiny):
    """A trial raised parallel.timeout_s after a hang and the rerun started again from step 0: the timeouts
    were part of the training hash. A checkpoint written before they left it still resumes."""
    import yaml

    from accelrun.config.resolve import training_hash_before_2026_12_07

    cut = run(tiny(8, "checkpoint.every=4", "name=hang"), stop_after_step=5)
    resumed = run(tiny(8, "checkpoint.every=4", "name=hang", "parallel.timeout_s=900", "parallel.init_timeout_s=60"))
    assert resumed.report["resumed_from"] == str(cut.run_dir / "checkpoints" / "step-000004")

    older = run(tiny(8, "checkpoint.every=4", "name=older"), stop_after_step=5).run_dir
    ckpt = older / "checkpoints" / "step-000004"
    state = json.loads((ckpt / "train_state.json").read_text())
    legacy = training_hash_before_2026_12_07(yaml.safe_load((older / "config.yaml").read_text()))
    assert state["training_hash"] != legacy
    (ckpt / "train_state.json").write_text(json.dumps({**state, "training_hash": legacy}))  # as written before
    again = run(tiny(8, "checkpoint.every=4", "name=older"))
    assert again.report["resumed_from"] == str(ckpt)


def test_a_new_run_from_another_runs_checkpoint_trains_with_its_own_optimizer_settings(tiny):
    """A new user's run from another run's checkpoint with lr 0.001 trained at the old run's 0.003 schedule,
    its weight decay and betas (the checkpoint's param groups), and said nothing."""
    from rich.console import Console

    from accelrun.train.optim import lr_factor

    first = run(tiny(6, "checkpoint.every=3", "name=first", "train.optimizer.lr=0.003"), stop_after_step=3)
    ckpt = first.run_dir / "checkpoints" / "step-000003"
    console = Console(record=True, width=400)
    recipe = tiny(8, "checkpoint.every=4", "name=second", f"checkpoint.resume={ckpt}", "train.optimizer.lr=0.001",
                  "train.optimizer.weight_decay=0.5", "train.optimizer.betas=[0.8, 0.9]")
    second = train(load_config(DEFAULT_CONFIG, recipe), console=console)
    cfg = load_config(DEFAULT_CONFIG, recipe).config
    rows = {m["step"]: m["lr"] for m in read_metrics(second.run_dir / "metrics.jsonl")}
    assert sorted(rows) == [4, 5, 6, 7, 8]
    for step, lr in rows.items():  # the recipe's peak and schedule from the first step on
        assert lr == pytest.approx(0.001 * lr_factor(step - 1, cfg.train.lr_schedule, 8), rel=1e-6), (step, lr)
    said = " ".join(console.export_text().split())
    assert "note: the optimizer goes on with this recipe's settings (lr: 0.003 -> 0.001" in said, said
    assert "betas: (0.9, 0.95) -> (0.8, 0.9)" in said and "weight_decay: 0.1 -> 0.5" in said, said
    # the hashes' note names what differs, and says "may" (a layout alone changes only the order of sums)
    assert "train.optimizer.betas: [0.9, 0.95] there, [0.8, 0.9] now, train.optimizer.lr: 0.003 there, 0.001 now" \
        in said and "so the losses may differ from a continuous run's" in said, said


def test_explicit_resume_path(tiny):
    first = run(tiny(6, "checkpoint.every=3", "name=a"), stop_after_step=3)
    ckpt = first.run_dir / "checkpoints"
    nxt = run(tiny(6, "checkpoint.every=3", "name=b", f"checkpoint.resume={first.run_dir}"))
    assert nxt.report["first_step"] == 4 and nxt.report["resumed_from"] == str(ckpt / "step-000003")


def test_killed_save_leaves_no_trusted_checkpoint(tiny, tmp_path, monkeypatch):
    import accelrun.train.checkpoint as ck

    real_save = ck.dcp.save
    calls = {"n": 0}

    def dying_save(state, checkpoint_id):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save dies half-way: shards written, no marker, no rename
            real_save(state, checkpoint_id=checkpoint_id)
            raise KeyboardInterrupt("killed during save")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(ck.dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run(tiny(8, "checkpoint.every=3", "name=k"))
    monkeypatch.setattr(ck.dcp, "save", real_save)
    (killed,) = list((tmp_path / "runs" / "k").iterdir())
    assert [c.step for c in complete_checkpoints(killed / "checkpoints")] == [3]
    assert list((killed / "checkpoints").glob(".tmp-*"))  # the partial save is there, untrusted
    resumed = run(tiny(8, "checkpoint.every=3", "name=k"))
    assert resumed.report["first_step"] == 4
    assert not list((killed / "checkpoints").glob(".tmp-*"))  # cleaned up on resume


NAN_MODEL = '''
import torch
from torch import nn

class Exploding(nn.Module):
    """A tiny LM whose output turns to NaN on its {n}-th forward."""
    def __init__(self, vocab=320):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.out = nn.Linear(16, vocab)
        self.calls = 0
    def forward(self, x):
        self.calls += 1
        y = self.out(self.emb(x))
        return y * float("nan") if self.calls >= {n} else y

def build(**kw):
    return Exploding(**kw)
'''


def test_nan_loss_stops_with_last_good_checkpoint_intact(tiny, tmp_path, monkeypatch):
    (tmp_path / "nanmodel.py").write_text(NAN_MODEL.replace("{n}", "6"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TrainingDiverged) as e:
        run(tiny(10, "checkpoint.every=2", "model.custom=nanmodel:build", "name=nan"))
    assert "the loss became nan at step 6" in str(e.value) and "step-000004" in str(e.value)
    (d,) = list((tmp_path / "runs" / "nan").iterdir())
    assert [c.step for c in complete_checkpoints(d / "checkpoints")] == [2, 4]
    report = json.loads((d / "report.json").read_text())
    assert report["status"] == "diverged" and report["last_step"] == 5
    assert all(math.isfinite(x) for x in losses(d))


def test_bf16_mixed_and_activation_checkpointing_train(tiny):
    ref = run(tiny(3, "name=fp32", "checkpoint.enabled=false"))
    ac = run(tiny(3, "name=ac", "checkpoint.enabled=false", "train.activation_checkpoint.mode=full"))
    # Recomputing activations changes nothing numerically.
    assert losses(ac.run_dir) == pytest.approx(losses(ref.run_dir), rel=1e-5)
    bf16 = run(tiny(3, "name=bf16", "checkpoint.enabled=false", "train.precision=bf16-mixed"))
    assert losses(bf16.run_dir) == pytest.approx(losses(ref.run_dir), rel=2e-2)


def test_grad_accumulation_matches_one_big_batch(tiny):
    big = run(tiny(3, "name=big", "checkpoint.enabled=false"))
    acc = run(tiny(3, "name=acc", "checkpoint.enabled=false", "train.micro_batch=2"))
    assert losses(acc.run_dir) == pytest.approx(losses(big.run_dir), rel=1e-5)


def test_seed_decides_the_run(tiny):
    a = run(tiny(2, "name=s0", "checkpoint.enabled=false"))
    b = run(tiny(2, "name=s0b", "checkpoint.enabled=false"))
    c = run(tiny(2, "name=s1", "checkpoint.enabled=false", "train.seed=1"))
    assert losses(a.run_dir) == losses(b.run_dir) != losses(c.run_dir)


def test_threads_setting_is_applied(tiny):
    before = torch.get_num_threads()
    try:
        run(tiny(1, "checkpoint.enabled=false", "train.threads=1"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_probe_below_achieved_rate_is_flagged_and_forgotten(tiny, tmp_path, monkeypatch):
    import accelrun.train.setup as setup
    from accelrun.report.peak import Peak

    cache = tmp_path / "peak.json"
    cache.write_text("{}")
    monkeypatch.setattr(setup, "resolve_peak", lambda *a, **k: Peak(1e-9, "measured: fake", "", str(cache)))
    report = run(tiny(3, "checkpoint.enabled=false")).report
    assert report["mfu"] > 1 and not cache.exists()
    assert any("MFU above 100%" in n for n in report["notes"])


def test_inductor_backend_matches_eager(tiny):
    # Inductor compiles each transformer block once (the first step: ~30-45 s on a 2-core CPU).
    eager = run(tiny(3, "name=eager", "checkpoint.enabled=false"))
    compiled = run(tiny(3, "name=inductor", "checkpoint.enabled=false", "compile.backend=inductor"))
    assert losses(compiled.run_dir) == pytest.approx(losses(eager.run_dir), rel=1e-5)
    assert compiled.report["compile_time_s"] is not None and compiled.report["compiled"].startswith("2 transformer")


def test_resuming_a_checkpoint_of_another_model_is_a_clear_error(tiny):
    from accelrun.config import ConfigError

    first = run(tiny(2, "name=small", "checkpoint.every=2"))
    with pytest.raises(ConfigError, match="does not fit this recipe's model"):
        run(tiny(4, "name=big", "model.dim=128", f"checkpoint.resume={first.run_dir}"))


def test_auto_resume_finds_the_matching_run_behind_a_newer_other_one(tiny):
    cut = run(tiny(8, "checkpoint.every=4", "name=m"), stop_after_step=5)
    run(tiny(8, "checkpoint.every=4", "name=m", "train.seed=3"), stop_after_step=5)  # newer, other config
    resumed = run(tiny(8, "checkpoint.every=4", "name=m"))
    assert resumed.report["resumed_from"] == str(cut.run_dir / "checkpoints" / "step-000004")


def test_auto_resume_never_takes_over_a_live_run(tiny, monkeypatch):
    import accelrun.train.resume as resume

    run(tiny(8, "checkpoint.every=4", "name=live"), stop_after_step=5)
    monkeypatch.setattr(resume, "is_running", lambda run_dir: True)
    assert run(tiny(8, "checkpoint.every=4", "name=live")).report["resumed_from"] is None


def test_a_stop_on_the_last_step_is_a_finished_run(tiny):
    result = run(tiny(3, "checkpoint.every=10"), stop_after_step=3)
    assert result.status == "finished" and (result.run_dir / "report.json").exists()


def test_env_records_the_thread_count_the_run_used(tiny):
    before = torch.get_num_threads()
    try:
        d = run(tiny(1, "checkpoint.enabled=false", "train.threads=1")).run_dir
        assert json.loads((d / "env.json").read_text())["cpu"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)


COUNTING_MODEL = '''
from torch import nn

class Counting(nn.Module):
    """Its output scales with a Python int it counts calls in: Dynamo compiles each new value."""
    def __init__(self, vocab=320):
        super().__init__()
        self.emb, self.out, self.calls = nn.Embedding(vocab, 16), nn.Linear(16, vocab), 0
    def forward(self, x):
        self.calls = min(self.calls + 1, 4)
        return self.out(self.emb(x)) * self.calls

def build():
    return Counting()
'''


def test_steps_that_recompiled_are_left_out_of_the_steady_figures(tiny, tmp_path, monkeypatch):
    """Only the first step was flagged as compiling: a recompile in a later step counted as a steady
    step (a walk's model with a call counter: 16 compiles, a 0.4 s median step against 0.03 s)."""
    (tmp_path / "counting.py").write_text(COUNTING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run(tiny(8, "model.custom=counting:build", "name=counting", "compile.backend=accelrun",
                      "compile.executors=[cpp,aten]", "report.warmup_steps=1"))  # fmt: skip
    flagged = [m["step"] for m in read_metrics(result.run_dir / "metrics.jsonl") if m.get("compile")]
    assert flagged == [1, 2, 3, 4, 5]  # each call found a new count (0 to 4); from the 6th on it stays 4
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["steady_steps"] == 3
    assert any("4 step(s) after warm-up included compilation" in n for n in report["notes"]), report["notes"]


def test_the_report_says_the_learning_rate_trained_with(tiny):
    """report.md showed no learning rate, so a short run that never reached train.optimizer.lr (the
    recipe's warm-up longer than the run) could not be told from one that did."""
    short = run(tiny(3, "train.optimizer.lr=1e-3", "train.lr_schedule.warmup_steps=6", "checkpoint.enabled=false"))
    row = next(line for line in (short.run_dir / "report.md").read_text().splitlines()
               if line.startswith("| learning rate |"))
    assert row == ("| learning rate | 0.000167 → 0.0005 (step 3) → 0.0005: train.optimizer.lr 0.001, cosine after 6 "
                   "warm-up steps; never reached: the warm-up is longer than the run's 3 steps |"), row
    whole = run(tiny(4, "train.optimizer.lr=1e-3", "train.lr_schedule.warmup_steps=1", "checkpoint.enabled=false"))
    row = next(line for line in (whole.run_dir / "report.md").read_text().splitlines()
               if line.startswith("| learning rate |"))
    assert "→ 0.001 (step 1) →" in row and "never reached" not in row, row


def test_a_finished_job_entered_again_does_not_print_its_old_summary_as_this_run_s(tmp_path):
    """A new user reran a finished two-node job with its --rdzv-id: the ranks trained nothing, and the
    launcher printed the finished run's "done: loss 6.2 -> 2.1; ... tok/s" as if the rerun had trained."""
    from rich.console import Console

    from accelrun.dist.launch import JobOutcome
    from accelrun.train.entry import _launched_result

    report = {"status": "finished", "steps": 300, "first_loss": 6.2, "final_loss": 2.1, "tokens_per_s_job": 9000.0,
              "step_time_s": {"median": 0.3}, "mfu": None}
    (tmp_path / "report.json").write_text(json.dumps(report))
    console = Console(record=True, width=200)
    again = _launched_result(tmp_path, JobOutcome(0, []), console, report_untouched=True)
    said = console.export_text()
    assert again.status == "nothing-to-do" and "done:" not in said, said
    assert "this job's run had finished before (300 steps, final loss 2.100); nothing was trained now" in said
    first = _launched_result(tmp_path, JobOutcome(0, []), console := Console(record=True, width=200))
    assert first.status == "finished" and "done: loss 6.200 → 2.100" in console.export_text()
    (tmp_path / "report.json").write_text(json.dumps({**report, "final_loss": None}))  # a run with no losses
    _launched_result(tmp_path, JobOutcome(0, []), console := Console(record=True, width=200), report_untouched=True)
    assert "(300 steps, final loss n/a); nothing was trained now" in console.export_text()


def test_a_job_folder_entered_again_after_its_run_finished_is_kept_and_another_training_refused(tiny):
    """A multi-node job's folder (runs/<name>/job-<id>) is entered again when the job is requeued. A
    new user reran a finished two-node job with the same --rdzv-id: "nothing to train", and the
    finished run's report, metrics and checkpoints were deleted with the folder; another recipe under
    the same id wrote its config over the finished run's. Both are refused now: the folder is kept,
    and another training exits 2 before anything is written."""
    from rich.console import Console

    from accelrun.config import ConfigError
    from accelrun.train.entry import _refuse_another_training
    from accelrun.train.run import run_in_dir

    resolved = load_config(DEFAULT_CONFIG, tiny(2, "checkpoint.every=2", "compile.backend=eager"))
    done = train(resolved)
    assert done.status == "finished" and complete_checkpoints(done.run_dir / "checkpoints")
    # as the requeued job's rank would: the same folder, its own checkpoint at the last step
    again = run_in_dir(resolved, done.run_dir, None, Console(quiet=True))
    assert again.status == "nothing-to-do"
    assert (done.run_dir / "report.json").is_file() and (done.run_dir / "metrics.jsonl").is_file()
    assert complete_checkpoints(done.run_dir / "checkpoints")
    # through train(), as a job's node enters its folder again: the finished run's records stay its own
    import accelrun.train.entry as entry

    before = {f: (done.run_dir / f).read_bytes() for f in ("config.yaml", "command.txt", "env.json")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(entry, "_run_dir_for", lambda resolved, launch: (done.run_dir, 0))
        rerun = train(load_config(DEFAULT_CONFIG, tiny(2, "checkpoint.every=2", "compile.backend=eager",
                                                        "report.log_every=7")), command="again")  # fmt: skip
    assert rerun.status == "nothing-to-do" and (done.run_dir / "report.json").is_file()
    assert {f: (done.run_dir / f).read_bytes() for f in before} == before
    _refuse_another_training(done.run_dir, resolved, "j1")  # the same training: continued, not refused
    other = load_config(DEFAULT_CONFIG, tiny(4, "checkpoint.every=2", "compile.backend=eager"))
    with pytest.raises(ConfigError, match=r"--rdzv-id j1: .* holds this job id's run of another training .*"
                                          r"with checkpoint.resume=.* to go on from its newest checkpoint"):
        _refuse_another_training(done.run_dir, other, "j1")


DROPOUT_MODEL = '''
from torch import nn

class Dropped(nn.Module):
    """A tiny LM with dropout: each step's masks come from torch's generator."""
    def __init__(self, vocab=320):
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(32, vocab)
    def forward(self, x):
        return self.out(self.drop(self.emb(x)).relu())

def build():
    return Dropped()
'''


@pytest.mark.parametrize("backend", ["eager", "accelrun"])
def test_a_resumed_run_draws_the_dropout_masks_an_uninterrupted_one_draws(tiny, tmp_path, monkeypatch, backend):
    # A new user's resumed run with dropout parted from the uninterrupted one at its first step after
    # the checkpoint: the generators started again from the seed, so the masks repeated the first steps'.
    (tmp_path / "dropmodel.py").write_text(DROPOUT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ("model.custom=dropmodel:build", "checkpoint.every=4", f"compile.backend={backend}")
    full = run(tiny(10, *common, "name=ref"))
    cut = run(tiny(10, *common, "name=cut"), stop_after_step=6)
    assert cut.status == "stopped"
    resumed = run(tiny(10, *common, "name=cut"))
    assert resumed.report["resumed_from"].endswith("step-000004") and resumed.report["first_step"] == 5
    ref = losses(full.run_dir)
    assert losses(resumed.run_dir) == ref[4:]
    assert (resumed.run_dir / "checkpoints" / "step-000008" / "rng" / "rank-00000.pt").is_file()
    if backend == "accelrun":  # the thing under test ran: the forward compiled, its masks drawn in a kernel
        assert full.report["compiler"]["passes_fired"].get("cpu_dropout"), full.report["compiler"]["passes_fired"]
        assert resumed.report["compiler"]["graphs_in_use"] > 0, resumed.report["compiler"]


def test_a_checkpoint_without_generator_state_resumes_and_says_its_masks_differ(tmp_path):
    from accelrun.train.checkpoint import restore_rng_state, save_rng_state

    torch.manual_seed(3)
    save_rng_state(tmp_path, 0)
    expected = torch.rand(4)
    torch.manual_seed(99)
    assert restore_rng_state(tmp_path, 0) is None and torch.equal(torch.rand(4), expected)
    why = restore_rng_state(tmp_path, 1)  # a job with more ranks than the one that wrote it
    assert why is not None and "no readable random-generator state for rank 1" in why and "dropout masks" in why
    # rank 0, which prints the note, says it for the job's other ranks too (a review)
    torch.manual_seed(99)
    why = restore_rng_state(tmp_path, 0, world_size=4)
    assert "for ranks 1-3" in why and torch.equal(torch.rand(4), expected)
    (tmp_path / "rng" / "rank-00000.pt").write_bytes(b"")  # cut short by a crash: said, not raised
    assert "for rank 0" in restore_rng_state(tmp_path, 0)


def test_a_run_resumed_after_its_models_code_changed_says_so(tiny, tmp_path, monkeypatch):
    # A new user edited a constant in their model's file between the stop and the restart: the run went on
    # from the old weights with the new code (the loss jumped from 2.4 to 8.9) and said nothing.
    import importlib
    import io
    import sys

    from rich.console import Console

    (tmp_path / "editedmodel.py").write_text(DROPOUT_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ("model.custom=editedmodel:build", "checkpoint.every=2", "name=edited")
    run(tiny(6, *common), stop_after_step=3)
    (tmp_path / "editedmodel.py").write_text(DROPOUT_MODEL.replace("nn.Dropout(0.3)", "nn.Dropout(0.1)"))
    sys.modules.pop("editedmodel", None)
    importlib.invalidate_caches()
    out = io.StringIO()
    resumed = run(tiny(6, *common), console=Console(file=out, width=400))
    assert resumed.report["first_step"] == 3
    assert ("note: the model's code changed since step-000002 was written (" in out.getvalue()
            and "editedmodel): its weights go on with the new code" in out.getvalue()), out.getvalue()
    # unchanged code says nothing of it
    out = io.StringIO()
    run(tiny(6, *common[:-1], "name=same"), stop_after_step=3)
    run(tiny(6, *common[:-1], "name=same"), console=Console(file=out, width=400))
    assert "resuming from" in out.getvalue() and "code changed" not in out.getvalue()


def test_a_value_left_unset_is_named_so_among_the_training_differences(tmp_path):
    """A trial's resume without train.threads=1 read "train.threads: 1 there, None now"."""
    from accelrun.train.resume import training_differences

    (tmp_path / "a.yaml").write_text("train: {threads: 1, seed: 0}\n")
    (tmp_path / "b.yaml").write_text("train: {threads: null, seed: 0}\n")
    assert training_differences(tmp_path / "a.yaml", tmp_path / "b.yaml") == ["train.threads: 1 there, unset now"]


def test_a_run_with_compile_dump_writes_its_compile_record_beside_the_dumps(tiny):
    """As `compile explain` does: a compiler engineer's trial found the dumps without record.json."""
    import json

    result = run(tiny(2, "compile.backend=accelrun", "compile.dump=true"))
    record = json.loads((result.run_dir / "compile" / "record.json").read_text())
    assert record["summary"]["dynamo_graphs"] > 0 and record["passes"] and record["regions"]
    assert {g["name"].split(".")[0] for g in record["graphs"]} <= set(record["traced_functions"])
    assert list((result.run_dir / "compile").glob("g0.forward/*.py"))


def test_a_run_that_fails_after_compiling_keeps_its_compile_record_beside_the_dumps(tiny, tmp_path, monkeypatch):
    """A trial's run that failed at its third step left the dumps of what compiled but no record.json:
    the one file that says which graphs, regions and fallbacks there were."""
    (tmp_path / "failsmodel.py").write_text(NAN_MODEL.replace('y * float("nan")', "y.view(-1, 7, 3)")
                                            .replace("{n}", "3"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        run(tiny(5, "model.custom=failsmodel:build", "compile.backend=accelrun", "compile.dump=true", "name=fails"))
    (d,) = list((tmp_path / "runs" / "fails").iterdir())
    record = json.loads((d / "compile" / "record.json").read_text())
    assert record["summary"]["dynamo_graphs"] > 0 and record["regions"]
    assert len(losses(d)) == 2


def test_a_checkpoint_goes_on_with_another_runs_own_data_from_its_start(tiny, tmp_path):
    """README: a checkpoint of another training "is a new run that goes on from that checkpoint with its own
    recipe". A trial's fine-tune on its own text was refused: "data state was saved on different data ...
    start afresh with checkpoint.resume=none", which leaves the weights behind."""
    from rich.console import Console

    first = run(tiny(4, "checkpoint.every=2"))
    (tmp_path / "mine.txt").write_text("my own text, which the checkpoint never saw. " * 200)
    console = Console(record=True, width=400)
    tuned = train(load_config(DEFAULT_CONFIG, tiny(6, "checkpoint.every=2", "data.source=text",
                                                   f"data.paths=[{tmp_path / 'mine.txt'}]", "name=tuned",
                                                   f"checkpoint.resume={first.run_dir / 'checkpoints' / 'step-000004'}")),
                  console=console)
    assert tuned.status == "finished" and tuned.report["resumed_from"].endswith("step-000004")
    said = " ".join(console.export_text().split())
    assert "its data position is in other data than this run's, which is read from its start" in said, said


LABELS_MODEL = '''
import torch
from torch import nn

class LabelsLM(nn.Module):
    def __init__(self, vocab=320):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, 16), nn.Linear(16, vocab)
    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        return logits if labels is None else (logits, nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))

def build(**kw):
    return LabelsLM(**kw)
'''


def test_a_forward_taking_labels_is_told_they_are_not_passed(tiny, tmp_path, monkeypatch):
    """A new user's forward(input_ids, labels=None) trained without its own loss and without a word."""
    from rich.console import Console

    (tmp_path / "labelslm.py").write_text(LABELS_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    console = Console(record=True, width=400)
    result = run(tiny(2, "model.custom=labelslm:build", "name=labels"), console=console)
    note = "LabelsLM.forward takes 'labels', which training does not pass"
    assert f"note: {note}" in console.export_text()
    assert any(n.startswith(note) for n in result.report["notes"]), result.report["notes"]


def test_a_finished_run_rerun_with_more_steps_is_told_how_to_continue_it(tiny):
    """A trial reran a finished 60-step run with train.steps=64: "starting fresh", without a word of the run
    whose checkpoints differ only in train.steps, nor of checkpoint.resume=<folder>."""
    from rich.console import Console

    first = run(tiny(4, "checkpoint.every=2", "name=extend"))
    console = Console(record=True, width=400)
    more = train(load_config(DEFAULT_CONFIG, tiny(6, "checkpoint.every=2", "name=extend")), console=console)
    assert more.report["resumed_from"] is None
    said = " ".join(console.export_text().split())
    assert (f"the finished run {first.run_dir} has checkpoints of another training" in said
            and "train.steps: 4 there, 6 now" in said and f"checkpoint.resume={first.run_dir} continues" in said), said
    # another value too: a new training, not said of a finished run
    console = Console(record=True, width=400)
    train(load_config(DEFAULT_CONFIG, tiny(6, "checkpoint.every=2", "name=extend", "train.seed=3")), console=console)
    assert "the finished run" not in " ".join(console.export_text().split())


def test_a_run_whose_ranks_were_restarted_says_so_in_its_report(tiny, monkeypatch):
    """A trial's job recovered from a killed rank (--max-restarts 1) and its report read a plain
    "finished": nothing said the steps after the checkpoint were run again."""
    import dataclasses

    from accelrun.dist.context import ParallelContext

    first = run(tiny(4, "checkpoint.every=2", "name=restarted"), stop_after_step=3)
    single = ParallelContext.single
    monkeypatch.setattr(ParallelContext, "single", classmethod(
        lambda cls, device: dataclasses.replace(single(device), restart_count=1)))
    again = run(tiny(4, "checkpoint.every=2", "name=restarted"))
    assert again.report["restarts"] == 1 and again.report["resumed_from"].endswith("step-000002"), again.report
    (note,) = [n for n in again.report["notes"] if n.startswith("the job's ranks were restarted")]
    assert f"the last restart went on from {first.run_dir / 'checkpoints' / 'step-000002'} at step 2" in note, note
    assert "restarted" in (again.run_dir / "report.md").read_text()
