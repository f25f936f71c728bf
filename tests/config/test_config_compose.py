"""Composition: extends order, deep merge, overrides, removal, provenance, hashes, search path."""

from __future__ import annotations

import re

import pytest

from accelrun.config import ConfigError, load_config
from accelrun.config.search import list_recipes


def test_extends_merge_in_order_then_file_then_overrides(write, tmp_path):
    recipes = tmp_path / "recipes"
    write("recipes/a.yaml", """
        train:
          steps: 10
          seed: 1
        """)
    write("recipes/sub/b.yaml", """
        train:
          steps: 20
          micro_batch: 4
          global_batch: 4
        """)
    cfg = write("run.yaml", """
        extends: [a, sub/b]
        name: mine
        train:
          seed: 7
        """)
    rc = load_config(cfg, ["train.steps=30"], search_dirs=[recipes])
    t = rc.config.train
    assert (t.steps, t.seed, t.micro_batch) == (30, 7, 4)
    assert str(rc.sources[("train", "seed")]) == f"{cfg.resolve()}:4"
    assert str(rc.sources[("train", "micro_batch")]) == f"{(recipes / 'sub/b.yaml').resolve()}:3"
    assert str(rc.sources[("train", "steps")]) == "override 'train.steps=30'"
    assert rc.files == [(recipes / "a.yaml").resolve(), (recipes / "sub/b.yaml").resolve(), cfg.resolve()]


def test_relative_path_extends_and_single_string(write, tmp_path):
    write("base/common.yaml", "train: {steps: 5}\n")
    cfg = write("x/run.yaml", "extends: ../base/common.yaml\n")
    assert load_config(cfg, search_dirs=[]).config.train.steps == 5


def test_lists_replace_and_mappings_merge(write, tmp_path):
    write("recipes/a.yaml", "train: {optimizer: {lr: 0.5, betas: [0.1, 0.2]}}\n")
    cfg = write("run.yaml", "extends: [a]\ntrain: {optimizer: {betas: [0.3, 0.4]}}\n")
    opt = load_config(cfg, search_dirs=[tmp_path / "recipes"]).config.train.optimizer
    assert opt.lr == 0.5 and opt.betas == (0.3, 0.4)


def test_override_values_are_yaml_and_can_remove_and_index(write, tmp_path):
    cfg = write("run.yaml", "train: {steps: 5, grad_clip: 0.5, optimizer: {betas: [0.9, 0.99]}}\n")
    rc = load_config(cfg, ["train.precision=bf16-mixed", "~train.grad_clip", "train.optimizer.betas.1=0.9",
                           "train.optimizer={lr: 0.25}"], search_dirs=[])
    t = rc.config.train
    assert t.precision == "bf16-mixed"
    assert t.grad_clip == 1.0  # removed: back to the schema default
    assert str(rc.sources.get(("train", "grad_clip"), "default")) == "default"
    assert t.optimizer.betas == (0.9, 0.9) and t.optimizer.lr == 0.25


def test_an_exponent_without_a_point_is_a_float_in_free_form_values_too(write):
    """PyYAML reads ``1e-9`` as a string (YAML 1.1); a user's factory got "1e-9" through model.kwargs and
    failed in its own code. It is a float, as in YAML 1.2, JSON and Python, in a file and an override."""
    cfg = write("run.yaml", "model: {custom: examples.my_model:build, kwargs: {eps: 1e-6}}\ntrain: {steps: 5}\n")
    rc = load_config(cfg, ["model.kwargs.clip=1e-9", "model.kwargs.big=3E5", "model.kwargs.tag='1e-9'"],
                     search_dirs=[])  # fmt: skip
    assert rc.config.model.kwargs == {"eps": 1e-6, "clip": 1e-9, "big": 3e5, "tag": "1e-9"}  # quoted: a string
    # A run's config.yaml, written by the launcher and read back by its ranks: the same values (PyYAML's
    # dumper wrote the string '1e-9' unquoted, and a rank read a float).
    named = load_config(cfg, ["name='1e5'", "model.kwargs.tag='1e-9'"], search_dirs=[])
    again = load_config(write("config.yaml", named.to_yaml()), [], search_dirs=[])
    assert again.config.name == "1e5" and again.config.model.kwargs["tag"] == "1e-9"
    assert again.training_hash == named.training_hash


def test_explain_lists_every_leaf_with_its_source(write):
    cfg = write("run.yaml", "name: x\ntrain:\n  steps: 3\n")
    rows = {k: str(s) for k, _, s in load_config(cfg, ["train.seed=4"], search_dirs=[]).explain()}
    assert rows["train.steps"].endswith("run.yaml:3")
    assert rows["train.seed"] == "override 'train.seed=4'"
    assert rows["model.dim"] == "default"


def test_hash_depends_on_values_not_on_how_they_were_written(write, tmp_path):
    a = write("a.yaml", "train: {steps: 5}\n")
    b = write("b.yaml", "# a comment\ntrain:\n  steps: 5\n")
    c = write("c.yaml", "train: {steps: 6}\n")
    ha, hb, hc = (load_config(p, search_dirs=[]).hash for p in (a, b, c))
    assert ha == hb != hc
    assert load_config(a, ["train.steps=6"], search_dirs=[]).hash == hc
    # Where results go does not change the training hash.
    rc = load_config(a, ["report.log_every=1", "checkpoint.every=7"], search_dirs=[])
    assert rc.training_hash == load_config(a, search_dirs=[]).training_hash and rc.hash != ha


def test_cycle_is_an_error_showing_the_chain(write, tmp_path):
    write("recipes/a.yaml", "extends: [b]\n")
    write("recipes/b.yaml", "extends: [a]\n")
    cfg = write("run.yaml", "extends: [a]\n")
    with pytest.raises(ConfigError, match=r"extends cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(cfg, search_dirs=[tmp_path / "recipes"])


def test_missing_recipe_lists_search_path_and_nearest(write, tmp_path):
    write("recipes/parallel/fsdp.yaml", "parallel: {dp_shard: -1}\n")
    cfg = write("run.yaml", "extends: [parallel/fsdq]\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, search_dirs=[tmp_path / "recipes", tmp_path / "other"])
    msg = str(e.value)
    assert "run.yaml:1" in msg and "'parallel/fsdq' not found" in msg
    assert str(tmp_path / "recipes") in msg and str(tmp_path / "other") in msg
    assert "did you mean 'parallel/fsdp'" in msg


def test_search_path_order_env_and_shadowing(write, tmp_path, monkeypatch):
    write("proj/recipes/model/x.yaml", "# project x\nmodel: {dim: 64}\n")
    write("team/model/x.yaml", "# team x\nmodel: {dim: 128}\n")
    write("team/model/y.yaml", "# team y\nmodel: {dim: 32}\n")
    monkeypatch.chdir(tmp_path / "proj")
    monkeypatch.setenv("ACCELRUN_RECIPE_PATH", str(tmp_path / "team"))
    cfg = write("proj/run.yaml", "extends: [model/x]\n")
    assert load_config(cfg).config.model.dim == 64
    cfg = write("proj/run2.yaml", "extends: [model/y]\n")
    assert load_config(cfg).config.model.dim == 32
    from accelrun.config import search_path

    entries = [e for e in list_recipes(search_path()) if e.name == "model/x"]
    assert [e.summary for e in entries] == ["project x", "team x"] and entries[1].shadowed_by is not None
    # Shipped recipes come last on the path and are found too.
    assert any(e.name == "model/llama3-8b" for e in list_recipes(search_path()))


def test_config_argument_may_be_a_recipe_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = load_config("model/llama3-8b")
    assert rc.config.model.dim == 4096


def test_list_items_can_be_set_and_removed_with_sources_following(write):
    cfg = write("run.yaml", "data:\n  source: text\n  paths:\n    - a.txt\n    - b.txt\n    - c.txt\n")
    rc = load_config(cfg, ["~data.paths.0", "data.paths.1=z.txt"], search_dirs=[])
    assert rc.config.data.paths == ["b.txt", "z.txt"]
    assert str(rc.sources[("data", "paths", 0)]).endswith("run.yaml:5")  # b.txt moved up, keeps its line
    assert str(rc.sources[("data", "paths", 1)]) == "override 'data.paths.1=z.txt'"


@pytest.mark.parametrize(
    "override, expect",
    [
        ("train.steps.0=5", "'train.steps' is 3, not a list or mapping"),
        ("data.paths.5=x", "5 is not an index of 'data.paths' (a list of 1)"),
        ("~data.paths.3", "nothing to remove at 'data.paths.3'"),
    ],
)
def test_bad_list_overrides(write, override, expect):
    cfg = write("run.yaml", "train: {steps: 3}\ndata: {source: text, paths: [a.txt]}\n")
    with pytest.raises(ConfigError, match=re.escape(expect)):
        load_config(cfg, [override], search_dirs=[])


def test_recipe_summary_is_the_first_whole_sentence(write, tmp_path):
    from accelrun.config.search import _summary

    p = write("r.yaml", "# Eight GPUs per node (see\n# vendor.md). More text\n#  here.\nmodel: {dim: 64}\n")
    assert _summary(p) == "Eight GPUs per node (see vendor.md)."
    assert _summary(write("s.yaml", "# no full stop\nmodel: {}\n")) == "no full stop"
    assert _summary(write("t.yaml", "model: {}\n# later\n")) == ""
    # Every shipped recipe's summary is a whole sentence.
    from accelrun.config import search_path

    shipped = list_recipes(search_path())
    assert len(shipped) > 20
    for e in shipped:
        assert e.summary and e.summary[-1] in ".!?", (e.name, e.summary)


def test_a_custom_model_run_is_named_after_its_module_unless_named_on_the_command_line():
    from tests.conftest import DEFAULT_CONFIG

    custom = "model.custom=examples.my_model:build"
    resolved = load_config(DEFAULT_CONFIG, [custom])
    assert resolved.config.name == "my_model" and str(resolved.sources[("name",)]) == "from model.custom"
    named = load_config(DEFAULT_CONFIG, [custom, "name=mine"])
    assert named.config.name == "mine" and str(named.sources[("name",)]) == "override 'name=mine'"
    assert load_config(DEFAULT_CONFIG).config.name == "llama-debug"  # the recipe's own model keeps its name
    assert load_config(DEFAULT_CONFIG, ["model.custom=pkg._net:build"]).config.name == "net"  # a valid folder name
    # a module of several factories names each one's runs apart (a new user's zoo: all went to runs/zoo/)
    assert load_config(DEFAULT_CONFIG, ["model.custom=zoo:qwen2"]).config.name == "zoo-qwen2"
    assert load_config(DEFAULT_CONFIG, ["model.custom=zoo:GPT"]).config.name == "zoo-GPT"
    assert load_config(DEFAULT_CONFIG, ["model.custom=zoo:make_model"]).config.name == "zoo"


def test_a_name_set_beside_model_custom_in_one_file_stays(write):
    """A user's recipe that names its run, and a run folder's config.yaml (the ranks reload it): both
    set name and model.custom in the same file."""
    from tests.conftest import DEFAULT_CONFIG

    mine = write("mine.yaml", f"""
        extends: [{DEFAULT_CONFIG}]
        name: experiment-7
        model:
          custom: examples.my_model:build
        """)
    assert load_config(mine).config.name == "experiment-7"
    # a team's recipe that extends it names its own runs (they had all gone to runs/my_model/)
    child = write("child.yaml", """
        extends: [mine.yaml]
        name: rel3
        """)
    assert load_config(child).config.name == "rel3"
    # but a shipped recipe's name, applied before the file that brings another model, is not that model's
    other = write("other.yaml", f"""
        extends: [{DEFAULT_CONFIG}]
        model:
          custom: examples.my_model:build
        """)
    assert load_config(other).config.name == "my_model"
    derived = load_config(DEFAULT_CONFIG, ["model.custom=examples.my_model:build"])
    dumped = write("config.yaml", derived.to_yaml())  # what the launcher writes into the run folder
    assert load_config(dumped).config.name == "my_model"


def test_a_custom_model_warns_of_the_family_keys_it_ignores_but_not_of_vocab_size():
    from tests.conftest import DEFAULT_CONFIG

    warned = load_config(DEFAULT_CONFIG, ["model.custom=examples.my_model:build", "model.dim=512",
                                          "model.vocab_size=300", "model.n_experts=4"]).warnings  # fmt: skip
    (line,) = [w for w in warned if w.startswith("model.custom is set")]
    # vocab_size checks the data where no token table is found; the MoE family's keys are family keys too
    assert line.endswith("are not used: model.dim, model.n_experts"), line
    assert not [w for w in warned if "n_experts" in w and w is not line]


def test_a_warmup_longer_than_a_run_the_user_set_is_warned():
    """`train.steps=20` on the default recipe keeps the shipped schedule's 30 warm-up steps: three new users'
    trials ran such runs and read their losses as the schedule's, never told the learning rate neither
    peaked nor decayed; warned now, as a warm-up or a learning rate the user set is. The shipped recipe's
    own pair (300 steps) is not."""
    from tests.conftest import DEFAULT_CONFIG

    def warmup_warnings(*overrides: str) -> list[str]:
        return [w for w in load_config(DEFAULT_CONFIG, list(overrides)).warnings if "warmup_steps" in w]

    assert warmup_warnings() == []
    (line,) = warmup_warnings("train.steps=20")
    assert line.startswith("train.lr_schedule.warmup_steps = 30 (") and "exceeds train.steps = 20" in line, line
    (line,) = warmup_warnings("train.steps=20", "train.lr_schedule.warmup_steps=25")
    assert line == ("train.lr_schedule.warmup_steps = 25 (override 'train.lr_schedule.warmup_steps=25') exceeds "
                    "train.steps = 20: the learning rate never reaches train.optimizer.lr = 0.003, only 0.0024 at "
                    "the last step, and never decays; train.lr_schedule.warmup_steps=2 (a tenth of the steps) "
                    "reaches it")  # fmt: skip
    # A learning rate the user set, which the shipped warm-up never reaches (a new user's lr=1e-3 over 20
    # steps peaked at 6.7e-4 without a word), is warned too, naming the recipe's line.
    (line,) = warmup_warnings("train.steps=20", "train.optimizer.lr=1e-3")
    assert line.startswith("train.lr_schedule.warmup_steps = 30 (") and "cpu-short.yaml:" in line, line
    assert "never reaches train.optimizer.lr = 0.001, only 0.00067 at the last step" in line, line
    # As long as the run (a trial's 30 steps of the recipe's 30): the rate is reached at the last step only.
    (line,) = warmup_warnings("train.steps=30")
    assert ("equals train.steps = 30: the learning rate reaches train.optimizer.lr = 0.003 at the last step only "
            "and never decays") in line, line


def test_a_report_warmup_as_long_as_the_run_is_warned():
    """report.warmup_steps=400 over 300 steps passed validate, and the run's figures were all n/a (a trial)."""
    from tests.conftest import DEFAULT_CONFIG

    def report_warnings(*overrides: str) -> list[str]:
        return [w for w in load_config(DEFAULT_CONFIG, list(overrides)).warnings if w.startswith("report.warmup")]

    assert report_warnings() == [] and report_warnings("train.steps=20") == []
    (line,) = report_warnings("report.warmup_steps=400")
    assert line.startswith("report.warmup_steps = 400 (override 'report.warmup_steps=400') is not below "
                           "train.steps = 300") and line.endswith("report.warmup_steps=3 leaves them some"), line
    (line,) = report_warnings("train.steps=4")  # the recipe's 5, over a run the user shortened
    assert "configs/llama.yaml:" in line and "train.steps = 4" in line, line


def test_settings_of_a_feature_left_off_are_warned():
    """A trial's parallel.microbatches, pp_schedule and activation_checkpoint.every_n, with pp 1 and
    checkpointing off, validated without a word (and changed the training hash)."""
    from tests.conftest import DEFAULT_CONFIG

    said = load_config(DEFAULT_CONFIG, ["parallel.microbatches=4", "parallel.pp_schedule=gpipe",
                                        "train.activation_checkpoint.every_n=3"]).warnings
    assert ("parallel.microbatches (override 'parallel.microbatches=4') has no effect with parallel.pp = 1 "
            "(no pipeline)") in said, said
    assert any(w.startswith("parallel.pp_schedule (override") for w in said), said
    assert ("train.activation_checkpoint.every_n (override 'train.activation_checkpoint.every_n=3') has no effect "
            "with train.activation_checkpoint.mode = none (it is read by mode every_n)") in said, said
    on = load_config(DEFAULT_CONFIG, ["parallel.nproc_per_node=2", "parallel.pp=2", "parallel.dp_shard=1",
                                      "parallel.microbatches=4", "train.activation_checkpoint.mode=every_n",
                                      "train.activation_checkpoint.every_n=3"]).warnings
    assert not [w for w in on if "has no effect" in w], on


def test_a_custom_model_refuses_the_transformers_export_and_says_model_hf_is_not_loaded_into_it(tmp_path):
    """A new user's findings (2026-12-06): `model.custom` with `checkpoint.hf_on_finish` passed validate,
    trained every step and then exited 2 at the export; `model.hf` beside `model.custom` was not read
    and nothing said so (the step-1 loss equalled the factory's own)."""
    from accelrun.config.validate import config_warnings
    from tests.conftest import DEFAULT_CONFIG

    custom = "model.custom=examples.my_model:build"
    with pytest.raises(ConfigError, match=r"checkpoint.hf_on_finish = True .*model.custom = examples.my_model:build .*"
                                          r"set checkpoint.hf_on_finish=false"):
        load_config(DEFAULT_CONFIG, [custom, "checkpoint.hf_on_finish=true"])
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(folder)  # fmt: skip
    resolved = load_config(DEFAULT_CONFIG, [custom, f"model.hf={folder}"])
    (said,) = [w for w in config_warnings(resolved.config, resolved.sources) if w.startswith("model.hf")]
    assert "weights and shape are not loaded into it; it is not read at all" in said, said
    assert not [w for w in config_warnings(*_both(load_config(DEFAULT_CONFIG, [custom]))) if w.startswith("model.hf")]


def _both(resolved):
    return resolved.config, resolved.sources


def test_evaluation_under_pipelining_is_refused_by_validate_with_where_each_value_was_set():
    """A new user's finding: validate said "valid", and train refused it after launching the ranks."""
    from tests.conftest import DEFAULT_CONFIG

    with pytest.raises(ConfigError, match=r"eval.every = 10 \(override 'eval.every=10'\) with parallel.pp = 2 "
                                          r"\(override 'parallel.pp=2'\): evaluation under pipeline parallelism"):
        load_config(DEFAULT_CONFIG, ["eval.every=10", "parallel.nproc_per_node=2", "parallel.pp=2",
                                     "parallel.dp_shard=1", "model.tie_embeddings=false"])


def test_explain_names_the_override_of_a_list_item():
    """A new user's finding: `train.optimizer.betas.0=0.5` was said to come from the recipe's line."""
    from tests.conftest import DEFAULT_CONFIG

    resolved = load_config(DEFAULT_CONFIG, ["train.optimizer.betas.0=0.5"])
    (row,) = [(v, str(src)) for k, v, src in resolved.explain() if k == "train.optimizer.betas"]
    assert row[0][0] == 0.5 and row[1] == "override 'train.optimizer.betas.0=0.5'", row


def test_a_project_recipe_that_shadows_a_shipped_one_is_a_warning(write, tmp_path, monkeypatch):
    """A team's recipes/train/cpu-short.yaml of two keys replaced the shipped one: its schedule, clipping
    and learning rate were gone, `validate` said "valid", and the same command gave another config from
    another folder. It is allowed (the search path's purpose) and now said; so is a missing folder on
    $ACCELRUN_RECIPE_PATH."""
    from tests.conftest import DEFAULT_CONFIG

    write("recipes/train/cpu-short.yaml", "train: {steps: 7, global_batch: 8}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELRUN_RECIPE_PATH", str(tmp_path / "no-such-folder"))
    warnings = load_config(DEFAULT_CONFIG).warnings
    (shadow,) = [w for w in warnings if "shadows" in w]
    assert shadow.startswith("recipe 'train/cpu-short' is ") and "recipes/train/cpu-short.yaml, which shadows the " \
        "shipped recipe of that name (it comes first on the search path)" in shadow, shadow
    assert f"$ACCELRUN_RECIPE_PATH names {tmp_path / 'no-such-folder'}, which is not a folder" in warnings
    monkeypatch.delenv("ACCELRUN_RECIPE_PATH")
    monkeypatch.chdir(tmp_path / "recipes")  # elsewhere: the shipped recipes alone, nothing said
    assert not [w for w in load_config(DEFAULT_CONFIG).warnings if "shadows" in w or "RECIPE_PATH" in w]


def test_a_project_recipe_that_extends_the_shipped_one_it_shadows_is_no_warning(write, tmp_path, monkeypatch):
    # (a review) it keeps what the shipped one sets: nothing is lost, nothing to say
    from accelrun.config.search import SHIPPED_RECIPES
    from tests.conftest import DEFAULT_CONFIG

    write("recipes/train/cpu-short.yaml", f"extends: [{SHIPPED_RECIPES / 'train' / 'cpu-short.yaml'}]\ntrain: {{steps: 7}}\n")
    monkeypatch.chdir(tmp_path)
    resolved = load_config(DEFAULT_CONFIG)
    assert resolved.config.train.steps == 7 and not [w for w in resolved.warnings if "shadows" in w]
