import json

from accelrun.report.files import write_json
from accelrun.report.markdown import sparkline, write_report_md
from accelrun.report.peak import Peak
from accelrun.report.summary import summarize

ENV = {
    "versions": {"python": "3.11.7", "torch": "2.13.0", "triton": None, "accelrun": "0.1.0"},
    "platform": "Linux", "hostname": "box",
    "cpu": {"model": "Test CPU 9000", "logical_cores": 8, "torch_threads": 4, "torch_interop_threads": 4},
    "cuda": {"available": False, "device_count": 0, "devices": []},
    "git": {"commit": "0123456789abcdef", "dirty": True},
}


def _report():
    metrics = [{"step": i, "loss": 5.0 - 0.01 * i, "step_time_s": 0.25 if i > 1 else 3.0,
                "data_time_s": 0.025, "mem_peak_bytes": 3 * 2**30, "compile": i == 1}
               for i in range(1, 51)]
    peak = Peak(0.5, "measured: torch.mm float32 1024x1024 probe on Test CPU | x", "achievable")
    return summarize(metrics, warmup_steps=3, peak=peak, flops_per_token=1e8, compile_time_s=2.5,
                     tokens_per_step=4096)


def test_markdown_has_headline_figures(tmp_path):
    report = _report()
    path = tmp_path / "report.md"
    write_report_md(report, {"name": "llama-tiny", "config_hash": "c0ffee12", "precision": "fp32"}, path,
                    env=ENV)
    md = path.read_text()
    assert md.startswith("# accelrun report: llama-tiny")
    assert "`c0ffee12`" in md
    assert "16,384" in md                        # tokens/s = 4096 / 0.25
    assert "327.7 %" in md                       # MFU = 1e8 * 16384 / 1e12 / 0.5
    assert "probe on Test CPU \\| x" in md       # peak source, pipe escaped inside the table
    assert "250.0 ms" in md                      # median step time
    assert "3.00 GiB" in md
    assert "2.50 s" in md                        # compile time
    assert "10.0 %" in md                        # data share
    assert "4.99 → 4.5" in md                   # first → final loss
    assert "| precision | fp32 |" in md
    assert "Test CPU 9000, 8 logical cores, torch threads 4" in md
    assert "0123456789ab (dirty)" in md
    assert "## Notes" in md and "achievable matrix-product rate" in md
    assert any(ch in md for ch in "▁█")


def test_markdown_handles_empty_report(tmp_path):
    report = summarize([], warmup_steps=3, peak=Peak(None, "unknown", "why"), flops_per_token=None,
                       compile_time_s=None, tokens_per_step=1)
    write_report_md(report, {"name": "x"}, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "n/a" in md and "no loss recorded" in md


def test_a_model_without_a_flop_count_says_why_where_its_mfu_would_be(tmp_path):
    metrics = [{"step": i, "loss": 5.0, "step_time_s": 0.25, "data_time_s": 0.0, "compile": False}
               for i in range(1, 11)]  # fmt: skip
    why = "counting its FLOPs on one sequence failed: AssertionError: needs 2 sequences"
    peak = Peak(0.5, "measured: torch.mm float32 1024x1024 probe on Test CPU", "achievable")
    report = summarize(metrics, warmup_steps=3, peak=peak, flops_per_token=None, compile_time_s=None,
                       tokens_per_step=4096, flops_source=why)
    report["model"] = {"flops_source": why}  # as train's report carries it (model_summary)
    write_report_md(report, {"name": "x"}, tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert f"| MFU | n/a (no FLOP count per token: {why}) |" in md
    assert "achievable matrix-product rate" not in md  # no MFU to explain


def test_sparkline():
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([1.0, 1.0]) == "▁▁"
    assert sparkline([1.0, float("nan"), 2.0]) == "▁×█"


def test_write_json_is_atomic_and_readable(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_json({"a": 1}, path)
    write_json({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_markdown_shows_the_reserved_peak_only_where_measured(tmp_path):
    report = _report()
    write_report_md(report, {"name": "x"}, tmp_path / "cpu.md")
    assert "peak reserved" not in (tmp_path / "cpu.md").read_text()
    report["mem_reserved_bytes"] = 5 * 2**30
    write_report_md(report, {"name": "x"}, tmp_path / "gpu.md")
    assert "| peak reserved (CUDA allocator) | 5.00 GiB |" in (tmp_path / "gpu.md").read_text()


def test_warm_up_time_names_a_later_compiling_step_only_when_there_was_one(tmp_path):
    """`first 3 steps`, not `first 3 steps + 0 compile steps`; a recompile after warm-up is named as such."""
    def warmup_row(compiled_at: set[int]) -> str:
        metrics = [{"step": i, "loss": 5.0, "step_time_s": 0.25, "compile": i in compiled_at} for i in range(1, 21)]
        report = summarize(metrics, warmup_steps=3, peak=Peak(None, "unknown", "why"), flops_per_token=None,
                           compile_time_s=None, tokens_per_step=1)
        write_report_md(report, {"name": "x"}, tmp_path / "r.md")
        (row,) = [line for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| warm-up time")]
        return row

    assert warmup_row({1}).endswith("(first 3 steps) |")
    assert warmup_row({1, 9}).endswith("(first 3 steps + 1 later step that compiled) |")
    assert warmup_row({1, 9, 12}).endswith("(first 3 steps + 2 later steps that compiled) |")


def test_a_share_below_whole_and_a_run_shorter_than_its_warm_up_are_said_as_they_are():
    """A new user read "4,089 ... 100% of the 4,096 computed" and "warm-up time (first 5 steps)" for a run of 3."""
    from accelrun.report.markdown import _loss_tokens, _warmup_steps_text

    assert "99.8% of its 4,096" in _loss_tokens({"loss_tokens_per_step": 4089, "tokens_per_step": 4096})
    assert "100% of its 4,096" in _loss_tokens({"loss_tokens_per_step": 4096, "tokens_per_step": 4096})
    assert "50% of its 4,096" in _loss_tokens({"loss_tokens_per_step": 2048, "tokens_per_step": 4096})
    assert "99.99% of its 8,192" in _loss_tokens({"loss_tokens_per_step": 8191, "tokens_per_step": 8192})
    # not "computed": under tensor parallelism each device of a group works on all the group's tokens
    said = _loss_tokens({"loss_tokens_per_step": 4096, "tokens_per_step": 4096})
    assert "computed" not in said and "the job's tokens over its devices" in said
    assert _warmup_steps_text({"warmup_steps": 5, "steps": 3}) == "first 3 steps"
    assert _warmup_steps_text({"warmup_steps": 5, "steps": 1}) == "first 1 step"
    assert _warmup_steps_text({"warmup_steps": 5, "steps": 30}) == "first 5 steps"


def test_the_peak_memory_row_says_what_it_is_a_peak_of():
    """A CPU run's peak is the process's resident memory, a GPU run's the tensors allocated: a new user
    compared the two as if both were tensors."""
    from accelrun.report.markdown import headline_rows

    assert ("peak memory (process RSS)", "1.00 GiB") in headline_rows({"device": "cpu", "mem_peak_bytes": 2**30})
    job = headline_rows({"device": "cpu", "mem_peak_bytes": 2**30, "mem_peak_rank": 3})
    assert ("peak memory (process RSS, the rank with the highest peak: rank 3)", "1.00 GiB") in job
    labels = [label for label, _ in headline_rows({"device": "cuda:0", "mem_peak_bytes": 2**30})]
    assert "peak memory (tensors allocated)" in labels


def test_the_experts_row_says_eager_dispatch_only_where_something_compiled():
    """A trial's eager run read "the dispatch ... runs eagerly under compile"."""
    from accelrun.report.router import router_section

    router = {"tokens_per_expert": [3, 1], "aux_loss_first": 1.2, "aux_loss_final": 1.0, "imbalance_step_median": 1.1,
              "imbalance_step_max": 1.5, "imbalance_run": 1.2, "dropped_tokens": 0, "dropped_frac": 0.0,
              "ep_local_experts": 2, "ep_all_to_all_per_step": 8}
    eager = "\n".join(router_section({"router": router, "compiled": "nothing (eager)"}))
    compiled = "\n".join(router_section({"router": router, "compiled": "4 transformer blocks with accelrun"}))
    assert "| expert parallel | 2 experts per layer on each rank; 8 all-to-alls per step on rank 0 |" in eager, eager
    assert "runs eagerly under compile" in compiled and "under compile" not in eager
