"""Multi-process layouts (gloo, CPU) against one process: same losses, step for step.

Every job goes through the real launcher: ``train()`` starts its ranks through torchrun's elastic
agent, as ``accelrun train`` does (started from this process: a CLI process per job would double
the cost of starting Python and torch). Each job is launched once and checked for several things
(losses, the report, and, for FSDP, the checkpoints another layout resumes from). Tolerance: fp32,
relative 1e-5 per step's loss (sharded reductions sum in a different order than one process does).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.dist.worker import cpu_rank_threads
from accelrun.report.metrics import read_metrics
from tests.conftest import DEFAULT_CONFIG
from tests.dist.jobs import FSDP2, LOSS_RTOL, jobs_once, losses, start_cli, tiny_overrides, train_job

STEPS = 4

# One job per layout family. Tensor parallelism: plain with FSDP (FSDP × TP), alone with sequence
# parallelism and the vocabulary-parallel loss. Pipeline: GPipe with an explicit (unbalanced) layer
# list on a 3-layer model, 1F1B with FSDP (PP × FSDP).
TP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"]
LAYOUTS = {
    "fsdp2": FSDP2,
    "tp2_sp_lossparallel": [*TP2, "parallel.sequence_parallel=true", "parallel.loss_parallel=true"],
    # (with its own train.threads: each rank's, which the forked ranks once left at torch's default)
    "hsdp2x1": ["parallel.nproc_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch=2",
                "train.threads=3"],
    "fsdp2_tp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2"],
    # (with gradient accumulation, 2 steps of 2 micro-batches: torch's scale_grads divided the earlier
    # steps' gradients again at each step, a trial's; losses drifted and the step-1 gradient norm was 0.75x)
    "pp2_gpipe_layers": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2",
                         "parallel.pp_schedule=gpipe", "model.n_layers=3", "parallel.pp_layers=[[0],[1,2]]",
                         "train.micro_batch=2"],
    "pp2_1f1b_fsdp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.pp=2",
                       "parallel.pp_schedule=1f1b", "train.micro_batch=2"],
}
WORLD = {"fsdp2_tp2": 4, "pp2_1f1b_fsdp2": 4}
MODEL = {"pp2_gpipe_layers": ["model.n_layers=3"]}  # the one-process reference trains the same model


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory):
    """layout_run(name) -> the run directory of that layout's job; each job runs once per module."""
    return jobs_once(tmp_path_factory.mktemp("layouts"), STEPS, LAYOUTS, "checkpoint.every=2")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, layout_run, reference):
    d = layout_run(layout)
    ref = reference(STEPS, *MODEL.get(layout, []))
    got, want = losses(d), ref.losses
    assert got == pytest.approx(want, rel=LOSS_RTOL), (got, want)
    norms = [[m["grad_norm"] for m in read_metrics(run / "metrics.jsonl")] for run in (d, ref.run_dir)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    report = json.loads((d / "report.json").read_text())
    world = WORLD.get(layout, 2)
    assert report["world_size"] == world and len(report["mem_peak_bytes_per_rank"]) == world
    assert all(m > 0 for m in report["mem_peak_bytes_per_rank"])
    # the highest rank's, and named (it was rank 0's: a pipeline's last stage read above the run's, a trial's)
    highest = max(range(world), key=lambda i: report["mem_peak_bytes_per_rank"][i])
    assert report["mem_peak_bytes"] >= max(report["mem_peak_bytes_per_rank"]) and report["mem_peak_rank"] == highest
    threads = 3 if layout == "hsdp2x1" else cpu_rank_threads(world)  # (one node: nproc_per_node = world)
    assert report["threads_per_rank"] == [threads] * world, (layout, report["threads_per_rank"])
    assert report["tokens_per_s_job"] == pytest.approx(report["tokens_per_s"] * world)
    # Each rank's own median step time, and a table of ranks in report.md.
    assert len(report["step_time_s_per_rank"]) == world and all(t > 0 for t in report["step_time_s_per_rank"])
    md = (d / "report.md").read_text()
    switches = {"tp2_sp_lossparallel": "tp 2; sequence parallel, loss parallel |", "pp2_gpipe_layers": "; gpipe schedule |",
                "pp2_1f1b_fsdp2": "; 1f1b schedule |"}  # (the degrees alone were said: a trial's)
    assert switches.get(layout, "| parallel degrees |") in md, md
    assert "## Ranks" in md and f"\n| {world - 1} | " in md and "tokens/s (job)" in md
    assert f"| peak memory (process RSS, the rank with the highest peak: rank {highest}) |" in md, md
    # the family's head and loss, whatever the layout (a pipeline's stages were read as logits; review)
    assert "| loss | the next-token cross-entropy of the model's head and loss as one step" in md, layout
    # Every target is in the loss (no chat masks), counted per device as the computed tokens are: under
    # TP and PP the report said "512 per step per device, 200% of the 256 computed" (a new user).
    assert all(m["loss_tokens"] == m["tokens"] for m in read_metrics(d / "metrics.jsonl")), layout
    assert report["loss_tokens_per_step"] == report["tokens_per_step"], layout
    # a pipeline's schedule interleaves forwards and backwards: one part (it read forward 90%, backward 0%)
    pipelined = layout.startswith("pp")
    assert ("forward and backward (interleaved by the pipeline schedule)" in report["step_breakdown_s"]) == pipelined
    assert ("backward" in report["step_breakdown_s"]) != pipelined, report["step_breakdown_s"]
    # Time blocked in collectives, every step, on rank 0: every layout communicates in every step.
    assert all(m["comm_s"] > 0 for m in read_metrics(d / "metrics.jsonl"))
    comm = report["comm_time_s"]
    assert comm["what"] == "communication (blocking, measured on rank 0)"
    assert comm["median"] > 0 and 0 < comm["share"] < 1
    assert "communication (blocking, measured on rank 0)" in (d / "report.md").read_text()
    # FSDP's exposed communication is part of the blocking it is listed under (a trial's report read 137 ms
    # exposed of 66 ms blocking: a synchronous call's time outside its wait was counted in one, not the other)
    for m in read_metrics(d / "metrics.jsonl"):
        if m.get("comm_exposed_s") is not None:
            assert m["comm_s"] >= m["comm_exposed_s"] - 1e-9, (layout, m)
    ov = report.get("comm_overlap")
    assert ov is None or ov["busy_s"] > 0, (layout, ov)  # no "0.0 ms / 0.0 ms, overlap n/a" where none was traced
    assert (ov is not None) == (layout in ("fsdp2", "fsdp2_tp2", "pp2_1f1b_fsdp2")), (layout, ov)  # FSDP's, traced


def test_explicit_pipeline_layers_decide_which_rank_holds_which_layer(layout_run):
    """pp_layers [[0], [1, 2]] puts layer 1 on the second stage (balanced would give [[0, 1], [2]]);
    the checkpoint says which rank wrote each parameter."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(layout_run("pp2_gpipe_layers") / "checkpoints" / "step-000004").read_metadata()
    writer = {index.fqn: info.relative_path.split("_")[2] for index, info in meta.storage_data.items()}
    ranks = {int(writer[fqn]) for fqn in writer if fqn.startswith("model.layers.1.")}
    assert ranks == {1}, {fqn: w for fqn, w in writer.items() if fqn.startswith("model.layers.")}


def test_checkpoint_of_two_ranks_resumes_in_one(layout_run, reference, tmp_path):
    """2 FSDP ranks -> 1 process, from the FSDP job's step-2 checkpoint. (1 process -> 2 ranks:
    the restart test in test_dist_faults.py starts its job from a one-process checkpoint.)"""
    two = layout_run("fsdp2")
    one = train_job(tmp_path / "runs", STEPS, "name=one-from-two", "checkpoint.every=2",
                    f"checkpoint.resume={two / 'checkpoints' / 'step-000002'}")
    assert one.report["first_step"] == 3
    assert [m["step"] for m in read_metrics(one.run_dir / "metrics.jsonl")] == [3, 4]
    assert losses(one.run_dir) == pytest.approx(reference(STEPS).losses[2:], rel=LOSS_RTOL)
    # One process: nothing to communicate, nothing measured.
    assert one.report["comm_time_s"] is None
    assert all("comm_s" not in m for m in read_metrics(one.run_dir / "metrics.jsonl"))


def test_a_pipeline_resumes_its_optimizer_settings_from_its_own_checkpoint(layout_run, reference, tmp_path):
    """Each stage's optimizer groups hold other parameters: saved by group index, the ranks' groups collided
    in the checkpoint and rank 0's came back without settings ("note: the optimizer goes on with this
    recipe's settings (lr: None -> 0.003, ...)" on an unchanged recipe; a new user's trial). Saved by
    parameter name, each stage gets its own back, and the losses go on as the one-process run's."""
    ckpt = layout_run("pp2_gpipe_layers") / "checkpoints" / "step-000002"
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert "optim.param_groups.layers.1.attention.wq.weight.lr" in keys and "optim.param_groups.0.lr" not in keys
    job = start_cli(*tiny_overrides(tmp_path / "runs", STEPS, "name=pp-again", *LAYOUTS["pp2_gpipe_layers"],
                                    f"checkpoint.resume={ckpt}"))
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0 and "resuming from" in out, out[-3000:]
    assert "the optimizer goes on" not in out, out[-3000:]
    (run,) = (tmp_path / "runs" / "pp-again").iterdir()
    assert losses(run) == pytest.approx(reference(STEPS, *MODEL["pp2_gpipe_layers"]).losses[2:], rel=LOSS_RTOL)


def test_unsupported_layout_fails_before_launch(tiny):
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2), "parallel.nproc_per_node=2",
                                 "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"])
    assert r.exit_code == 2 and "makes 4 stages, more than model.n_layers = 2" in r.output, r.output
    assert "launching" not in r.output


def test_user_error_in_a_rank_exits_2(tmp_path):
    # Through the CLI: its exit code is what is tested, and rank 0's message must reach its stderr.
    job = start_cli(*tiny_overrides(tmp_path / "runs", 2, "data.source=text", f"data.paths=[{tmp_path}/none*.txt]"),
                    *FSDP2)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 2 and "none*.txt" in out, out[-3000:]


def test_zero_bubble_trains_compiled_stages(tmp_path, reference):
    """zero_bubble runs each stage's backward in two halves (input gradients, then weight gradients),
    keeping its autograd graph between: a compiled stage refused that on the default recipe (AOTAutograd's
    donated buffers "require retain_graph=False"). Losses as one process's; the stages ran compiled."""
    job = train_job(tmp_path, STEPS, "name=zb-compiled", "parallel.nproc_per_node=2", "parallel.dp_shard=1",
                    "parallel.pp=2", "parallel.pp_schedule=zero_bubble", "model.n_layers=4", "checkpoint.enabled=false",
                    "compile.backend=accelrun", "compile.executors=[cpp,aten]")
    assert losses(job.run_dir) == pytest.approx(reference(STEPS, "model.n_layers=4").losses, rel=LOSS_RTOL)
    compiler = job.report["compiler"]
    assert compiler["dynamo_graphs"] >= 2 and compiler["regions_per_executor"].get("cpp", 0) > 0, compiler
