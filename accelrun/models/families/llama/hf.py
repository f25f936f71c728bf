"""Llama-family weights in Hugging Face's names and layout, both ways (Llama 2/3/3.1, Mistral, Qwen2).

Two differences besides names: Hugging Face rotates the two halves of each head's q/k features
(``rotate_half``) where accelrun rotates adjacent pairs (Meta's layout), so q/k rows (and Qwen2's q/k
biases) are permuted within each head; and a tied output layer is absent from HF files.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_BLOCK = {  # accelrun name inside layers.<i> -> HF name inside model.layers.<i>
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ENDS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(name: str, args: Any = None) -> str:
    """accelrun parameter name -> the HF checkpoint's name."""
    if name in _ENDS:
        return _ENDS[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def _heads(name: str, args: Any, rows: int) -> int | None:
    """How many whole heads ``rows`` rows of a q/k tensor hold (they need the rotary permutation),
    else None."""
    if ".attention.wq." in name or ".attention.wk." in name:
        return rows // args.head_dim
    return None


def row_block(name: str, args: Any) -> int:
    """Rows that must be read together (one head's for q/k: the permutation stays inside a head)."""
    return args.head_dim if _heads(name, args, args.head_dim) else 1


def to_pairs(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rows of each head -> adjacent pairs (rows 2r, 2r+1 = HF's rows r, r + E/2)."""
    rest = t.shape[1:]
    return t.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(t.shape)


def to_halves(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_pairs`."""
    rest = t.shape[1:]
    return t.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(t.shape)


def from_hf_tensor(name: str, t: torch.Tensor, args: Any) -> torch.Tensor:
    """The HF tensor (or a block of whole heads of it) for accelrun parameter ``name``, in accelrun's layout."""
    heads = _heads(name, args, t.shape[0])
    return t if heads is None else to_pairs(t, heads)


def to_hf_tensor(name: str, t: torch.Tensor, args: Any) -> torch.Tensor:
    heads = _heads(name, args, t.shape[0])
    return t if heads is None else to_halves(t, heads)


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        out[hf_name(name)] = to_hf_tensor(name, t, args).contiguous()
    return out


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    names = {hf_name(n): n for n in expected_names(args)}
    return {names[k]: from_hf_tensor(names[k], t, args) for k, t in sd.items() if k in names}


def expected_names(args: Any) -> list[str]:
    """accelrun's parameter names of a whole model with shape ``args`` (the tied output left out)."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        for block_name in _BLOCK:
            names.append(f"layers.{i}.{block_name}.weight")
            if args.qkv_bias and block_name in ("attention.wq", "attention.wk", "attention.wv"):
                names.append(f"layers.{i}.{block_name}.bias")
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("output.weight")
    return names


def decoder_config(args: Any, *, architecture: str, model_type: str, hidden_act: str) -> dict[str, Any]:
    """The config.json keys a decoder of shape ``args`` has in every family here (transformers' names)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "hidden_act": hidden_act,
        "rope_theta": args.rope_theta,
        "torch_dtype": "float32",
    }


def hf_config(args: Any) -> dict[str, Any]:
    """config.json for a model of shape ``args``: qwen2 when it has q/k/v biases, else llama."""
    qwen = bool(args.qkv_bias)
    config = decoder_config(args, architecture="Qwen2ForCausalLM" if qwen else "LlamaForCausalLM",
                            model_type="qwen2" if qwen else "llama", hidden_act="silu")
    if not qwen:
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False)
    s = args.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if s is not None:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config["rope_parameters"] = rope  # transformers >= 5 reads this; older versions rope_theta/rope_scaling
    return config
