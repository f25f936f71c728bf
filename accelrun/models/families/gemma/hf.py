"""Gemma weights in Hugging Face's names and layout, both ways, and its ``config.json``.

Inside the blocks the names and the q/k row permutation are Llama's (``families.llama.hf``; HF's
``rotate_half`` against accelrun's adjacent pairs). The norms' weights need no conversion: both store
w and scale by (1 + w). A tied output layer is absent from HF files.
"""

from __future__ import annotations

from typing import Any

import torch

from accelrun.models.families.llama import hf as llama_hf

_ENDS = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight"}

from_hf_tensor = llama_hf.from_hf_tensor
row_block = llama_hf.row_block


def hf_name(name: str, args: Any = None) -> str:
    """accelrun parameter name -> the HF checkpoint's name."""
    if name in _ENDS:
        return _ENDS[name]
    return llama_hf.hf_name(name)  # layers.<i>.…: the same block names as Llama's


def expected_names(args: Any) -> list[str]:
    """accelrun's parameter names of a whole model of shape ``args`` (the tied output left out)."""
    names = ["embed_tokens.weight"]
    names += [n for n in llama_hf.expected_names(args) if n.startswith("layers.")]  # no q/k/v biases
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("lm_head.weight")
    return names


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        out[hf_name(name)] = llama_hf.to_hf_tensor(name, t, args).contiguous()
    return out


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    names = {hf_name(n): n for n in expected_names(args)}
    return {names[k]: from_hf_tensor(names[k], t, args) for k, t in sd.items() if k in names}


def hf_config(args: Any) -> dict[str, Any]:
    """config.json for a Gemma of shape ``args`` (transformers' ``GemmaConfig`` keys)."""
    config = llama_hf.decoder_config(args, architecture="GemmaForCausalLM", model_type="gemma",
                                     hidden_act="gelu_pytorch_tanh")
    config.update(attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    return config
