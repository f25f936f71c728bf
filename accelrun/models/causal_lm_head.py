"""transformers' causal language models with their output head and loss as one step, as the built-in
families have it (``head_loss``).

transformers' ``LlamaForCausalLM.forward`` returns every position's logits, [batch, seq, vocab], and
training takes the cross-entropy of them afterwards. Eagerly that holds the logits and their fp32
log-softmax, two [tokens, vocab] tensors (4 GiB each for 8k tokens of a 128k vocabulary), and the
output head's product runs outside every compiled graph. ``attach_loss_head`` gives such a model what
a family's has: a ``head_loss(h, targets)`` (the head's product and the cross-entropy, which
``compile.scope: loss`` compiles as one graph, where accelrun fuses them in chunks of rows: the logits
never exist whole) and a forward that, given ``targets_BT``, returns that loss. The forward still runs
inside the model's own ``__call__``, so hooks on the model (FSDP's gathers of the embedding and the
head) run as before; without ``targets_BT`` it is the class's own forward.

Only classes whose forward is exactly ``lm_head(<base>(...).last_hidden_state)`` qualify (no logit
soft-capping as in Gemma 2, no scale as in Cohere or Granite): ``PLAIN_HEADS``, each checked against
the class's own forward by tests/models/test_causal_lm_head.py. A subclass that overrides
``forward`` does not qualify.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The forward's owner, by module and name, and the attribute path of the base model whose last hidden
# state its head multiplies: the logits are ``lm_head(<base>(...).last_hidden_state)``, nothing after it.
PLAIN_HEADS: dict[str, str] = {f"transformers.models.{module}.modeling_{module}.{cls}": base for module, cls, base in (
    ("llama", "LlamaForCausalLM", "model"),
    ("mistral", "MistralForCausalLM", "model"),
    ("qwen2", "Qwen2ForCausalLM", "model"),
    ("qwen3", "Qwen3ForCausalLM", "model"),
    ("phi3", "Phi3ForCausalLM", "model"),
    ("phi", "PhiForCausalLM", "model"),
    ("olmo", "OlmoForCausalLM", "model"),
    ("olmo2", "Olmo2ForCausalLM", "model"),
    ("gemma", "GemmaForCausalLM", "model"),
    ("smollm3", "SmolLM3ForCausalLM", "model"),
    ("starcoder2", "Starcoder2ForCausalLM", "model"),
    ("stablelm", "StableLmForCausalLM", "model"),
    ("gpt2", "GPT2LMHeadModel", "transformer"),
    ("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox"),
    ("gpt_bigcode", "GPTBigCodeForCausalLM", "transformer"),
    ("gptj", "GPTJForCausalLM", "transformer"),
    ("falcon", "FalconForCausalLM", "transformer"),
    ("bloom", "BloomForCausalLM", "transformer"),
    ("opt", "OPTForCausalLM", "model.decoder"),
)}  # fmt: skip

# On a model this module gave them: its functions on the instance, by name, which the graph cache
# compiles in place of the class's methods and does not take for wrappers (graph_cache.instance_methods).
METHODS = "accelrun_methods"


def forward_owner(model: nn.Module) -> str | None:
    """``module.Class`` of the class whose ``forward`` the model runs."""
    owner = next((c for c in type(model).__mro__ if "forward" in vars(c)), None)
    return None if owner is None else f"{owner.__module__}.{owner.__qualname__}"


def base_model(model: nn.Module) -> nn.Module | None:
    """The module whose last hidden state the head of a ``PLAIN_HEADS`` model multiplies, or None for a
    model of another class (or one without it)."""
    path = PLAIN_HEADS.get(forward_owner(model) or "")
    if path is None:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def has_plain_head(model: nn.Module) -> bool:
    """Whether the model's forward is one of ``PLAIN_HEADS``' (and it has their two parts)."""
    return isinstance(getattr(model, "lm_head", None), nn.Linear) and base_model(model) is not None


def attach_loss_head(model: nn.Module) -> bool:
    """Give a model of ``PLAIN_HEADS`` a ``head_loss`` and a forward that takes ``targets_BT``; whether
    it did. On this instance (not its class: ``save_pretrained`` writes the class's name) as partials of
    the model, which pickle and deep copies rebind to the copy (a bound method is pickled as
    ``getattr(model, name)``, which an unpickled model does not have yet). The forward keeps its
    class's signature, plus ``targets_BT``: transformers' ``generate`` reads it."""
    if loss_head_attached(model):
        return True
    if not has_plain_head(model):
        return False
    own = inspect.signature(type(model).forward)
    params = list(own.parameters.values())[1:]  # without self
    targets = inspect.Parameter("targets_BT", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    model.forward = functools.partial(forward, model)
    model.forward.__signature__ = own.replace(parameters=[*params[:at], targets, *params[at:]])
    model.head_loss = functools.partial(head_loss, model)
    model.has_head = True  # compile_model's test for a model whose head is on this rank
    setattr(model, METHODS, {"forward": forward, "head_loss": head_loss})
    return True


def detach_loss_head(model: nn.Module) -> None:
    """Undo ``attach_loss_head``: the model is its class's again (the logits whole, the loss outside)."""
    for name in (*getattr(model, METHODS, {}), "has_head", METHODS):
        model.__dict__.pop(name, None)


def loss_head_attached(model: nn.Module) -> bool:
    return "head_loss" in getattr(model, METHODS, {})


def forward(self: nn.Module, input_ids: torch.Tensor | None = None, *args: Any,
            targets_BT: torch.Tensor | None = None, **kwargs: Any) -> Any:  # fmt: skip
    if targets_BT is None:
        return type(self).forward(self, input_ids, *args, **kwargs)
    # With targets, the call training makes: the token ids alone (anything more would go unread)
    if input_ids is None or args or kwargs:
        raise TypeError(f"{type(self).__name__}.forward with targets_BT takes the token ids alone "
                        f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments besides)")
    hidden_BTD = base_model(self)(input_ids=input_ids, use_cache=False).last_hidden_state
    return self.head_loss(hidden_BTD, targets_BT)


def head_loss(self: nn.Module, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the head's logits against the targets, as ``training_loss_fn`` takes it of
    the class's own forward's logits (in fp32)."""
    return next_token_loss(self.lm_head(h_BTD), targets_BT)


def next_token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """The loss training takes of a user's model's logits: mean cross-entropy, in fp32."""
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
