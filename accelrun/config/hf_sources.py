"""Provenance of the model keys a Hugging Face folder sets: ``model.dim`` came from ``config.json``'s
``hidden_size`` on line 12, not from the recipe (whose value, if any, the folder replaced).

Errors that quote a key's source (a tokenizer larger than the model's vocabulary, say) then point at
the file a user has to look at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelrun.config.compose import Source
from accelrun.config.yaml_lines import KeyPath, load_yaml_with_lines

# accelrun model key -> the config.json key it is read from (several keys are read from the first
# one present). A key not listed is derived from model_type (arch, qkv_bias).
HF_KEY_NAMES: dict[str, tuple[str, ...]] = {
    "dim": ("hidden_size",),
    "n_layers": ("num_hidden_layers",),
    "n_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "ffn_dim": ("intermediate_size",),
    "vocab_size": ("vocab_size",),
    "norm_eps": ("rms_norm_eps",),
    "max_seq_len": ("max_position_embeddings", "sliding_window"),
    "tie_embeddings": ("tie_word_embeddings",),
    "init_std": ("initializer_range",),
    "rope_theta": ("rope_theta", "rope_parameters"),
    "rope_scaling": ("rope_scaling", "rope_parameters"),
    "head_dim": ("head_dim",),
}


def hf_key_sources(folder: str, keys: dict[str, Any]) -> dict[KeyPath, Source]:
    """``("model", key)`` -> the line of ``folder``'s config.json that set it, for each of ``keys``
    (what ``model_keys_from_hf_folder`` returned). A key the file leaves out (a transformers default)
    points at the ``model_type`` line, the line that chose the defaults."""
    path = Path(folder).expanduser() / "config.json"
    located = load_yaml_with_lines(path.read_text(), str(path))  # JSON is YAML: the recipes' own line finder
    config = located.data
    lines = {key[0]: line for key, line in located.lines.items() if len(key) == 1}
    fallback = lines.get("model_type") or lines.get("architectures")
    out: dict[KeyPath, Source] = {}
    for key in keys:
        if key == "hf":
            continue
        present = [k for k in HF_KEY_NAMES.get(key, ()) if k in config]
        # the one whose value it took, where several are read: a Mistral's max_seq_len is its
        # sliding_window where that is the shorter (a new user read "max_position_embeddings" beside 32)
        took = [k for k in present if config[k] == keys[key]]
        hf_key = (took or present or ["model_type"])[0]
        line = lines.get(hf_key, fallback)
        out[("model", key)] = Source("file", file=str(path), line=line, text=hf_key)
        for sub in keys[key] if isinstance(keys[key], dict) else ():  # rope_scaling's own keys
            out[("model", key, sub)] = out[("model", key)]
    return out
