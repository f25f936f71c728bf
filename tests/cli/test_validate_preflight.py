"""`accelrun validate` catches what `train` catches before the first tensor (issue 30, item 3): data.paths
that match no files, a model.hf folder without weights, more processes than the node has GPUs (exit 2)
or cores (the same warning as train's); and model.hf given a run folder points at its hf/ (item 5)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import preflight
from tests.conftest import DEFAULT_CONFIG

HF_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 128, "vocab_size": 512}


def validate(*overrides: str):
    return CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), *overrides])


def test_data_paths_that_match_no_files_exit_2(tmp_path):
    r = validate("data.source=text", f"data.paths=[{tmp_path}/none*.txt]")
    assert r.exit_code == 2, r.output
    assert f"error: data.paths: '{tmp_path}/none*.txt' matched no files (override 'data.paths=" in r.stderr


@pytest.mark.parametrize("source, path", [("text", "corpus/a.txt"), ("documents", "corpus/docs.jsonl")])
def test_a_relative_path_that_matches_nothing_says_where_it_was_looked_for(tmp_path, monkeypatch, source, path):
    monkeypatch.chdir(tmp_path)
    r = validate(f"data.source={source}", f"data.paths=[{path}]")
    assert r.exit_code == 2 and f"(looked for in the current folder, {tmp_path})" in r.stderr, r.stderr


def test_a_misspelt_path_gets_the_file_beside_it_spelt_alike(tmp_path, monkeypatch):
    """Keys misspelt got "did you mean"; paths did not (my/doc.jsonl beside my/docs.jsonl)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "docs.jsonl").write_text('{"text": "hello"}\n')
    for name in ("part0.txt", "part1.txt"):
        (tmp_path / "my" / name).write_text("hello\n")
    r = validate("data.source=documents", "data.paths=[my/doc.jsonl]")
    assert r.exit_code == 2 and "matches no file or folder (did you mean 'my/docs.jsonl'?)" in r.stderr, r.stderr
    r = validate("data.source=text", "data.paths=[my/part0.tx]")
    assert r.exit_code == 2 and "(did you mean 'my/part0.txt'?)" in r.stderr, r.stderr
    r = validate("data.source=text", "data.paths=[my/part.txt]")  # two alike: neither is offered
    assert r.exit_code == 2 and "did you mean" not in r.stderr, r.stderr
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG.with_name("lama.yaml"))])
    assert r.exit_code == 2 and f"(did you mean '{DEFAULT_CONFIG}'?)" in r.stderr, r.stderr


def test_several_paths_in_one_string_get_the_list_spelling(tmp_path):
    r = validate("data.source=text", f"data.paths={tmp_path}/a.txt,{tmp_path}/b.txt")
    assert r.exit_code == 2
    assert f"several paths are a list: 'data.paths=[{tmp_path}/a.txt, {tmp_path}/b.txt]'" in r.stderr, r.stderr


def test_record_files_given_to_the_text_source_exit_2_naming_documents(tmp_path):
    """``text`` reads files byte by byte: a .jsonl or .parquet file trained as its JSON or binary layout."""
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    r = validate("data.source=text", f"data.paths=[{tmp_path}/docs.jsonl, {tmp_path}/more/*.parquet]")
    assert r.exit_code == 2, r.output
    assert "error: data.source = text (override 'data.source=text') reads files as plain text" in r.stderr
    assert f"names record files ({tmp_path}/docs.jsonl, {tmp_path}/more/*.parquet): use data.source=documents" in r.stderr
    assert validate("data.source=documents", f"data.paths=[{tmp_path}/docs.jsonl]").exit_code == 0
    # the first message a user with a .jsonl meets (the default source reads no files) names documents too
    r = validate(f"data.paths=[{tmp_path}/docs.jsonl]")
    assert r.exit_code == 2 and "reads no files: use documents for .jsonl" in r.stderr, r.stderr


def test_record_files_a_glob_matches_are_refused_as_those_named_are(tmp_path):
    """A new user's ``data.paths=[my/mixed/*]`` under the text source was valid, and training read the
    folder's .jsonl and .parquet files as text, byte by byte; the same files named one by one exit 2."""
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "mixed" / "b.txt").write_text("hello world\n")
    r = validate("data.source=text", f"data.paths=[{tmp_path}/mixed/*]")
    assert r.exit_code == 2, r.output
    assert f"names record files ({tmp_path}/mixed/a.jsonl): use data.source=documents" in r.stderr, r.stderr
    assert validate("data.source=text", f"data.paths=[{tmp_path}/mixed/*.txt]").exit_code == 0


def test_an_empty_text_corpus_is_refused_by_validate_as_train_refuses_it(tmp_path):
    """validate said "valid" to an empty text file that train then refused."""
    (tmp_path / "empty.txt").write_text("")
    r = validate("data.source=text", f"data.paths=[{tmp_path}/empty.txt]")
    assert r.exit_code == 2, r.output
    assert f"error: the corpus is empty: {tmp_path}/empty.txt has no bytes of text (override 'data.paths=" in r.stderr


def test_text_files_given_to_the_documents_source_are_pointed_at_the_text_source(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    r = validate("data.source=documents", f"data.paths=[{tmp_path}/*.txt]")
    assert r.exit_code == 2 and "holds no record files" in r.stderr, r.stderr
    assert "its .txt files are plain text, which data.source=text reads (a file a document)" in r.stderr, r.stderr


def test_an_empty_file_a_glob_matches_beside_others_is_said_to_add_nothing(tmp_path):
    """It was skipped without a word (a new user's trial): a warning, exit 0, for text and records."""
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n' * 100)
    (tmp_path / "empty.jsonl").write_text("")
    r = validate("data.source=text", f"data.paths=[{tmp_path}/*.txt]")
    assert r.exit_code == 0 and f"warning: data.paths: {tmp_path}/b.txt is empty and adds nothing" in r.stderr
    r = validate("data.source=documents", f"data.paths=[{tmp_path}/*.jsonl]")
    assert r.exit_code == 0, r.output
    assert f"warning: data.paths: {tmp_path}/empty.jsonl holds no records and adds nothing" in r.stderr, r.stderr


def test_a_text_corpus_past_data_max_bytes_is_said_to_be_read_in_part(tmp_path, tiny):
    """Reading stops at data.max_bytes (64 MiB by default): a larger corpus trained on its first part
    without a word from validate, train or the report."""
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text(f"line {i} of the corpus. " * 2000)  # 44,000 bytes each
    paths = f"data.paths=[{tmp_path}/part*.txt]"
    r = validate("data.source=text", paths, "data.max_bytes=60000")
    assert r.exit_code == 0, r.output
    said = ("warning: data.max_bytes = 60,000 (override 'data.max_bytes=60000') reads 60,000 of the 132,000 "
            "bytes that data.paths names: 2 of its 3 file(s) read in part or not at all; data.max_bytes=null "
            "reads them all")
    assert said in " ".join(r.stderr.split()), r.stderr
    assert "data.max_bytes" not in validate("data.source=text", paths).stderr  # under the 64 MiB default
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2), "data.source=text", paths,
                                 "data.max_bytes=60000"])
    assert r.exit_code == 0, r.output
    assert "reads 60,000 of the 132,000 bytes" in " ".join(r.output.split())
    report = next((tmp_path / "runs").glob("*/*/report.md")).read_text()
    assert f"| data | text: {tmp_path}/part*.txt; packing concat; 60,000 of the 132,000 bytes of data.paths read (data.max_bytes) |" in report


def test_a_file_format_given_as_the_source_is_pointed_at_documents():
    r = validate("data.source=jsonl")
    assert r.exit_code == 2 and "did you mean 'documents'? (got 'jsonl')" in r.stderr, r.stderr


def test_python_dash_m_accelrun_runs_the_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "accelrun", "--help"], capture_output=True, text=True, check=True)
    assert "Usage: accelrun" in out.stdout or "Usage: python -m accelrun" in out.stdout, out.stdout


def test_text_files_that_are_all_empty_exit_2_when_read(tmp_path):
    """No bytes at all: one line, exit 2 (it was a KeyError from the token file's writer, exit 1)."""
    (tmp_path / "empty.txt").write_text("")
    from accelrun.config.schema import DataConfig
    from accelrun.data import DataError, load_stream

    cfg = DataConfig(source="text", paths=[str(tmp_path / "empty.txt")])
    with pytest.raises(DataError, match=rf"the corpus is empty: {tmp_path}/empty.txt has no bytes of text"):
        load_stream(cfg, vocab_size=512, seed=0)
    r = CliRunner().invoke(cli, ["data", "prepare", str(tmp_path / "empty.txt"), "-o", str(tmp_path / "e.tok")])
    assert r.exit_code == 2 and "the corpus is empty" in r.output + r.stderr, r.output


def test_an_hf_folder_without_weights_exits_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    r = validate(f"model.hf={tmp_path}")
    assert r.exit_code == 2, r.output
    assert f"model.hf: {tmp_path} holds no *.safetensors files" in r.stderr


def test_a_truncated_weight_file_exits_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    r = validate(f"model.hf={tmp_path}")
    assert r.exit_code == 2 and "model.safetensors: cannot read its safetensors header" in r.stderr, r.output


def test_more_processes_than_cores_warn_as_train_does(monkeypatch):
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    r = validate("parallel.nproc_per_node=4", "parallel.dp_shard=4", "train.device=cpu")
    assert r.exit_code == 0, r.output
    assert "warning: 4 process(es) × 1 thread(s) (train.threads auto) on 2 cores" in r.stderr


def test_more_processes_than_gpus_exit_2(monkeypatch):
    monkeypatch.setattr(preflight.Machine, "here", classmethod(lambda cls: cls(cores=16, cuda_devices=1)))
    r = validate("parallel.nproc_per_node=2", "parallel.dp_shard=2")
    assert r.exit_code == 2, r.output
    assert "parallel.nproc_per_node = 2, but this node has 1 CUDA device(s)" in r.stderr
    assert "override 'parallel.nproc_per_node=2'" in r.stderr
    assert validate("parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.device=cpu").exit_code == 0


def test_cuda_asked_for_on_a_node_without_it_exits_2(monkeypatch):
    """What `train` here stops on (before a run folder exists), validate finds too."""
    monkeypatch.setattr(preflight.Machine, "here", classmethod(lambda cls: cls(cores=2, cuda_devices=0)))
    r = validate("train.device=cuda")
    assert r.exit_code == 2 and ("error: train.device = cuda (override 'train.device=cuda'), but this node has no "
                                 "CUDA device") in r.stderr, r.stderr
    assert "`accelrun train RECIPE --dry-run` builds its ranks' layout" in " ".join(r.stderr.split())  # login nodes
    monkeypatch.setattr(preflight.Machine, "here", classmethod(lambda cls: cls(cores=2, cuda_devices=1)))
    assert "no CUDA device" not in validate("train.device=cuda").stderr


def test_profile_steps_after_the_last_step_warn():
    r = validate("train.steps=10", "report.profile_steps=[30, 40]")
    assert r.exit_code == 0 and "report.profile_steps = [30, 40] starts after train.steps = 10: nothing will be profiled" in r.stderr
    assert "profile_steps" not in validate("train.steps=10", "report.profile_steps=[5, 40]").stderr


def test_gpus_are_counted_without_torch(monkeypatch, tmp_path):
    for i in range(4):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(preflight, "NVIDIA_GPUS", tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert preflight.Machine.here().cuda_devices == 2
    monkeypatch.setattr(preflight, "NVIDIA_GPUS", tmp_path / "absent")
    assert preflight.Machine.here().cuda_devices == 0


def _run_folder(path, exported: bool):
    path.mkdir()
    (path / "config.yaml").write_text("name: x\n")
    (path / "command.txt").write_text("accelrun train configs/llama.yaml\n")
    if exported:
        (path / "hf").mkdir()
        (path / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    return path


def test_model_hf_given_a_run_folder_points_at_its_export(tmp_path):
    run = _run_folder(tmp_path / "run", exported=True)
    r = validate(f"model.hf={run}")
    assert r.exit_code == 2
    assert f"{run} is an accelrun run folder: its exported model is in {run}/hf/ (model.hf={run}/hf)" in r.stderr


def test_model_hf_given_an_unexported_run_folder_says_how_to_export(tmp_path):
    run = _run_folder(tmp_path / "run", exported=False)
    r = validate(f"model.hf={run}")
    assert r.exit_code == 2 and f"`accelrun export {run} --hf {run}/hf`" in r.stderr, r.stderr


def test_bf16_on_a_cpu_without_bf16_kernels_warns_unless_accelrun_runs_fp32_gemms(monkeypatch):
    """The products' answer comes from torch (train's Machine); validate's own count leaves it unasked."""
    no_kernels = classmethod(lambda cls: cls(cores=2, cuda_devices=0, cpu_bf16_gemm=False))
    monkeypatch.setattr(preflight.Machine, "here", no_kernels)
    for backend in ("eager", "inductor"):
        r = validate("train.precision=bf16-mixed", f"compile.backend={backend}")
        assert r.exit_code == 0, r.output
        assert "train.precision = bf16-mixed on a CPU without bf16 matrix kernels" in r.stderr, r.stderr
        assert f"compile.backend = {backend}" in r.stderr and "override 'train.precision=bf16-mixed'" in r.stderr
    r = validate("train.precision=bf16-mixed", "compile.passes=[dce]")  # accelrun without the pass
    assert "without bf16 matrix kernels" in r.stderr
    for quiet in (["train.precision=bf16-mixed"], ["compile.backend=eager"]):  # the default passes; fp32
        assert "bf16 matrix kernels" not in validate(*quiet).stderr
    r = validate("train.precision=bf16-mixed", "compile.scope=block")  # the head is left eager
    assert r.exit_code == 0, r.output
    assert "override 'compile.scope=block'" in r.stderr and "output head's" in r.stderr, r.stderr
    assert "bf16 matrix kernels" not in validate("train.precision=bf16-mixed", "compile.scope=loss").stderr
    with_kernels = classmethod(lambda cls: cls(cores=2, cuda_devices=0, cpu_bf16_gemm=True))
    monkeypatch.setattr(preflight.Machine, "here", with_kernels)
    assert "bf16 matrix kernels" not in validate("train.precision=bf16-mixed", "compile.backend=eager").stderr


def test_pass_names_reads_any_list_without_validating_it():
    from accelrun.config.compile_names import pass_names

    assert "cpu_half_gemm" in pass_names("default") and pass_names("none") == []
    # a pass registered at run time, options the schema would refuse, a malformed item: names still read
    listed = ["dce", {"name": "mine", "knob": 1}, {"cpu_half_gemm": None}, 42]
    assert pass_names(listed) == ["dce", "mine", "cpu_half_gemm"]


def test_ctrl_c_before_a_command_catches_signals_exits_130(monkeypatch):
    """click's own handling printed "Aborted!" and exited 1, which a scheduler reads as a crash."""
    import accelrun.cli.validate_cmd as validate_cmd

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate_cmd, "load", interrupted)
    r = validate()
    assert r.exit_code == 130 and "interrupted (exit 130)" in r.stderr, (r.exit_code, r.output)


def test_a_resume_path_that_does_not_exist_exits_2_in_validate_too(tmp_path):
    """`train` refused it after making (and removing) a run folder, while `validate` said valid."""
    r = validate(f"checkpoint.resume={tmp_path / 'nope'}")
    assert r.exit_code == 2, r.output
    assert (f"error: checkpoint.resume = {tmp_path / 'nope'} (override 'checkpoint.resume={tmp_path / 'nope'}'): "
            "no such checkpoint, run or checkpoints folder") in r.stderr, r.stderr
    assert validate(f"checkpoint.resume={tmp_path}").exit_code == 0  # what the folder holds, train checks
