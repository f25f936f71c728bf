"""A user's model is trained whatever the usual shape of its forward's output, and a model that cannot
take the data, or a factory that cannot take model.kwargs, is one line and exit 2, from `validate` as
from `train`, before anything is built."""

from __future__ import annotations

import textwrap

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG

MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


def Needs(vocab, width):  # noqa: N802 (a factory with required arguments)
    return Plain(vocab, width)


def not_a_module():
    return "hello"


def two_args():
    return TwoArgs()


class Plain(nn.Module):
    """A tiny LM: token embedding, one linear layer, logits."""
    def __init__(self, vocab=320, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx)))


class Typed(Plain):  # its arguments annotated: a value of another type is refused, naming the key
    def __init__(self, vocab: int = 320, width: int = 16):
        super().__init__(vocab, width)


class PairsRows(Plain):  # views its batch as pairs of rows: one sequence alone does not fit, a batch of 4 does
    def forward(self, idx):
        h = self.emb(idx)
        h = h.view(2, -1, *h.shape[1:]).flip(0).reshape(h.shape)
        return self.out(torch.tanh(h))


class Heads(Plain):  # splits its width into heads: a width the heads do not divide fails at the view
    def __init__(self, vocab=320, width=16, heads=4):
        super().__init__(vocab, width)
        self.heads = heads

    def forward(self, idx):
        x = self.emb(idx)
        B, T, C = x.shape
        x = x.view(B, T, self.heads, C // self.heads).flatten(2)
        return self.out(torch.tanh(x))


class NanoStyle(Plain):  # nanoGPT's forward(idx, targets=None): the last position's logits only without targets
    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        if targets is None:
            return logits[:, [-1], :], None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class TargetsUnused(Plain):  # takes targets, returns only the logits
    def forward(self, idx, targets=None):
        return super().forward(idx)


class TwoArgs(Plain):  # transformers-like: a mask no one passes
    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids) * attention_mask[..., None]


class WithPositions(Plain):  # a position table larger than the vocabulary: not taken for the token table
    def __init__(self, vocab=300, width=16, positions=1024):
        super().__init__(vocab, width)
        self.pos = nn.Embedding(positions, width)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx) + self.pos(torch.arange(idx.shape[1]))))


class DictStyle(Plain):
    def forward(self, idx):
        return {"logits": super().forward(idx)}


class Output:  # transformers' outputs carry .logits
    def __init__(self, logits):
        self.logits = logits


class ObjectStyle(Plain):
    def forward(self, idx):
        return Output(super().forward(idx))


class Hidden(Plain):  # forgets the head: returns a dict without logits
    def forward(self, idx):
        return {"hidden": self.emb(idx)}


class HiddenStates(Plain):  # forgets the head: returns [B, T, width]
    def forward(self, idx):
        return torch.tanh(self.emb(idx))


class NarrowHead(Plain):  # a head with fewer outputs than token ids
    def __init__(self, vocab=320, width=16):
        super().__init__(vocab, width)
        self.out = nn.Linear(width, 200)


class PaddedHead(Plain):  # more outputs than token ids, as nanoGPT pads 50,257 to 50,304
    def __init__(self, vocab=320, width=16):
        super().__init__(vocab, width)
        self.out = nn.Linear(width, 384)


class HeadNotLast(PaddedHead):  # a Linear after the head: its token table cannot be told, model.vocab_size counts
    def __init__(self, vocab=320, width=16):
        super().__init__(vocab, width)
        self.unused = nn.Linear(width, width)


def build(style="Plain", **kw):
    return globals()[style](**kw)


def raises(**kw):
    raise RuntimeError("the factory failed on purpose")


def reads_a_value(**kw):  # fails on the meta device alone: a value read at init
    model = Plain()
    model.scale = float(torch.ones(()).item())
    return model
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "contract_models.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "contract_models", raising=False)
    return "contract_models:build"


def losses(tiny, custom, style, name, reports=None):
    result = train(load_config(DEFAULT_CONFIG, tiny(4, f"model.custom={custom}", f"model.kwargs={{style: {style}}}",
                                                     "compile.backend=eager", f"name={name}")), command="test")
    assert result.status == "finished"
    if reports is not None:
        reports[style] = (result.run_dir / "report.md").read_text()
    return [m["loss"] for m in read_metrics(result.run_dir / "metrics.jsonl")]


def test_logits_are_read_from_a_tuple_a_dict_or_an_object(tiny, models):
    reports = {}
    want = losses(tiny, models, "Plain", "plain", reports)
    for style in ("NanoStyle", "DictStyle", "ObjectStyle", "TargetsUnused"):
        assert losses(tiny, models, style, style.lower(), reports) == want, style  # same weights, logits, losses
    # report.md says which loss was trained: the forward's own where it takes targets (found by a new user)
    assert "| loss | the loss the model's forward returns given targets (forward(tokens, targets)) |" \
        in reports["NanoStyle"]
    for style in ("Plain", "DictStyle"):
        assert "| loss | the next-token cross-entropy of the logits the model's forward returns" in reports[style]
    # which of the two a forward given targets made it (the report said "X, or where it returns none, Y")
    assert "| loss | the next-token cross-entropy of the logits the model's forward returns given targets (it " \
           "returned no loss of its own) |" in reports["TargetsUnused"]


def invoke(*args):
    return CliRunner().invoke(cli, [*args])


def one_error(r) -> str:
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    return " ".join(r.output[r.output.index("error"):].split())


def test_an_output_without_logits_is_one_line_naming_the_forward(tiny, models):
    r = invoke("train", str(DEFAULT_CONFIG), *tiny(2, f"model.custom={models}", "model.kwargs={style: Hidden}",
                                                    "compile.backend=eager"))
    assert "Hidden.forward (model.custom) returned a dict with keys ['hidden']; accelrun reads the logits " \
           "[batch, seq, vocab] from a tensor" in one_error(r)


@pytest.mark.parametrize("style, width, message", [
    # a width wider than the token ids trained without a word; narrower, it crashed in the loss (IndexError)
    # (the byte tokenizer's ids, 0-257; the head suggested as wide as the token table, 320 rows)
    ("HiddenStates", 400, "returned logits with 400 classes (their last dimension) for token ids 0 to 257: 400 is "
                          "the width of its token table (nn.Embedding), so these look like hidden states; apply the "
                          "output head (nn.Linear(dim, 320)) in forward"),
    ("HiddenStates", 16, "returned logits with 16 classes (their last dimension) for token ids 0 to 257: 16 is "
                         "the width of its token table"),
    ("NarrowHead", 16, "returned logits with 200 classes (their last dimension) for token ids 0 to 257: the loss "
                       "needs a class per token id, at least 258 (an output head nn.Linear(dim, 320))"),
])
def test_logits_with_a_class_per_token_id_or_one_line(tiny, models, style, width, message):
    r = invoke("train", str(DEFAULT_CONFIG), *tiny(2, f"model.custom={models}",
                                                    f"model.kwargs={{style: {style}, width: {width}}}",
                                                    "compile.backend=eager"))
    assert f"{style}.forward (model.custom) {message}" in one_error(r)


def test_a_padded_vocabulary_trains(tiny, models):
    assert len(losses(tiny, models, "PaddedHead", "padded")) == 4


def test_logits_are_checked_against_the_tokenizer_s_ids_not_model_vocab_size(tiny, models):
    # A review found it: a model whose token table cannot be told takes model.vocab_size (512 in model/debug)
    # for the data, while the byte tokenizer makes 258 ids: its 384 classes cover them.
    result = train(load_config(DEFAULT_CONFIG, tiny(2, f"model.custom={models}", "model.kwargs={style: HeadNotLast}",
                                                     "model.vocab_size=512", "name=head-not-last")), command="test")
    assert result.status == "finished"
    said = one_error(invoke("validate", str(DEFAULT_CONFIG), *tiny(2, f"model.custom={models}",
                                                                   "model.kwargs={style: HiddenStates, width: 400}",
                                                                   "model.vocab_size=512")))  # fmt: skip
    assert "returned logits with 400 classes (their last dimension) for token ids 0 to 257" in said, said


def test_an_embedding_smaller_than_the_tokenizer_is_named_before_training(tiny, models):
    r = invoke("train", str(DEFAULT_CONFIG), *tiny(2, f"model.custom={models}", "model.kwargs={vocab: 100}"))
    assert (f"model.custom = '{models}' embeds token ids below 100 (its token table), but data.tokenizer "
            "'byte' has ids up to") in one_error(r)


def test_the_token_table_is_the_one_the_head_matches_not_a_larger_position_table(models):
    from accelrun.models.build import embedding_rows

    module = __import__("contract_models")
    assert embedding_rows(module.build("WithPositions", vocab=300)) == 300
    assert embedding_rows(module.build("WithPositions", vocab=200)) == 200  # 1,024 position rows ignored


def test_a_small_head_registered_after_the_output_head_does_not_hide_the_token_table():
    """A new user's tied LM with an auxiliary nn.Linear(dim, 1) registered after lm_head: its token ids were
    unknown, and its FLOPs were counted on ids drawn for the recipe's vocabulary (IndexError: MFU n/a)."""
    from torch import nn

    from accelrun.models.build import embedding_rows

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(320, 16), nn.Embedding(512, 16)
            self.lm_head = nn.Linear(16, 320, bias=False)
            self.lm_head.weight = self.wte.weight
            self.aux_head = nn.Linear(16, 1)

    assert embedding_rows(Tied()) == 320


class LogitsThroughTheTable(torch.nn.Module):
    """A new user's encoder LM: no output nn.Linear, the logits made with the token table's weight."""

    def __init__(self, vocab: int = 258, positions: int = 512) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, 16), torch.nn.Embedding(positions, 16)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return torch.nn.functional.linear(x, self.emb.weight)


def test_logits_made_with_the_token_tables_weight_take_its_rows():
    """Its ids were left to model.vocab_size (512 in model/debug), which the model never had: counting its
    FLOPs drew ids past its 258 rows ("MFU n/a ... IndexError: index out of range in self")."""
    from accelrun.config.schema import ModelConfig
    from accelrun.models.build import data_vocab
    from accelrun.models.flop_count import counted_flops_per_token

    model = LogitsThroughTheTable()
    ids, _ = data_vocab(ModelConfig(custom="m:build", vocab_size=512), model)
    assert ids == 258
    counted = counted_flops_per_token(model, 32, ids, torch.device("cpu"))
    assert counted.value and counted.value > 0, counted

    class BareTokenTable(torch.nn.Module):  # (a review) a lone 2-row segment table is no token table
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.segment = torch.nn.Parameter(torch.randn(300, 16)), torch.nn.Embedding(2, 16)

    assert data_vocab(ModelConfig(custom="m:build", vocab_size=512), BareTokenTable())[0] == 512


def test_too_few_classes_suggest_a_head_as_wide_as_the_token_table_not_the_position_table():
    from accelrun.models.build import ModelOutputError, _check_classes

    with pytest.raises(ModelOutputError) as e:  # 256 token rows and 512 positions, for ids 0 to 257
        _check_classes(256, 258, LogitsThroughTheTable(vocab=256), "M.forward")
    assert "at least 258 (an output head nn.Linear(dim, 258))" in str(e.value), str(e.value)


@pytest.mark.parametrize("custom, kwargs, message, validate_only, more", [
    ("contract_models_missing:build", "{}", "no module named 'contract_models_missing' (looked in the current folder "
                                            "and on PYTHONPATH)", "", ()),
    ("contract_models:nope", "{}", "module 'contract_models' has no attribute 'nope'", "", ()),
    ("contract_models:Plain", "{dims: 64}", "unexpected keyword argument 'dims'",
     "do not fit model.custom = 'contract_models:Plain': got an unexpected keyword argument 'dims' (Plain takes "
     "vocab, width) (model.kwargs.dims: override 'model.kwargs={dims: 64}')", ()),
    # the nearest valid value: a misspelt argument's nearest name, a missing one written as an override
    ("contract_models:Plain", "{widht: 64}", "unexpected keyword argument 'widht'", "; did you mean 'width'?", ()),
    # YAML's flow mapping without a space after the colon: one key, no value (a trial's `{d:96}`)
    # (an override's value says so as it is read; a recipe file's, where the factory refuses the key)
    ("contract_models:Plain", "{width:64}", "'width:64' reads as a key with no value",
     "YAML needs a space after the colon, model.kwargs={width: 64}", ()),
    ("contract_models:Needs", "{vocab: 300}", "missing a required argument: 'width'",
     '; pass it as model.kwargs, e.g. "model.kwargs={vocab: 300, width: ...}"', ()),
    # an unknown key is left out of the suggestion (it would fail again), a value written as YAML
    ("contract_models:Needs", "{vocab: 300, widht: 2}", "missing a required argument: 'width'",
     "did you mean 'width'?", ()),
    ("contract_models:Needs", "{vocab: 300, colour: 'a b'}", "missing a required argument: 'width'",
     '"model.kwargs={vocab: 300, width: ...}"', ()),
    # Found once the model is built: validate builds it on the meta device (it said "valid" to both)
    ("contract_models:build", "{vocab: 100}", "embeds token ids below 100 (its token table), but data.tokenizer "
                                              "'byte' has ids up to 257", "(model.custom: override 'model.custom="
                                              "contract_models:build'; model.kwargs: override 'model.kwargs={vocab: "
                                              "100}')", ()),  # the size came from model.kwargs: named too
    # found by building on the meta device, as train finds them (validate said "valid"; found by a new user)
    ("contract_models:not_a_module", "{}", "not_a_module(...) returned a str, not a torch.nn.Module",
     "(model.custom: override", ()),
    ("contract_models:two_args", "{}", "TwoArgs.forward needs 'attention_mask', which accelrun does not pass",
     "(model.custom: override", ()),
    ("contract_models:Plain", "{}", "data.packing = document: model.custom's forward (Plain) takes no positions_BT",
     "(model.custom: override", ("data.packing=document",)),
    # found by a forward and loss on meta tensors (validate said "valid" to a forgotten head; a new user's trial)
    ("contract_models:build", "{style: HiddenStates, width: 400}", "HiddenStates.forward (model.custom) returned "
     "logits with 400 classes", "so these look like hidden states", ()),
    ("contract_models:build", "{style: Hidden}", "Hidden.forward (model.custom) returned a dict with keys ['hidden']",
     "(model.custom: override", ()),
    # a learned position table shorter than the sequence: train said a page of F.embedding's traceback
    ("contract_models:build", "{style: WithPositions, positions: 16}", "train.seq_len = 32 is longer than "
     "model.custom's position table pos (16 rows): set train.seq_len=16 or less",
     "(train.seq_len: override 'train.seq_len=32')", ()),
])  # fmt: skip
def test_validate_refuses_what_train_would(tiny, models, custom, kwargs, message, validate_only, more):
    args = (str(DEFAULT_CONFIG), *tiny(2, f"model.custom={custom}", f"model.kwargs={kwargs}", *more))
    said = one_error(invoke("validate", *args))
    assert message in said and validate_only in said, said
    assert message in one_error(invoke("train", *args))  # the rank that builds the model says it


@pytest.mark.parametrize("entry, message", [
    ("widht: 64", "got an unexpected keyword argument 'widht' (Typed takes vocab, width); did you mean 'width'? "
                  "(model.kwargs.widht: {recipe}:6)"),
    ("width: wide", "model.kwargs.width = 'wide' (str), but Typed takes width: int (model.kwargs.width: {recipe}:6)"),
])
def test_a_model_kwargs_entry_that_does_not_fit_is_named_at_its_own_line(tiny, models, tmp_path, entry, message):
    """The entry's own line, not that of `kwargs:` above it; and train, which named no line, names it too."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"extends: [{DEFAULT_CONFIG}]\nmodel:\n  custom: contract_models:Typed\n  kwargs:\n"
                      f"    vocab: 320\n    {entry}\n")
    for command in ("validate", "train"):
        said = one_error(invoke(command, str(recipe), *tiny(2)))
        assert message.format(recipe=recipe) in said, (command, said)


def test_validate_refuses_a_forward_whose_own_sizes_do_not_fit(tiny, models):
    """The model's own sizes that its forward cannot run with (a trial's GPT of dim 60 and 7 heads):
    validate said "valid", with a note that blamed the meta device, and train crashed at its first step.
    Sizes torch says disagree are refused with the user's line; the same model with sizes that fit is
    valid without a note."""
    args = (str(DEFAULT_CONFIG), *tiny(2, "model.custom=contract_models:build"))
    said = one_error(invoke("validate", *args, "model.kwargs={style: Heads, width: 18, heads: 4}"))
    assert ("Heads.forward fails on a batch of 4 x 32 tokens: RuntimeError: shape '[4, 32, 4, 4]' is invalid "
            "for input of size 2304 (at ") in said and "contract_models.py:" in said, said
    r = invoke("validate", *args, "model.kwargs={style: Heads, width: 16, heads: 4}")
    assert r.exit_code == 0 and "note:" not in r.output, r.output
    # train meets it counting the forward's FLOPs, eagerly, before compiling: a recipe error (2) naming the
    # user's line, not the traced forward's crash (1) that a compile bug might also have been
    said = one_error(invoke("train", *args, "model.kwargs={style: Heads, width: 18, heads: 4}"))
    assert ("Heads.forward fails on a batch of 4 x 32 tokens: RuntimeError: shape '[4, 32, 4, 4]' is invalid "
            "for input of size 2304 (at ") in said and "contract_models.py:" in said and "(model.custom: " in said, said
    # a forward that cannot take one sequence alone (the FLOPs are counted on one) but takes the micro-batch
    # trains, as it did before train refused sizes errors (a review's finding): its MFU is unknown
    r = invoke("train", *args, "model.kwargs={style: PairsRows}", "compile.backend=eager")
    assert r.exit_code == 0 and "counting its FLOPs on one sequence failed" in r.output, r.output


def test_every_reader_of_the_data_takes_the_token_tables_rows(models):
    """Training, `compile explain` and the step-memory estimate all draw ids through data_vocab."""
    from accelrun.config.schema import ModelConfig
    from accelrun.models.build import data_vocab

    module = __import__("contract_models")
    cfg = ModelConfig(custom=models, vocab_size=512)
    assert data_vocab(cfg, module.build("WithPositions", vocab=200)) == (200, models)
    assert data_vocab(cfg, __import__("torch").nn.Linear(4, 4)) == (512, None)  # no token table: model.vocab_size
    assert data_vocab(ModelConfig(vocab_size=320), module.build(vocab=100)) == (320, None)  # a family's key


def test_validate_says_what_it_could_not_check_on_the_meta_device(tiny, models):
    """A factory that raises (train exits 2 there) was "valid" without a word (a new user, 2026-12-06),
    then "valid" with a note that blamed the meta device for a KeyError (model.kwargs naming no option;
    2026-12-07). Now it is train's error, naming the user's line; a factory that fails on the meta
    device alone (it reads a value at init) is left to train with a note."""
    r = invoke("validate", str(DEFAULT_CONFIG), *tiny(2, "model.custom=contract_models:raises"))
    line = next(i for i, text in enumerate(textwrap.dedent(MODELS).splitlines(), 1) if "failed on purpose" in text)
    assert ("calling raises(**model.kwargs) with model.kwargs = {} failed at " in one_error(r)
            and f"contract_models.py:{line}: RuntimeError: the factory failed on purpose" in one_error(r)), r.output
    r = invoke("validate", str(DEFAULT_CONFIG), *tiny(2, "model.custom=contract_models:reads_a_value"))
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert ("note: model.custom = 'contract_models:reads_a_value' could not be built on the meta device "
            "(RuntimeError: Tensor.item() cannot be called on meta tensors") in said, said
    r = invoke("validate", str(DEFAULT_CONFIG), *tiny(2, f"model.custom={models}"))
    assert r.exit_code == 0 and "note:" not in r.output, r.output


def test_only_the_meta_devices_own_errors_are_left_to_train():
    from accelrun.config.preflight import _meta_device_error

    assert _meta_device_error(RuntimeError("Tensor.item() cannot be called on meta tensors"))
    assert _meta_device_error(NotImplementedError("... no fake impl or Meta kernel registered"))
    assert not _meta_device_error(KeyError("metadata")) and not _meta_device_error(NotImplementedError("variant X"))
    looped = RuntimeError("boom")
    looped.__cause__ = looped  # `raise e from e`: a chain that is a loop ends
    assert not _meta_device_error(looped)


def test_export_of_a_custom_model_says_how_its_checkpoint_loads_and_that_way_works(tiny, tmp_path):
    """`export`/`generate` cannot rebuild a user's model; the message says how to read its checkpoint
    (a new user found that way alone), and that way gives the trained weights to the factory's model."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from examples.my_model import build

    result = train(load_config(DEFAULT_CONFIG, tiny(2, "model.custom=examples.my_model:build", "checkpoint.every=2",
                                                    "compile.backend=eager")))  # fmt: skip
    r = invoke("export", str(result.run_dir), "--hf", str(tmp_path / "out"))
    said = one_error(r)
    assert "dcp_to_torch_save(<checkpoint folder>, 'model.pt')" in said, said
    (ckpt,) = sorted((result.run_dir / "checkpoints").iterdir())[-1:]
    dcp_to_torch_save(ckpt, tmp_path / "model.pt")
    model = build()
    saved = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    model.load_state_dict(saved)  # strict: every name of the factory's model, and no other
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("factory", ["config", "from_pretrained"])
def test_export_of_a_users_transformers_model_is_transformers_own_folder(tiny, tmp_path, monkeypatch, factory):
    """A factory that returns a transformers model exports as transformers writes it (save_pretrained),
    with the trained weights: a new user's Qwen2 export had been refused. A factory loading a folder
    with from_pretrained (which refuses the meta device the export's first check built on) too."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(tmp_path))
    source = HF_CHECKPOINTED
    if factory == "from_pretrained":  # the config-built model, saved, is the folder it loads
        (tmp_path / "hfstart.py").write_text(HF_CHECKPOINTED)
        importlib.import_module("hfstart").build(checkpointing=False).save_pretrained(tmp_path / "start")
        source = HF_FROM_PRETRAINED.format(folder=tmp_path / "start")
    module = f"hfexport_{factory}"  # (a module of one name is imported once per process)
    (tmp_path / f"{module}.py").write_text(source)
    result = train(load_config(DEFAULT_CONFIG, tiny(2, f"model.custom={module}:build", "model.kwargs.checkpointing=false",
                                                    "checkpoint.every=2")))  # fmt: skip
    r = invoke("export", str(result.run_dir), "--hf", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "config.json").is_file() and list((tmp_path / "out").glob("*.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    from accelrun.train.checkpoint_model import load_checkpoint_model

    ours, _, _ = load_checkpoint_model(result.run_dir, "to compare", custom=True)
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids, use_cache=False).logits, rtol=1e-5, atol=1e-6)
    fresh = load_config(DEFAULT_CONFIG, tiny(1, f"model.custom={module}:build")).config.model  # untrained differs
    from accelrun.models import build_model

    assert not torch.equal(build_model(fresh, "cpu", seed=1).lm_head.weight, theirs.lm_head.weight)


def test_opts_position_table_counts_its_offset():
    """OPT's positions start 2 rows into its table: 34 rows take 32 positions, not 34."""
    transformers = pytest.importorskip("transformers")
    from accelrun.models.build import position_table_problem

    config = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16)  # fmt: skip
    model = transformers.OPTForCausalLM(config)
    assert position_table_problem(model, 32) is None
    said = position_table_problem(model, 33)
    assert said is not None and "model.decoder.embed_positions (34 rows, positions from row 2): set train.seq_len=32" in said


def test_the_position_table_check_names_absolute_tables_only_and_finds_one_as_long_as_the_vocabulary(models):
    """A review's findings: a table of relative-position buckets (rel_pos_bias) was refused as a
    position table, and a real one exactly as long as the vocabulary was wide was taken for the token
    table and let through (then F.embedding's traceback)."""
    from torch import nn

    from accelrun.models.build import position_table_problem

    module = __import__("contract_models")
    same_size = module.build("WithPositions", vocab=16, positions=16)
    assert "position table pos (16 rows)" in (position_table_problem(same_size, 32) or "")
    relative = module.build("Plain")
    relative.rel_pos_bias = nn.Embedding(32, 4)  # buckets, whatever the sequence's length
    assert position_table_problem(relative, 512) is None


def test_position_table_names_users_write_and_ones_that_are_not():
    from accelrun.models.build import is_position_table

    for name in ("transformer.wpe", "position_embedding_table", "pos_embed", "positional_embedding",
                 "model.decoder.embed_positions", "abs_pos_emb", "pos", "positions"):
        assert is_position_table(name), name
    for name in ("rel_pos_bias", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias", "pos_tags",
                 "embeddings.x_position_embeddings", "tokens", "token_embedding_table", "pos_bucket_emb"):
        assert not is_position_table(name), name


def test_a_position_table_registered_before_the_token_table_is_not_taken_for_it():
    from torch import nn

    from accelrun.models.build import embedding_rows, position_table_problem

    class PositionsFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_emb = nn.Embedding(16, 8)  # as long as the vocabulary is wide, and first
            self.tok_emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

    model = PositionsFirst()
    assert embedding_rows(model) == 16
    assert "position table pos_emb (16 rows)" in (position_table_problem(model, 32) or "")


HF_FROM_PRETRAINED = '''
from transformers import AutoModelForCausalLM


def build(checkpointing: bool = True):
    return AutoModelForCausalLM.from_pretrained("{folder}")
'''

HF_CHECKPOINTED = '''
from transformers import Qwen2Config, Qwen2ForCausalLM


def build(checkpointing: bool = True):
    config = Qwen2Config(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
'''


def test_a_checkpointed_transformers_model_compiles_its_layers_whole(tiny, tmp_path, monkeypatch):
    """transformers' checkpointing (or accelrun's) around a decoder layer whose RMSNorm sets a global as it
    runs (the `kernels` package's layers): Dynamo broke the graph there ("HOP: Unsafe side effect") and a
    new user's Qwen2 ran every layer eagerly, slower than eager. accelrun's traces let such a change be
    made once, in the forward (trace_settings.SIDE_EFFECTS_ONCE): the layers compile, at eager's losses.
    train.activation_checkpoint on such a model, which had asked for a `layers` list, checkpoints the
    layers the compiler finds."""
    (tmp_path / "hfckpt.py").write_text(HF_CHECKPOINTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ("model.custom=hfckpt:build", "compile.backend=accelrun")
    eager = train(load_config(DEFAULT_CONFIG, tiny(3, *common, "compile.backend=eager", "name=eager")), command="test")
    ref = [m["loss"] for m in read_metrics(eager.run_dir / "metrics.jsonl")]
    for name, more in (("theirs", ()), ("asked", ("model.kwargs.checkpointing=false",
                                                  "train.activation_checkpoint.mode=full"))):
        ran = train(load_config(DEFAULT_CONFIG, tiny(3, *common, *more, f"name={name}")), command="test")
        compiler = ran.report["compiler"]
        assert compiler["graph_breaks"] == 0 and compiler["graphs_in_use"] == 2, (name, compiler)
        got = [m["loss"] for m in read_metrics(ran.run_dir / "metrics.jsonl")]
        assert got == pytest.approx(ref, rel=1e-5), name


def test_a_graph_break_inside_a_checkpointed_region_says_what_it_means():
    from accelrun.compile.break_sites import known_fix

    fix = known_fix("HOP: Unsafe side effect\n  Explanation: Mutating a variable from outside the scope of this HOP")
    assert fix is not None and fix.startswith("code inside activation checkpointing (torch.utils.checkpoint: "
                                              "transformers' gradient_checkpointing_enable()")


def test_save_pretrained_exports_name_the_files_they_wrote_and_removed(tmp_path):
    # (a review) every file already in the folder had been listed as written, and replaced shards not at all
    from accelrun.train.export import _save_pretrained

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_text("old shard")

    class Model:
        def save_pretrained(self, folder, max_shard_size):
            (folder / "model-00001-of-00002.safetensors").unlink()  # as transformers drops stale shards
            (folder / "config.json").write_text("{}")
            (folder / "model.safetensors").write_text("weights")

    removed: list = []
    written = _save_pretrained(Model(), out, 2**30, removed)
    assert [p.name for p in written] == ["config.json", "model.safetensors"]
    assert [p.name for p in removed] == ["model-00001-of-00002.safetensors"]


def test_activation_checkpointing_of_nn_transformer_encoder_layers(tiny):
    # (a review) the blocks of torch.nn's own classes were not found for checkpointing: "...has none"
    common = ("model.custom=examples.my_model:build", "train.activation_checkpoint.mode=full")
    eager = train(load_config(DEFAULT_CONFIG, tiny(3, *common, "name=eager")), command="test")
    ran = train(load_config(DEFAULT_CONFIG, tiny(3, *common, "compile.backend=accelrun", "name=ran")), command="test")
    assert eager.status == ran.status == "finished" and ran.report["compiler"]["graphs_in_use"] > 0
    ref = [m["loss"] for m in read_metrics(eager.run_dir / "metrics.jsonl")]
    assert [m["loss"] for m in read_metrics(ran.run_dir / "metrics.jsonl")] == pytest.approx(ref, rel=1e-5)


SEQUENTIAL_GPT = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class GPT(nn.Module):
    def __init__(self, vocab=320, dim=32, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


class NoBlocks(nn.Module):
    def __init__(self, vocab=320, dim=32):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.embed(tokens))
"""


def test_activation_checkpointing_of_an_nn_sequential_of_blocks_and_said(tiny, tmp_path, monkeypatch):
    """A trial's GPT with its blocks in an nn.Sequential: validate said "valid", then train refused the
    checkpointing; and where it did checkpoint, no run ever said so."""
    (tmp_path / "seq_gpt.py").write_text(SEQUENTIAL_GPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ("model.custom=seq_gpt:GPT", "compile.backend=eager")
    plain = train(load_config(DEFAULT_CONFIG, tiny(3, *common, "name=plain")), command="test")
    ran = train(load_config(DEFAULT_CONFIG, tiny(3, *common, "train.activation_checkpoint.mode=full", "name=ac")),
                command="test")
    assert ran.status == "finished"
    assert "activation checkpointing (full) on 3 of 3 Block blocks" in (ran.run_dir / "report.md").read_text()
    ref = [m["loss"] for m in read_metrics(plain.run_dir / "metrics.jsonl")]
    assert [m["loss"] for m in read_metrics(ran.run_dir / "metrics.jsonl")] == pytest.approx(ref, rel=1e-6)
    # compiled whole (no ModuleList), with the blocks inside checkpointed: not through the graph cache, whose
    # key does not say which blocks are (an entry could have served a run that checkpoints none; a review)
    compiled = train(load_config(DEFAULT_CONFIG, tiny(2, "model.custom=seq_gpt:GPT", "compile.backend=accelrun",
                                                       "train.activation_checkpoint.mode=full", "name=acc")),
                     command="test")
    assert compiled.report["compiler"]["graphs_in_use"] > 0
    assert "Block.forward inside GPT is checkpointed" in compiled.report["compiler"]["graph_cache"]["off"]
    said = invoke("validate", str(DEFAULT_CONFIG), *tiny(2, "model.custom=seq_gpt:NoBlocks",
                                                          "train.activation_checkpoint.mode=full"))
    assert said.exit_code == 2 and "train.activation_checkpoint needs a model with repeated blocks" in one_error(said)
    assert "(train.activation_checkpoint.mode: override 'train.activation_checkpoint.mode=full')" in one_error(said)
