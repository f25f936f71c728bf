"""Every class of user error gives one clear message naming file, line and key."""

from __future__ import annotations

import re

import pytest

from accelrun.config import ConfigError, load_config
from accelrun.config.validate import TOKENIZER_VOCAB
from tests.conftest import REPO


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), search_dirs=[])
    return str(e.value)


def test_yaml_syntax_error_has_file_line_column(write):
    p = write("bad.yaml", "train:\n  steps: [1, 2\n")
    msg = error_of(p)
    assert msg.startswith(f"{p}:3:1: YAML syntax error")


def test_a_tab_and_a_key_indented_too_far_say_so(write):
    tab = error_of(write("tabs.yaml", "name: x\ntrain:\n\tsteps: 10\n"))
    assert "tabs.yaml:3:1: YAML syntax error" in tab and "(line 3, 'steps', is indented with a tab: YAML " \
        "indents with spaces)" in tab, tab
    indent = error_of(write("indent.yaml", "name: x\ntrain:\n  steps: 10\n   seq_len: 128\n"))
    assert "(line 4, 'seq_len', is indented 1 more than the line above, which opens no section" in indent, indent
    assert "(line" not in error_of(write("bad.yaml", "train:\n  steps: [1, 2\n"))  # no guess where none fits


def test_a_run_name_that_cannot_name_a_folder_says_one_that_can():
    from tests.conftest import DEFAULT_CONFIG

    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, ["name=bad/name with space"])
    msg = str(e.value)
    assert msg.endswith("name: 'bad/name with space' cannot name a run's folder: letters, digits, '.', '_' and '-', "
                        "starting with a letter or digit; name=bad-name-with-space"), msg  # (not pydantic's regex)


def test_unknown_top_level_key_suggests_nearest(write):
    p = write("bad.yaml", "name: x\ntrian:\n  steps: 3\n")
    msg = error_of(p)
    assert f"{p.resolve()}:2: unknown key 'trian'; did you mean 'train'?" in msg


def test_unknown_nested_key_suggests_nearest(write):
    p = write("bad.yaml", "train:\n  optimizer:\n    lrr: 0.1\n")
    assert f"{p.resolve()}:3: unknown key 'train.optimizer.lrr'; did you mean 'train.optimizer.lr'?" in error_of(p)


def test_a_key_one_section_too_high_is_pointed_down(write):
    """train.lr (other trainers' spelling) is train.optimizer.lr, not the nearest spelling in train
    (lr_schedule); warmup_steps lives in train.lr_schedule."""
    p = write("bad.yaml", "train:\n  lr: 0.1\n  warmup_steps: 10\n")
    msg = error_of(p)
    assert f"{p.resolve()}:2: unknown key 'train.lr'; did you mean 'train.optimizer.lr'?" in msg
    assert f"{p.resolve()}:3: unknown key 'train.warmup_steps'; did you mean 'train.lr_schedule.warmup_steps'?" in msg


def test_other_tools_names_for_a_key_point_at_it(write):
    """transformers' and torch's names (learning_rate, wd, batch_size, max_steps, num_layers), which no
    spelling distance finds, where the key lives or one section down."""
    p = write("bad.yaml", "train:\n  learning_rate: 0.1\n  batch_size: 4\n  max_steps: 9\n  optimizer:\n"
                          "    wd: 0.1\nmodel:\n  num_layers: 2\n")
    msg = error_of(p)
    for line, key, meant in ((2, "train.learning_rate", "train.optimizer.lr"), (3, "train.batch_size", "train.micro_batch"),
                             (4, "train.max_steps", "train.steps"), (6, "train.optimizer.wd", "train.optimizer.weight_decay"),
                             (8, "model.num_layers", "model.n_layers")):  # fmt: skip
        assert f"{p.resolve()}:{line}: unknown key '{key}'; did you mean '{meant}'?" in msg, (key, msg)


def test_the_repository_s_configs_folder_missing_says_what_it_is(tmp_path, monkeypatch):
    from accelrun.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)  # outside a clone
    with pytest.raises(ConfigError, match="configs/ is the accelrun repository's folder of example recipes") as e:
        load_config("configs/llama.yaml")
    # This accelrun runs from a clone: its file, which works from anywhere (a new user followed the hint
    # "give a recipe by name, e.g. model/debug" and trained without the compiler).
    assert str(REPO / "configs" / "llama.yaml") in str(e.value) and "model/debug" not in str(e.value)
    load_config(str(REPO / "configs" / "llama.yaml"))


def test_duplicate_key_is_an_error(write):
    p = write("bad.yaml", "train:\n  steps: 1\n  steps: 2\n")
    assert "duplicate key 'train.steps' (first set on line 2)" in error_of(p)


def test_a_duplicate_key_is_reported_with_the_recipe_s_other_errors(write):
    """One run of validate shows every problem: a duplicate key no longer stops the reading, so the
    misspelt key below it and the duplicate in the recipe it extends are in the same message."""
    write("base.yaml", "model:\n  dim: 64\n  dim: 32\n")
    p = write("bad.yaml", "extends: [./base.yaml]\ntrain:\n  steps: 1\n  steps: 2\n  optimizer:\n    lrr: 0.1\n")
    msg = error_of(p)
    assert "duplicate key 'model.dim' (first set on line 2)" in msg
    assert "duplicate key 'train.steps' (first set on line 3)" in msg
    assert f"{p.resolve()}:6: unknown key 'train.optimizer.lrr'" in msg
    assert len(msg.splitlines()) == 3, msg


def test_a_duplicate_key_alone_is_still_an_error(write):
    p = write("dup.yaml", "extends: [compile/eager]\ntrain:\n  steps: 2\n  steps: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'train.steps'"):
        load_config(p)


@pytest.mark.parametrize(
    "text, line, expect",
    [
        ("train:\n  steps: -5\n", 2, "train.steps: input should be greater than 0 (got -5); the nearest valid value is 1"),
        ("report:\n  log_every: 2.5\n", 2, "fractional part (got 2.5); the nearest valid value is 3"),
        ("checkpoint:\n  every: 0\n", 2, "checkpoint.every: input should be greater than 0 (got 0); to switch "
                                          "checkpoint off: checkpoint.enabled=false"),
        ("checkpoint:\n  keep: 0\n", 2, "checkpoint.keep: input should be greater than 0 (got 0); the nearest "
                                         "valid value is 1"),
        ("train:\n  optimizer:\n    lr: -1\n", 3, "train.optimizer.lr: input should be greater than 0 (got -1)"),
        ("train:\n  steps: many\n", 2, "train.steps: input should be a valid integer"),
        ("train:\n  precision: bf16\n", 2, "did you mean 'bf16-mixed'?"),
        ("train:\n  optimizer:\n    betas: [0.9, 1.5]\n", 3, "train.optimizer.betas.1: input should be less than 1"),
        ("model:\n  custom: not-an-import-path\n", 2, 'expected "package.module:factory"'),
    ],
)
def test_wrong_type_or_range_points_at_the_line(write, text, line, expect):
    p = write("bad.yaml", text)
    msg = error_of(p)
    assert msg.startswith(f"{p.resolve()}:{line}: ") and expect in msg
    assert msg.endswith(expect) or "nearest" not in msg.partition(expect)[2], msg  # no hint beyond the one asserted
    if "lr:" in text:
        assert "nearest" not in msg and "switch" not in msg, msg  # a fraction's nearest valid value is not said


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["model.dim=250"], "model.dim = 250 (override 'model.dim=250') is not divisible by model.n_heads = 8 "
                            "(default); model.dim=256 (a multiple of 16: an even head dimension)"),
        (["model.n_heads=5"], "is not divisible by model.n_heads = 5 (override 'model.n_heads=5'); model.dim=260 (a "
                              "multiple of 10: an even head dimension) or model.n_heads=4"),
        (["model.n_kv_heads=3"], "model.n_heads = 8 (default) is not divisible by model.n_kv_heads = 3 (override "
                                 "'model.n_kv_heads=3'); model.n_kv_heads=2 divides it"),
        (["train.micro_batch=5"], "train.global_batch = 16 (default) is not divisible by train.micro_batch = 5"),
        (["train.grad_accum=3"], "not divisible by train.grad_accum = 3 (override 'train.grad_accum=3') × data-parallel"),
        (["train.micro_batch=4", "train.grad_accum=3"], "train.grad_accum = 3 (override 'train.grad_accum=3') × train.micro_batch"),
        (["train.seq_len=4096"], "train.seq_len = 4096 (override 'train.seq_len=4096') exceeds model.max_seq_len"),
        (["model.vocab_size=200"], "smaller than the byte tokenizer's 258 ids"),
        (["parallel.tp=2"], "do not multiply to the world size parallel.nnodes × parallel.nproc_per_node = 1"),
        (["parallel.nproc_per_node=4", "parallel.tp=-1"], "at most one parallel degree may be -1"),
        (["parallel.nproc_per_node=3", "parallel.tp=3", "parallel.dp_shard=1"], "must both be divisible by parallel.tp = 3 (override 'parallel.tp=3'): each rank holds whole heads; parallel.tp may be 1 ("),
        (["parallel.nproc_per_node=8", "parallel.pp=8", "parallel.dp_shard=1"], "fewer than pipeline stages 8"),
        # validated, launched, and failed on every rank when torch built the schedule (a trial's)
        (["parallel.nproc_per_node=2", "parallel.pp=2", "parallel.dp_shard=1", "parallel.microbatches=1"],
         "parallel.microbatches = 1 (override 'parallel.microbatches=1') with parallel.pp_schedule = 1f1b (default): "
         "the schedule needs at least one micro-batch per pipeline stage (2); parallel.microbatches may be 2 or 3, "
         "or parallel.pp_schedule=gpipe (any count)"),
        (["parallel.nproc_per_node=2", "parallel.pp=2", "parallel.dp_shard=1", "parallel.microbatches=5",
          "parallel.pp_schedule=interleaved_1f1b", "train.global_batch=10", "train.micro_batch=10"],
         "the schedule runs micro-batches in rounds (their count // parallel.pp = 5 // 2 = 2), and their count is a "
         "multiple of the rounds; parallel.microbatches may be 1 or 2, or parallel.pp_schedule=gpipe (any count)"),
        # the counts suggested also split train.micro_batch (pp 4, micro-batch 6: 1-3 are the schedule's no; review)
        (["parallel.nproc_per_node=4", "parallel.pp=4", "parallel.dp_shard=1", "parallel.microbatches=5",
          "train.global_batch=6", "train.micro_batch=6"],
         "is not divisible by parallel.microbatches = 5 (override 'parallel.microbatches=5'): each micro-batch the "
         "schedule runs is a whole share of it; parallel.microbatches may be 6, or train.micro_batch 5, 10, 15, 20"),
        # trained until DTensor's mm refused the uneven shards on every rank (a trial)
        (["parallel.nproc_per_node=2", "parallel.tp=2", "parallel.dp_shard=1", "compile.backend=eager",
          "model.ffn_dim=511"], "model.ffn_dim = 511 (override 'model.ffn_dim=511') is not divisible by tensor-parallel "
                                "degree 2: each rank holds an equal share of the feed-forward's hidden units; "
                                "model.ffn_dim=510 or model.ffn_dim=512"),
        # said its own value twice and no way out (a new user's trial)
        (["parallel.nproc_per_node=2", "parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch=1"],
         "train.micro_batch = 1 (override 'train.micro_batch=1') is not divisible by parallel.microbatches = 2 "
         "(parallel.pp's): each micro-batch the schedule runs is a whole share of it; train.micro_batch 2, 4, 6, 8"),
    ],
)
def test_inconsistent_values_name_every_key(write, overrides, expect):
    p = write("ok.yaml", "name: x\n")
    assert expect in error_of(p, overrides)


def test_batch_must_divide_by_data_parallel_degree(write):
    p = write("ok.yaml", "name: x\n")
    msg = error_of(p, ["parallel.nproc_per_node=2", "train.global_batch=16", "train.micro_batch=16"])
    assert "× data-parallel degree 2" in msg
    assert "train.micro_batch may be one of 1, 2, 4, 8" in msg and "leave it unset to take 8" in msg


def test_unset_micro_batch_is_the_per_rank_share_of_the_global_batch(write):
    p = write("ok.yaml", "name: x\n")
    for ranks, micro in ((1, 16), (2, 8), (4, 4)):
        cfg = load_config(p, [f"parallel.nproc_per_node={ranks}"], search_dirs=[]).config
        assert (cfg.train.micro_batch, cfg.grad_accum) == (micro, 1)
    cfg = load_config(p, ["parallel.nproc_per_node=2", "train.grad_accum=2"], search_dirs=[]).config
    assert (cfg.train.micro_batch, cfg.grad_accum) == (4, 2)
    msg = error_of(p, ["parallel.nproc_per_node=3"])
    assert "not divisible by the data-parallel degree 3; nearest train.global_batch that works: 15 or 18" in msg


def test_several_problems_are_reported_together(write):
    p = write("bad.yaml", "train:\n  steps: 0\n  seed: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, search_dirs=[])
    assert len(e.value.messages) == 2


def test_bad_overrides(write):
    p = write("ok.yaml", "name: x\n")
    assert "expected key.path=value or ~key.path" in error_of(p, ["steps"])
    assert "nothing to remove at 'train.nope'" in error_of(p, ["~train.nope"])
    assert "override 'trian.steps=3': unknown key 'trian'; did you mean 'train'?" in error_of(p, ["trian.steps=3"])
    assert "not a dotted key path" in error_of(p, ["train..steps=3"])


def test_tokenizer_vocab_matches_the_data_package():
    from accelrun.data.tokenizer import ByteTokenizer

    assert TOKENIZER_VOCAB["byte"] == ByteTokenizer().vocab_size


def test_misspelt_key_in_a_mix_entry_is_one_line_with_the_entrys_keys(write):
    """`wieght` in a data.mix entry: one message (not also 'weight: field required'), naming the file and
    line, the valid keys of a mix entry and the key meant, spelt as an override takes it (data.mix.1)."""
    p = write("mix.yaml", "data:\n  mix:\n    - paths: [a.jsonl]\n      weight: 0.7\n"
                          "    - source: text\n      paths: [a.txt]\n      wieght: 0.3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, [], search_dirs=[])
    assert e.value.messages == [
        f"{p.resolve()}:7: unknown key 'data.mix.1.wieght'; did you mean 'data.mix.1.weight'? "
        "(valid keys in data.mix.1: source, paths, text_field, weight)"]


def test_a_missing_mix_weight_with_no_near_spelling_is_still_required(write):
    p = write("mix.yaml", "data:\n  mix:\n    - paths: [a.jsonl]\n")
    assert "data.mix.0.weight: field required" in error_of(p)


def test_a_value_where_a_section_belongs_says_what_the_section_holds(write):
    """`train: 5` was "input should be a valid dictionary or instance of TrainConfig": a class name."""
    p = write("bad.yaml", "train: 5\n")
    msg = error_of(p)
    assert f"{p.resolve()}:1: train: expected a section of keys (steps, global_batch, micro_batch, grad_accum, " in msg
    assert "not a value (got 5)" in msg and "TrainConfig" not in msg
    p = write("opt.yaml", "train:\n  optimizer: adamw\n")
    assert "did you mean 'train.optimizer.name=adamw'?" in error_of(p)


def test_a_duplicate_key_in_an_override_s_value_is_an_error(write):
    p = write("ok.yaml", "extends: [compile/eager]\n")
    with pytest.raises(ConfigError, match=r"override 'train=\{steps: 1, steps: 2\}': duplicate key 'train.steps'"):
        load_config(p, ["train={steps: 1, steps: 2}"])


def test_a_mapping_without_a_space_after_its_colon_says_so(write):
    """A trial's 'model.kwargs={dims:64}' read as the key 'dims:64' and was refused as an unknown keyword."""
    p = write("ok.yaml", "extends: [compile/eager]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.optimizer={lr:1e-3}"])
    assert str(e.value) == ("override 'train.optimizer={lr:1e-3}': 'lr:1e-3' reads as a key with no value: YAML "
                            "needs a space after the colon, train.optimizer={lr: 1e-3}")
    with pytest.raises(ConfigError, match=re.escape("the colon, train={optimizer: {lr: 1e-3}, steps: 3}")):  # nested
        load_config(p, ["train={optimizer: {lr:1e-3}, steps: 3}"])
    load_config(p, ["train.optimizer={lr: 1e-3}"])  # spaced: fine


def test_several_mistakes_are_listed_down_the_file(write):
    """One message per mistake, in the file's line order (the schema's order read 5, 4, 3, 7; found by
    a new user), a duplicate key among them."""
    p = write("bad.yaml", "data:\n  sourc: text\nmodel:\n  dimm: 3\ntrain:\n  stpes: 3\n  stpes: 4\n"
                          "  optimizer:\n    lr: abc\n")
    lines = [int(line.split(":")[1]) for line in error_of(p).splitlines()]
    assert lines == [2, 4, 7, 7, 9], error_of(p)  # the misspelt key where it was set last
