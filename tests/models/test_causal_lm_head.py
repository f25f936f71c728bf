"""transformers' causal LMs given the families' head_loss (accelrun.models.causal_lm_head): each class of
the table against its own forward, at tiny sizes built locally."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

from accelrun.models.build import training_loss_fn
from accelrun.models.causal_lm_head import PLAIN_HEADS, attach_loss_head, loss_head_attached

transformers = pytest.importorskip("transformers")
VOCAB = 64


def _tiny(cls_path: str):
    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    # GPT-J rotates rotary_dim of each head's 8 features (64 by default); Falcon derives its head_dim
    head_dim = {} if name == "FalconForCausalLM" else {"head_dim": 8}
    config = cls.config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=4, **head_dim)  # fmt: skip
    torch.manual_seed(0)
    return cls(config)


@pytest.mark.parametrize("cls_path", sorted(PLAIN_HEADS))
def test_each_class_of_the_table_gives_its_own_forwards_loss_and_gradients(cls_path):
    """The head and loss as one step compute what cross-entropy of the class's own logits does: the
    table's entries are exactly those classes (a transformers release that changes one fails here)."""
    reference = _tiny(cls_path)
    model = copy.deepcopy(reference)
    assert attach_loss_head(model) and loss_head_attached(model)
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(2)  # the same dropout masks in both (GPT-2, OPT and StarCoder drop by default)
    logits = reference(inputs, use_cache=False).logits
    expected = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    torch.manual_seed(2)
    loss = training_loss_fn(model)(inputs, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # Called without targets, as a user's own code calls it, it is the class's forward.
    torch.manual_seed(2)
    torch.testing.assert_close(model(inputs, use_cache=False).logits, logits.detach())


def test_a_model_whose_logits_are_more_than_the_heads_product_keeps_its_own_forward():
    """Gemma 2 soft-caps its logits after the head; a subclass may change the forward: neither gets it."""
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    gemma2 = transformers.Gemma2ForCausalLM(config)
    assert not attach_loss_head(gemma2) and not hasattr(gemma2, "head_loss")

    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    scaled = Scaled(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    assert not attach_loss_head(scaled) and not loss_head_attached(scaled)


def test_a_user_factory_of_transformers_llama_gets_the_head(tmp_path, monkeypatch):
    """``model.custom`` naming a factory that returns transformers' Llama: built with the head attached,
    its state dict unchanged (what save_pretrained and accelrun's checkpoints write)."""
    from accelrun.config.schema import ModelConfig
    from accelrun.models.build import build_model

    (tmp_path / "my_llama.py").write_text(
        "import transformers\n"
        "def make():\n"
        "    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32,\n"
        "        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(ModelConfig(custom="my_llama:make"), "cpu")
    assert loss_head_attached(model) and type(model) is transformers.LlamaForCausalLM
    assert set(model.state_dict()) == set(transformers.LlamaForCausalLM(model.config).state_dict())


def test_the_attached_head_survives_pickle_and_deepcopy_and_keeps_the_class_signature():
    """Review findings: bound methods on the instance did not unpickle (pickle asks the half-built model
    for them); transformers' generate reads the forward's signature, which lost its parameters; a
    call with targets and other arguments dropped them without a word."""
    import inspect
    import pickle

    model = _tiny("transformers.models.llama.modeling_llama.LlamaForCausalLM")
    attach_loss_head(model)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    loss = model(tokens[:, :-1], targets_BT=tokens[:, 1:])
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert loss_head_attached(twin) and twin.forward.args[0] is twin and twin.head_loss.args[0] is twin
        torch.testing.assert_close(twin(tokens[:, :-1], targets_BT=tokens[:, 1:]), loss)
    params = inspect.signature(model.forward).parameters
    assert list(params)[:3] == ["input_ids", "attention_mask", "position_ids"] and "targets_BT" in params
    torch.testing.assert_close(model(input_ids=tokens[:, :-1], targets_BT=tokens[:, 1:]), loss)
    with pytest.raises(TypeError, match="with targets_BT takes the token ids alone"):
        model(tokens[:, :-1], attention_mask=torch.ones_like(tokens[:, :-1]), targets_BT=tokens[:, 1:])
