"""``accelrun plan`` as a user drives it: tables, verdicts, search lines, JSON, errors (exit 2)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from accelrun.cli.main import cli
from tests.conftest import DEFAULT_CONFIG

LLAMA_8B = ["model/llama3-8b", "data.source=synthetic", "train.seq_len=8192", "train.micro_batch=2",
            "train.global_batch=16", "train.precision=bf16-mixed", "parallel.nproc_per_node=8", "parallel.dp_shard=8"]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["plan", *map(str, args)])


def test_help_has_examples():
    r = invoke("--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "--calibrate" in r.output and "--search" in r.output


def test_plan_prints_breakdowns_and_verdict():
    r = invoke(*LLAMA_8B, "train.micro_batch=1", "train.global_batch=8", "--cluster", "h100-8x", "--ac", "selective")
    assert r.exit_code == 0, r.output
    for text in ("memory per device", "activations", "step time per device", "matmuls", "FSDP (exposed)",
                 "tokens/s per device", "MFU", "fits:", "cluster figures", "checkpointing selective (--ac)"):
        assert text in r.output, text


def test_the_recipe_selects_selective_checkpointing_without_a_what_if():
    r = invoke(*LLAMA_8B, "train.micro_batch=1", "train.global_batch=8", "train.activation_checkpoint.mode=selective",
               "--cluster", "h100-8x")
    assert r.exit_code == 0, r.output
    assert "checkpointing selective;" in r.output, r.output
    assert "planner only" not in r.output and "cannot run" not in r.output


def test_does_not_fit_names_the_need_and_the_largest_term_and_exits_3():
    """A new user's `accelrun plan ... && accelrun train ...` went on to train a layout the plan had just
    said does not fit: the plan exited 0."""
    one_gpu = (*LLAMA_8B, "parallel.nproc_per_node=1", "parallel.dp_shard=1", "train.global_batch=2",
               "--cluster", "h100-8x")
    r = invoke(*one_gpu)
    assert r.exit_code == 3, r.output
    assert "does not fit: needs" in r.output and "device has 80.0 GiB; largest term:" in r.output
    as_json = invoke(*one_gpu, "--json")
    assert as_json.exit_code == 3 and json.loads(as_json.output)["plan"]["fits"] is False
    # the search finds layouts on the cluster's 8 GPUs that fit: the question --search asks is answered
    searched = invoke(*one_gpu, "--search", "--top", "1")
    assert searched.exit_code == 0, searched.output
    assert "does not fit" in searched.output and "best layouts" in searched.output
    # nothing fits one 80 GiB GPU: 405B's weights alone are 1.5 TiB in fp32
    nowhere = invoke("model/llama3-405b", "--cluster", "h100-8x", "cluster.devices_per_node=1",
                     "parallel.nproc_per_node=1", "--search", "--top", "1")
    assert nowhere.exit_code == 3, nowhere.output
    assert "no layout fits" in nowhere.output


def test_search_prints_override_lines(cluster_file):
    r = invoke(DEFAULT_CONFIG, "--cluster", cluster_file, "--search", "--top", "3")
    assert r.exit_code == 0, r.output
    assert "best layouts" in r.output and "parallel.dp_shard=" in r.output and "train.micro_batch=" in r.output


def test_json(cluster_file):
    r = invoke(DEFAULT_CONFIG, "--cluster", cluster_file, "--json", "--search", "--top", "2")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["plan"]["fits"] is True and data["plan"]["step_s"] > 0
    assert len(data["search"]["best"]) == 2 and "parallel.tp=" in data["search"]["best"][0]["overrides"]


def test_devices_lists_the_table():
    r = invoke("--devices")
    assert r.exit_code == 0 and "h100-sxm" in r.output and "mi300x" in r.output


def test_cluster_recipe_names_and_overrides(cluster_file):
    r = invoke(*LLAMA_8B, "parallel.nnodes=2", "parallel.dp_shard=16", "train.global_batch=32", "--cluster", "h100-8x",
               "cluster.nodes=2", "train.activation_checkpoint.mode=selective")
    assert r.exit_code == 0, r.output
    assert "2 × 8 h100-sxm" in r.output


def test_errors_exit_2_with_one_message(cluster_file, tmp_path):
    cases = [
        ([DEFAULT_CONFIG], "no cluster to plan for"),
        ([DEFAULT_CONFIG, "--cluster", "nope"], "recipe 'cluster/nope' not found"),
        ([DEFAULT_CONFIG, "--cluster", cluster_file, "cluster.device=h100"], "did you mean 'h100-sxm'"),
        ([DEFAULT_CONFIG, "--cluster", cluster_file, "cluster.devices_per_nod=2"],
         "did you mean 'cluster.devices_per_node'"),
        ([DEFAULT_CONFIG, "--cluster", cluster_file, "parallel.nproc_per_node=8", "parallel.dp_shard=8",
          "train.micro_batch=2"],
         "the cluster has cluster.nodes × cluster.devices_per_node = 2 × 4"),
        # and the cluster's key where the machine has them (a new user's 2 CPU processes on cpu-local)
        ([DEFAULT_CONFIG, "--cluster", cluster_file, "parallel.nproc_per_node=8", "parallel.dp_shard=8",
          "train.micro_batch=2"], "cluster.devices_per_node=8 on the command line"),
        ([DEFAULT_CONFIG, "--cluster", "h100-8x", "model.custom=pkg.mod:make"], "built-in model families"),
        ([], "needs CONFIG"),
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {device: h100-sxm}\ntrain: {steps: 3}\n")
    cases.append(([DEFAULT_CONFIG, "--cluster", bad], "holds one `cluster:` section; it also sets train"))
    for args, message in cases:
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert message in r.output, (message, r.output)
        assert "Traceback" not in r.output
