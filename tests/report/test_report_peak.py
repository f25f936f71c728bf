import json
import re

import pytest
import torch

from accelrun.report import peak as peak_mod
from accelrun.report.gpu_table import GPU_PEAKS
from accelrun.report.peak import Peak, lookup_gpu_peak, resolve_peak

# Names as torch.cuda.get_device_name reports them, one or more per table entry.
KNOWN_NAMES = {
    "NVIDIA H100 80GB HBM3": ("NVIDIA H100 SXM5", 989.5, 67.0),
    "NVIDIA H100 PCIe": ("NVIDIA H100 PCIe", 756.5, 51.0),
    "NVIDIA H100 NVL": ("NVIDIA H100 NVL", 835.5, 60.0),
    "NVIDIA H200": ("NVIDIA H200 SXM", 989.5, 67.0),
    "NVIDIA H200 NVL": ("NVIDIA H200 NVL", 835.5, 60.0),
    "NVIDIA A100-SXM4-40GB": ("NVIDIA A100 40GB", 312.0, 19.5),
    "NVIDIA A100-PCIE-40GB": ("NVIDIA A100 40GB", 312.0, 19.5),
    "NVIDIA A100-SXM4-80GB": ("NVIDIA A100 80GB", 312.0, 19.5),
    "NVIDIA A100 80GB PCIe": ("NVIDIA A100 80GB", 312.0, 19.5),
    "NVIDIA L4": ("NVIDIA L4", 121.0, 30.3),
    "NVIDIA L40S": ("NVIDIA L40S", 362.05, 91.6),
    "NVIDIA A10": ("NVIDIA A10", 125.0, 31.2),
    "Tesla V100-SXM2-16GB": ("NVIDIA V100 SXM2", None, 15.7),
    "Tesla V100-PCIE-32GB": ("NVIDIA V100 PCIe", None, 14.0),
    "Tesla V100S-PCIE-32GB": ("NVIDIA V100S PCIe", None, 16.4),
    "NVIDIA GeForce RTX 4090": ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
    "AMD Instinct MI300X": ("AMD Instinct MI300X", 1307.4, 163.4),
}


class FakeLoad:
    """Stands in for machine_load.CpuWindow inside the probe: other processes used ``share`` of the CPU."""

    share = 0.0

    def others_share(self):
        return FakeLoad.share


@pytest.fixture
def fast_probe(monkeypatch):
    monkeypatch.delenv("ACCELRUN_NO_PEAK_PROBE", raising=False)
    monkeypatch.setattr(peak_mod, "PROBE_SIZE", 64)
    monkeypatch.setattr(peak_mod, "PROBE_REPEATS", 3)
    monkeypatch.setattr(peak_mod, "PROBE_REPEAT_S", 0.005)
    monkeypatch.setattr(peak_mod, "CpuWindow", FakeLoad)  # a quiet machine unless a test says otherwise
    FakeLoad.share = 0.0


def _no_probe(*args, **kwargs):
    raise AssertionError("the probe must not run")


@pytest.mark.parametrize("name", sorted(KNOWN_NAMES))
def test_lookup_known_gpu(name):
    entry, bf16, fp32 = KNOWN_NAMES[name]
    got = lookup_gpu_peak(name, "fp32")
    assert got.tflops == fp32
    assert got.source.startswith(f"table: {entry} (")
    assert any(w in got.source for w in ("datasheet", "data sheet", "whitepaper"))
    assert "non-tensor-core" in got.detail
    got = lookup_gpu_peak(name, "bf16-mixed")
    assert got.tflops == bf16
    if bf16 is None:
        assert got.source == "unknown" and "report.peak_tflops" in got.detail


def test_every_table_entry_is_exercised():
    assert {e.entry for e in GPU_PEAKS} == {v[0] for v in KNOWN_NAMES.values()}
    for e in GPU_PEAKS:
        assert e.datasheet
        assert e.bf16_tflops is None or e.bf16_tflops > e.fp32_tflops > 0


@pytest.mark.parametrize("name", [
    "NVIDIA A10G",  # no NVIDIA datasheet: deliberately not listed
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a slice of a known GPU
    "NVIDIA GH200 480GB",  # must not match H200
    "NVIDIA L40",  # must not match L40S or L4
    "NVIDIA GeForce RTX 4090 D",
    "Some Future GPU",
])
def test_lookup_unknown_gpu_gives_none_with_reason(name):
    got = lookup_gpu_peak(name, "bf16-mixed")
    assert got.tflops is None
    assert got.source == "unknown"
    assert "report.peak_tflops" in got.detail
    assert name.split()[1] in got.detail or "A10G" in got.detail


def test_lookup_rejects_unknown_precision():
    with pytest.raises(ValueError, match="precision"):
        lookup_gpu_peak("NVIDIA L4", "fp16")


def test_declared_wins(monkeypatch):
    monkeypatch.setattr(peak_mod, "_probe", _no_probe)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    for device in ("cpu", "cuda"):
        got = resolve_peak(torch.device(device), "bf16-mixed", declared_tflops=123.0)
        assert got == Peak(123.0, "declared (report.peak_tflops)", got.detail)


def test_resolve_cuda_from_table_and_unknown(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    got = resolve_peak(torch.device("cuda", 0), "bf16-mixed", None)
    assert got.tflops == 312.0 and got.source == "table: NVIDIA A100 80GB (NVIDIA A100 Tensor Core GPU datasheet)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Mystery Accelerator 9000")
    got = resolve_peak(torch.device("cuda", 0), "fp32", None)
    assert got.tflops is None and got.source == "unknown"
    assert "Mystery Accelerator 9000" in got.detail and "report.peak_tflops" in got.detail


def test_resolve_cuda_fp32_warns_when_tf32_is_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L4")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    got = resolve_peak(torch.device("cuda"), "fp32", None)
    assert got.tflops == 30.3 and "TF32" in got.detail


def test_other_device_types_are_unknown():
    got = resolve_peak(torch.device("meta"), "fp32", None)
    assert got.tflops is None and "report.peak_tflops" in got.detail


def test_no_probe_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELRUN_NO_PEAK_PROBE", "1")
    monkeypatch.setattr(peak_mod, "_probe", _no_probe)
    got = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    assert got.tflops is None and "ACCELRUN_NO_PEAK_PROBE" in got.detail
    assert not any(tmp_path.iterdir())


@pytest.fixture
def bf16_kernels(monkeypatch):
    """This CPU as one with bf16 matrix kernels, whatever it has (this project's AVX2 machines have none)."""
    import accelrun.torch_private

    monkeypatch.setattr(accelrun.torch_private, "cpu_has_half_gemm", lambda dtype: True)


def test_a_one_thread_probe_says_thread_not_threads(fast_probe, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path).source
    finally:
        torch.set_num_threads(threads)
    assert ", 1 thread, " in source and "1 threads" not in source


@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("bf16-mixed", "bfloat16")])
def test_cpu_probe_measures_then_reads_cache(fast_probe, bf16_kernels, monkeypatch, tmp_path, precision, dtype):
    first = resolve_peak(torch.device("cpu"), precision, None, cache_dir=tmp_path)
    assert first.tflops is not None and first.tflops > 0
    assert first.source.startswith(f"measured: {dtype} 64x64 matrix product probe, ")
    threads = torch.get_num_threads()
    assert (f"{threads} threads," if threads > 1 else "1 thread,") in first.source
    # the load is the probe's, at its time (read from the cache later, it is not now's)
    assert re.search(r"of the CPU while it was probed, measured \d{4}-\d\d-\d\dT", first.source), first.source
    assert "measured now" in first.detail and "not a datasheet peak" in first.detail
    files = list((tmp_path / "peak").glob("*.json"))
    assert len(files) == 1 and str(files[0]) in first.source
    assert json.loads(files[0].read_text())["key"]["dtype"] == dtype

    monkeypatch.setattr(peak_mod, "_probe", _no_probe)
    second = resolve_peak(torch.device("cpu"), precision, None, cache_dir=tmp_path)
    assert second.tflops == first.tflops and second.source == first.source
    assert "read from the cache" in second.detail


def test_bf16_without_bf16_kernels_takes_the_fp32_peak_and_says_why(fast_probe, monkeypatch, tmp_path):
    # A bf16 probe there times ATen's generic loop: bf16 runs read MFU of 350% (eager) and 4,600%
    # (accelrun's fp32 GEMMs) against it.
    import accelrun.torch_private

    monkeypatch.setattr(accelrun.torch_private, "cpu_has_half_gemm", lambda dtype: False)
    fp32 = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    bf16 = resolve_peak(torch.device("cpu"), "bf16-mixed", None, cache_dir=tmp_path)
    assert bf16.tflops == fp32.tflops and "read from the cache" in bf16.detail  # one probe, one entry
    assert bf16.source.startswith("measured: float32 (this CPU has no bf16 matrix kernels: its fastest "
                                  "bf16 products are fp32 GEMMs) 64x64 matrix product probe, ")
    assert len(list((tmp_path / "peak").glob("*.json"))) == 1


def test_cpu_probe_cache_is_per_dtype_and_survives_corruption(fast_probe, bf16_kernels, tmp_path):
    a = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    resolve_peak(torch.device("cpu"), "bf16-mixed", None, cache_dir=tmp_path)
    assert len(list((tmp_path / "peak").glob("*.json"))) == 2
    path = a.cache_file  # not parsed from the source: it says after the path which library set the rate
    with open(path, "w") as f:
        f.write("{not json")
    again = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    assert again.tflops > 0 and "measured now" in again.detail


def test_a_peak_that_could_not_be_cached_does_not_say_where_it_is_cached(fast_probe, tmp_path):
    """ACCELRUN_CACHE_DIR naming a file: the run said "(cached <a path under the file>)" (a new user's trial)."""
    (tmp_path / "a-file").write_text("")
    peak = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path / "a-file")
    assert peak.tflops > 0 and peak.cache_file is None
    assert "(not cached: its cache cannot be written)" in peak.source and "(cached " not in peak.source
    assert "not cached: " in peak.detail


def test_cache_dir_defaults_to_env(fast_probe, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "c"))
    got = resolve_peak(torch.device("cpu"), "fp32", None)
    assert str(tmp_path / "c" / "peak") in got.source


@pytest.fixture
def load(fast_probe):
    return FakeLoad


def test_a_probe_on_a_busy_machine_serves_this_run_only(load, monkeypatch, tmp_path):
    load.share = 0.45
    busy = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    assert busy.tflops > 0 and busy.cache_file is None
    assert busy.source.startswith("measured on a busy machine") and "45%" in busy.source
    assert "MFU is an upper bound" in busy.source and "not cached" in busy.detail
    assert not list((tmp_path / "peak").glob("*.json"))  # before: cached and used by every later run
    load.share = 0.02
    quiet = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    assert "measured now" in quiet.detail and "2%" in quiet.source
    (entry,) = (tmp_path / "peak").glob("*.json")
    assert json.loads(entry.read_text())["others_cpu_share"] == 0.02  # the load is kept with the figure
    monkeypatch.setattr(peak_mod, "_probe", _no_probe)
    assert "read from the cache" in resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path).detail


def _cache_entry(folder, threads, tflops, measured_at, share=None):
    """Write the entry measure_cpu_peak would have cached for ``threads`` threads, as it names it."""
    key = {"cpu": peak_mod.cpu_model_name(), "threads": threads, "dtype": "float32", "torch": torch.__version__,
           "version": peak_mod.PROBE_CACHE_VERSION}
    digest = peak_mod.hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    entry = {"key": key, "tflops": tflops, "size": 64, "repeats": 3, "measured_at": measured_at}
    if share is not None:
        entry["others_cpu_share"] = share
    (folder / "peak").mkdir(parents=True, exist_ok=True)
    (folder / "peak" / f"cpu-{digest}.json").write_text(json.dumps(entry))


def test_more_threads_measuring_less_than_fewer_is_stale(load, monkeypatch, tmp_path):
    """The walk-through's cache: 2 threads 0.040 TFLOP/s, 1 thread 0.083 (the 2-thread probe ran under
    load). The 2-thread entry is measured again; once measured quietly after the 1-thread one, it holds."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs 2 threads to compare against 1")
    _cache_entry(tmp_path, 1, 1e6, "2026-11-26T10:00:00Z")  # fewer threads, far above any real probe
    _cache_entry(tmp_path, threads, 0.040, "2026-11-26T09:00:00Z")
    got = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    assert "measured now" in got.detail and "taken under load" in got.detail, got.detail
    assert got.tflops != 0.040
    monkeypatch.setattr(peak_mod, "_probe", _no_probe)
    again = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)  # quiet, and newer: trusted
    assert "read from the cache" in again.detail and again.tflops == got.tflops


def test_mfu_from_a_busy_probe_says_it_is_an_upper_bound(load, tmp_path):
    import io
    from pathlib import Path

    from rich.console import Console

    from accelrun.report.summary import summarize
    from accelrun.train.run import _print_summary

    load.share = 0.5
    peak = resolve_peak(torch.device("cpu"), "fp32", None, cache_dir=tmp_path)
    metrics = [{"step": i, "step_time_s": 1.0, "loss": 1.0} for i in range(1, 6)]
    report = summarize(metrics, warmup_steps=1, peak=peak, flops_per_token=1e3, compile_time_s=None,
                       tokens_per_step=100)
    assert any("MFU is an upper bound" in n for n in report["notes"])
    report["tokens_per_s_job"] = report["tokens_per_s"]
    out = io.StringIO()
    _print_summary(Console(file=out, width=400), report, Path("run"))
    assert "(an upper bound: the peak was measured on a busy machine)" in out.getvalue()
    # Above 100% (a trial: "121.4% (an upper bound ...)"), it says the peak is too low instead.
    report["mfu"] = 1.214
    out = io.StringIO()
    _print_summary(Console(file=out, width=400), report, Path("run"))
    said = out.getvalue()
    assert "121.4% (above 100%: the peak, measured on a busy machine, is too low" in said, said
    assert "upper bound" not in said


def test_the_probe_leaves_torchs_generator_alone(fast_probe):
    """The probe runs on a machine's first run only (the cache holds the peak after): drawing its matrices
    from torch's generator shifted that run's dropout masks, so one seed gave two loss curves."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    peak_mod._probe(torch.float32)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_fp32_probe_times_onednn_beside_torch_mm_and_keeps_the_faster(fast_probe):
    """The compiler's cpu_gemm runs fp32 products through oneDNN where it beats MKL, so the peak is the
    faster of the two (a torch.mm-only peak could read below what the run achieved)."""
    fp32 = peak_mod._probe(torch.float32)
    assert set(fp32["tflops_by_library"]) == {"torch.mm", "oneDNN"}
    assert fp32["tflops"] == max(fp32["tflops_by_library"].values()) > 0
    assert fp32["library"] == max(fp32["tflops_by_library"], key=fp32["tflops_by_library"].get)
    assert set(peak_mod._probe(torch.bfloat16)["tflops_by_library"]) == {"torch.mm"}  # oneDNN inside already


def test_an_fp32_peak_is_not_cited_with_the_datasheets_bf16_note():
    """A trial's plan cited the H100's fp32 peak, 67 TFLOP/s, as "(BF16 1,979 with sparsity)"."""
    from accelrun.report.peak import lookup_gpu_peak

    fp32 = lookup_gpu_peak("NVIDIA H100 80GB HBM3", "fp32")
    assert fp32.tflops == 67.0 and "BF16" not in fp32.source and "H100 Tensor Core GPU datasheet" in fp32.source
    assert "(BF16 1,979 with sparsity)" in lookup_gpu_peak("NVIDIA H100 80GB HBM3", "bf16-mixed").source
