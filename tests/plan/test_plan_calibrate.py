"""``accelrun plan --calibrate``: measure this machine (tiny probes, 2 gloo processes), then plan on it."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config.schema import ClusterConfig
from accelrun.plan import calibrate as cal
from accelrun.plan.probes import fit_alpha_beta
from accelrun.report.machine_load import CpuWindow
from tests.conftest import DEFAULT_CONFIG

TINY_RECIPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
               "model.vocab_size=320", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=4"]


def test_calibrate_then_plan_on_this_machine(tmp_path, monkeypatch):
    runner = CliRunner()
    before = runner.invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", "cpu-local", *TINY_RECIPE])
    assert before.exit_code == 2 and "has not been measured yet" in before.output
    # a 2-process recipe is told to measure 2 and plan on them (it was told 1, which it then did not fit)
    two = runner.invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", "cpu-local", *TINY_RECIPE,
                              "parallel.nproc_per_node=2", "train.micro_batch=2"])
    said = " ".join(two.output.split())
    assert two.exit_code == 2 and "run `accelrun plan --calibrate --devices-per-node 2`" in said, two.output
    assert "then plan with cluster.devices_per_node=2" in said, two.output

    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda n: real(n, cal.ProbeSizes.quick()))
    out = tmp_path / "here.yaml"
    with monkeypatch.context() as busy:  # a neighbour took 42% of the CPU meanwhile: said, not silent
        busy.setattr(CpuWindow, "others_share", lambda self: 0.42)
        r = runner.invoke(cli, ["plan", "--calibrate", "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert "warning: other processes used 42% of this machine's CPU during the calibration" in r.output
    c = ClusterConfig.model_validate(yaml.safe_load(out.read_text())["cluster"])
    assert c.device == "cpu" and c.intra_node.measured and c.intra_node.bandwidth_gbs > 0
    assert c.calibration.others_cpu_share == 0.42  # plans say it (below)
    assert set(c.calibration.matmul_tflops["fp32"]) == {32, 64}
    assert set(c.calibration.attention_head_dim_tflops["fp32"]) == {8, 16}
    assert set(c.intra_node.collectives) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert c.calibration.memory_bandwidth_gbs > 0 and c.calibration.runtime_gib > 0
    assert cal.cache_path(1).read_text() == out.read_text()

    for cluster in (str(out), "cpu-local"):  # the file, and the cache cpu-local reads
        r = runner.invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", cluster, *TINY_RECIPE])
        assert r.exit_code == 0, r.output
        assert "tokens/s per device" in r.output and "fits:" in r.output
        assert "other processes used 42% of the CPU" in " ".join(r.output.split()), r.output

    # measure and plan in one call: with --json, stdout is the plan alone
    r = runner.invoke(cli, ["plan", "--calibrate", str(DEFAULT_CONFIG), *TINY_RECIPE, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["step_s"] > 0


def test_ranks_that_share_a_machine_report_the_slowest():
    fast = cal.Measured(matmul_tflops={"fp32": {64: 0.2}}, attention_tflops={"fp32": {128: 0.1}},
                        attention_head_dim_tflops={"fp32": {32: 0.2}},
                        memory_bandwidth_gbs=10, runtime_gib=0.3, threads=1,
                        all_reduce_gbs=2.0, all_gather_gbs=1.0, latency_us=50,
                        collectives={"reduce_scatter": (0.3, 900.0)})
    slow = cal.Measured(matmul_tflops={"fp32": {64: 0.1}}, attention_tflops={"fp32": {128: 0.05}},
                        attention_head_dim_tflops={"fp32": {32: 0.1}},
                        memory_bandwidth_gbs=6, runtime_gib=0.25, threads=1)
    m = cal._combine([fast, slow], fast)
    assert m.matmul_tflops == {"fp32": {64: 0.1}} and m.attention_tflops == {"fp32": {128: 0.05}}
    assert m.memory_bandwidth_gbs == 6 and m.runtime_gib == 0.3
    assert m.attention_head_dim_tflops == {"fp32": {32: 0.1}} and m.collectives == fast.collectives
    gpus = cal._combine([_gpu_measurement("NVIDIA H100 80GB HBM3", True)] * 2, _gpu_measurement("NVIDIA H100 80GB HBM3", True))
    assert gpus.device_name == "NVIDIA H100 80GB HBM3" and gpus.device_memory_gib == 79.1
    c = ClusterConfig.model_validate(cal.describe(m, 2)["cluster"])
    assert c.devices_per_node == 2 and c.intra_node.bandwidth_gbs == 1.0  # the lower bus bandwidth
    assert c.calibration.threads_per_device == 1
    assert c.intra_node.collectives["reduce_scatter"].latency_us == 900.0


@pytest.mark.parametrize("hops", [1, 2])
def test_collective_fit_recovers_latency_and_bandwidth(hops):
    n, bandwidth, latency = 4, 2e9, 300e-6  # bytes/s, s per hop
    moved = hops * (n - 1) / n

    def t(size: float) -> float:
        return hops * (n - 1) * latency + moved * size / bandwidth

    gbs, us = fit_alpha_beta([(16e6, t(16e6)), (1e6, t(1e6))], hops, n)
    assert gbs == pytest.approx(2.0) and us == pytest.approx(300.0)
    # timings too noisy for a positive slope: no latency, the larger message's rate
    gbs, us = fit_alpha_beta([(1e6, 0.02), (16e6, 0.01)], hops, n)
    assert us == 0.0 and gbs == pytest.approx(moved * 16e6 / 0.01 / 1e9)
    # a fit whose latency comes out at or below 0 takes the tiny message's measured per-hop time
    assert fit_alpha_beta([(1e6, 0.02), (16e6, 0.01)], hops, n, measured_us=42.0)[1] == 42.0
    assert fit_alpha_beta([(16e6, t(16e6) - 0.01), (1e6, t(1e6) - 0.01)], hops, n, measured_us=42.0)[1] == 42.0
    assert fit_alpha_beta([(16e6, t(16e6)), (1e6, t(1e6))], hops, n, measured_us=42.0)[1] == pytest.approx(300.0)


def _gpu_measurement(name: str, collectives: bool) -> cal.Measured:
    sizes = cal.ProbeSizes.for_gpu()
    return cal.Measured(
        matmul_tflops={"bf16": {1024: 400.0, 8192: 650.0}, "fp32": {1024: 40.0, 8192: 50.0}},
        attention_tflops={"bf16": {t: 300.0 for t in sizes.attention_seq}, "fp32": {t: 30.0 for t in sizes.attention_seq}},
        attention_head_dim_tflops={"bf16": {64: 250.0, 128: 300.0, 256: 280.0}},
        memory_bandwidth_gbs=2800.0, device_name=name, device_memory_gib=79.1,
        all_reduce_gbs=300.0 if collectives else 0.0, all_gather_gbs=320.0 if collectives else 0.0,
        latency_us=8.0, collectives={"all_gather": (330.0, 9.0), "reduce_scatter": (300.0, 9.0),
                                     "all_reduce": (310.0, 9.0)} if collectives else {})


def test_a_gpu_calibration_names_its_accelerator_and_plans():
    """What --calibrate writes on a CUDA machine (the measuring itself needs a GPU: not run here)."""
    from accelrun.config import load_config
    from accelrun.plan import predict, resolve_cluster

    one = ClusterConfig.model_validate(cal.describe(_gpu_measurement("NVIDIA H100 80GB HBM3", False), 1,
                                                   cal.ProbeSizes.for_gpu())["cluster"])
    assert one.device == "h100-sxm" and one.memory_gib == 79.1 and one.intra_node.bandwidth_gbs is None
    assert one.calibration.device_name == "NVIDIA H100 80GB HBM3" and one.calibration.runtime_gib is None
    cluster = resolve_cluster(one)
    assert cluster.intra is not None and "accelerator table" in cluster.intra.source  # one GPU: the table's link
    rates = cluster.rates("bf16-mixed")
    assert rates.matmul_tflops(8192) == 650.0 and rates.peak_source.startswith("dense bf16 peak of NVIDIA H100 SXM5, from accelrun's accelerator table")  # MFU: the datasheet
    assert rates.attention_tflops(1024, 64) == pytest.approx(300.0 * 250.0 / 300.0)  # curve at head dim 128

    eight = ClusterConfig.model_validate(cal.describe(_gpu_measurement("NVIDIA H100 80GB HBM3", True), 8,
                                                     cal.ProbeSizes.for_gpu())["cluster"])
    assert eight.intra_node.measured and "NCCL" in eight.sources["intra_node"]
    cfg = load_config("model/llama3-8b", ["train.precision=bf16-mixed", "train.seq_len=8192", "train.micro_batch=1",
                                          "train.global_batch=8", "parallel.nproc_per_node=8"]).config
    plan = predict(cfg, cluster=resolve_cluster(eight))
    assert plan.tokens_per_s > 0 and "79.1 GiB" in plan.verdict  # no checkpointing at 8192: over 80 GB

    odd = ClusterConfig.model_validate(cal.describe(_gpu_measurement("NVIDIA GeForce GTX 1080", False), 1)["cluster"])
    assert odd.device == "custom" and "matches no accelerator kind" in odd.sources["calibration"]
    assert resolve_cluster(odd).rates("bf16-mixed").peak_tflops == 650.0  # the best measured rate
    assert cal.cache_path(1, gpu="NVIDIA H100 80GB HBM3").name.startswith("gpu-")
    assert cal.cache_path(1, gpu="NVIDIA H100 80GB HBM3") != cal.cache_path(1)
