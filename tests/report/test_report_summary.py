import statistics

import pytest

from accelrun.report.markdown import render_report_md
from accelrun.report.peak import Peak
from accelrun.report.summary import percentile, summarize

PEAK = Peak(2.0, "declared (report.peak_tflops)", "")


def _step(i, t, *, compile=False, data=0.01, loss=None):
    return {"step": i, "loss": 10.0 - i if loss is None else loss, "lr": 1e-3, "grad_norm": 1.0,
            "step_time_s": t, "data_time_s": data, "tokens": 1000, "tokens_per_s": 1000 / t,
            "tflops": None, "mfu": None, "mem_peak_bytes": 100 + i, "compile": compile}


def test_percentile_interpolates():
    v = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(v, 50) == 3.0
    assert percentile(v, 10) == pytest.approx(1.4)
    assert percentile(v, 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0


def test_summarize_excludes_warmup_and_compile_steps():
    times = [9.0, 8.0, 7.0,            # warm-up
             0.10, 0.12, 0.11, 0.13,   # steady
             5.0,                      # a recompile after warm-up
             0.14, 0.10, 0.12]         # steady
    flags = [i in (0, 7) for i in range(len(times))]
    metrics = [_step(i + 1, t, compile=c, data=0.01) for i, (t, c) in enumerate(zip(times, flags, strict=True))]
    r = summarize(metrics, warmup_steps=3, peak=PEAK, flops_per_token=1e9, compile_time_s=4.5,
                  tokens_per_step=1000)
    steady = sorted([0.10, 0.12, 0.11, 0.13, 0.14, 0.10, 0.12])
    assert r["steps"] == 11 and r["steady_steps"] == 7 and r["excluded_compile_steps"] == 1
    assert r["step_time_s"]["median"] == pytest.approx(statistics.median(steady))
    assert r["step_time_s"]["p10"] == pytest.approx(percentile(steady, 10))
    assert r["step_time_s"]["p90"] == pytest.approx(percentile(steady, 90))
    assert r["tokens_per_s"] == pytest.approx(1000 / 0.12)
    assert r["tflops"] == pytest.approx(1e9 * 1000 / 0.12 / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops"] / 2.0)
    assert r["peak"]["source"] == "declared (report.peak_tflops)"
    assert r["compile_time_s"] == 4.5
    assert r["warmup_time_s"] == pytest.approx(9 + 8 + 7 + 5)
    assert r["total_time_s"] == pytest.approx(sum(times))
    assert r["data_share"] == pytest.approx(0.07 / sum(steady))
    assert r["mem_peak_bytes"] == 111
    assert r["first_loss"] == 9.0 and r["final_loss"] == -1.0
    assert r["final_loss_mean"] == pytest.approx(statistics.mean(10.0 - i for i in range(2, 12)))
    assert any("recompile" in n for n in r["notes"])


def test_summarize_too_few_steps_says_so():
    metrics = [_step(i + 1, 1.0) for i in range(2)]
    r = summarize(metrics, warmup_steps=3, peak=PEAK, flops_per_token=1e9, compile_time_s=None,
                  tokens_per_step=1000)
    assert r["steady_steps"] == 0
    assert r["step_time_s"] == {"median": None, "p10": None, "p90": None, "mean": None}
    assert r["tokens_per_s"] is None and r["mfu"] is None and r["data_share"] is None
    assert any("no steady-state steps" in n for n in r["notes"])

    few = summarize([_step(i + 1, 1.0) for i in range(5)], warmup_steps=3, peak=PEAK,
                    flops_per_token=None, compile_time_s=None, tokens_per_step=1000)
    assert few["step_time_s"]["median"] == 1.0
    assert any("only 2 steady-state steps" in n for n in few["notes"])

    empty = summarize([], warmup_steps=3, peak=PEAK, flops_per_token=None, compile_time_s=None,
                      tokens_per_step=1000)
    assert empty["steps"] == 0 and empty["final_loss"] is None and empty["loss_curve"] == []


def test_summarize_unknown_peak_and_flops():
    metrics = [_step(i + 1, 0.5) for i in range(10)]
    unknown = Peak(None, "unknown", "not in the table; declare report.peak_tflops")
    r = summarize(metrics, warmup_steps=0, peak=unknown, flops_per_token=2e9, compile_time_s=None,
                  tokens_per_step=1000)
    assert r["tflops"] == pytest.approx(2e9 * 2000 / 1e12) and r["mfu"] is None
    assert any("declare report.peak_tflops" in n for n in r["notes"])
    r = summarize(metrics, warmup_steps=0, peak=PEAK, flops_per_token=None, compile_time_s=None,
                  tokens_per_step=1000)
    assert r["tflops"] is None and r["mfu"] is None


def test_a_count_of_a_users_model_and_a_failed_one_say_where_the_flops_came_from():
    from accelrun.models.flop_count import COUNTED

    metrics = [_step(i + 1, 0.5) for i in range(10)]
    r = summarize(metrics, warmup_steps=0, peak=PEAK, flops_per_token=2.5e6, compile_time_s=None,
                  tokens_per_step=1000, flops_source=COUNTED)
    assert r["mfu"] == pytest.approx(2.5e6 * 2000 / 1e12 / 2.0)
    assert f"2.50 MFLOP per token, {COUNTED}" in r["notes"]
    r = summarize(metrics, warmup_steps=0, peak=PEAK, flops_per_token=None, compile_time_s=None,
                  tokens_per_step=1000, flops_source="counting its FLOPs on one sequence failed: ValueError: x")
    assert ("no FLOP count per token for this model (counting its FLOPs on one sequence failed: ValueError: x): "
            "TFLOP/s and MFU are null") in r["notes"]


def test_loss_curve_is_sampled_with_ends():
    metrics = [_step(i + 1, 0.1, loss=1.0 / (i + 1)) for i in range(300)]
    r = summarize(metrics, warmup_steps=3, peak=PEAK, flops_per_token=None, compile_time_s=None,
                  tokens_per_step=1000)
    curve = r["loss_curve"]
    assert 10 <= len(curve) <= 20
    assert curve[0]["step"] == 1 and curve[-1]["step"] == 300
    assert [p["step"] for p in curve] == sorted(p["step"] for p in curve)
    said = " ".join(render_report_md(r, {}).split())
    assert f"The loss at {len(curve)} of the run's 300 steps, spread evenly (to the nearest step), first and last included" in said
    short = summarize(metrics[:10], warmup_steps=3, peak=PEAK, flops_per_token=None, compile_time_s=None,
                      tokens_per_step=1000)
    assert len(short["loss_curve"]) == 10 and "steps, spread evenly (to the nearest step)" not in render_report_md(short, {})


def test_summarize_keeps_the_cuda_allocators_reserved_peak():
    metrics = [{**_step(i + 1, 0.1), "mem_reserved_bytes": 500 + i} for i in range(5)]
    r = summarize(metrics, warmup_steps=1, peak=PEAK, flops_per_token=None, compile_time_s=None, tokens_per_step=1000)
    assert r["mem_reserved_bytes"] == 504 and r["mem_peak_bytes"] == 105
    cpu = summarize([_step(i + 1, 0.1) for i in range(5)], warmup_steps=1, peak=PEAK, flops_per_token=None,
                    compile_time_s=None, tokens_per_step=1000)
    assert cpu["mem_reserved_bytes"] is None  # a CPU has no allocator reserve: not reported as 0


def test_an_mfu_above_100_percent_is_a_note_naming_the_peak():
    metrics = [_step(i + 1, 0.5) for i in range(10)]
    low = Peak(1.0, "measured: torch.mm bfloat16 probe", "")
    r = summarize(metrics, warmup_steps=0, peak=low, flops_per_token=2e9, compile_time_s=None, tokens_per_step=1000)
    assert r["mfu"] == pytest.approx(4.0)
    assert any(n.startswith("MFU is 400%: this run's 4 TFLOP/s exceed the peak") and "bfloat16 probe" in n
               for n in r["notes"]), r["notes"]
    fine = summarize(metrics, warmup_steps=0, peak=Peak(10.0, "declared", ""), flops_per_token=2e9, compile_time_s=None, tokens_per_step=1000)
    assert not any(n.startswith("MFU is") for n in fine["notes"])
