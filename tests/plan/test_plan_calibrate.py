"""``accelrun plan --calibrate``: measure this machine (tiny probes, 2 gloo processes), then plan on it."""

from __future__ import annotations

import yaml
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config.schema import ClusterConfig
from accelrun.plan import calibrate as cal
from tests.conftest import DEFAULT_CONFIG

TINY_RECIPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
               "model.vocab_size=320", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=4"]


def test_calibrate_then_plan_on_this_machine(tmp_path, monkeypatch):
    runner = CliRunner()
    before = runner.invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", "cpu-local", *TINY_RECIPE])
    assert before.exit_code == 2 and "has not been measured yet" in before.output

    real = cal.calibrate
    monkeypatch.setattr(cal, "calibrate", lambda n: real(n, cal.ProbeSizes.quick()))
    out = tmp_path / "here.yaml"
    r = runner.invoke(cli, ["plan", "--calibrate", "--output", str(out)])
    assert r.exit_code == 0, r.output
    c = ClusterConfig.model_validate(yaml.safe_load(out.read_text())["cluster"])
    assert c.device == "cpu" and c.intra_node.measured and c.intra_node.bandwidth_gbs > 0
    assert set(c.calibration.matmul_tflops["fp32"]) == {32, 64}
    assert c.calibration.memory_bandwidth_gbs > 0 and c.calibration.runtime_gib > 0
    assert cal.cache_path(1).read_text() == out.read_text()

    for cluster in (str(out), "cpu-local"):  # the file, and the cache cpu-local reads
        r = runner.invoke(cli, ["plan", str(DEFAULT_CONFIG), "--cluster", cluster, *TINY_RECIPE])
        assert r.exit_code == 0, r.output
        assert "tokens/s per device" in r.output and "fits:" in r.output


def test_ranks_that_share_a_machine_report_the_slowest():
    fast = cal.Measured(matmul_tflops={"fp32": {64: 0.2}}, attention_tflops={"fp32": {128: 0.1}},
                        memory_bandwidth_gbs=10, runtime_gib=0.3, threads=1,
                        all_reduce_gbs=2.0, all_gather_gbs=1.0, latency_us=50)
    slow = cal.Measured(matmul_tflops={"fp32": {64: 0.1}}, attention_tflops={"fp32": {128: 0.05}},
                        memory_bandwidth_gbs=6, runtime_gib=0.25, threads=1)
    m = cal._combine([fast, slow], fast)
    assert m.matmul_tflops == {"fp32": {64: 0.1}} and m.attention_tflops == {"fp32": {128: 0.05}}
    assert m.memory_bandwidth_gbs == 6 and m.runtime_gib == 0.3
    c = ClusterConfig.model_validate(cal.describe(m, 2)["cluster"])
    assert c.devices_per_node == 2 and c.intra_node.bandwidth_gbs == 1.0  # the lower bus bandwidth
    assert c.calibration.threads_per_device == 1
