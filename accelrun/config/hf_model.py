"""Read a Hugging Face model folder's ``config.json`` into the recipe's ``model`` keys (no torch).

Each supported ``model_type`` maps onto a family accelrun builds; the weights are read later, by the
family (``accelrun.models.families``), once the model exists. This lives in the config layer because
the shape decides everything downstream that must stay torch-free (validation, the planner, FLOPs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from accelrun.config.errors import ConfigError

# model_type → (family, its CausalLM class name). One line per supported Hugging Face architecture.
HF_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("llama", "Qwen2ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
}
# Keys a config.json may leave out, with the default transformers' config class gives them where it is not
# what the code below assumes (a hand-written Mistral config had no sliding window and full-width KV heads
# here, 4096 and 8 in transformers: a trial's reading).
HF_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 131072},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "gemma": {"head_dim": 256, "num_key_value_heads": 16, "max_position_embeddings": 8192},
}
# Gemma's activation: transformers reads hidden_activation (4.x) or hidden_act, and maps the legacy
# "gelu" of the published configs to the tanh approximation, which is what the family computes.
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


class HFModelError(ConfigError):
    """A Hugging Face model folder accelrun cannot use; the message names the file and key."""


def supported() -> str:
    return ", ".join(f"{t} ({cls})" for t, (_, cls) in HF_MODEL_TYPES.items())


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder).expanduser() / "config.json"
    if not Path(folder).expanduser().is_dir():
        what = ("no such folder (a local transformers folder: config.json, weights and tokenizer; "
                "`accelrun data examples` writes a tiny one, models/my-chat-model)")
        if path.parent.is_file():
            what = "a file, not a folder (give the folder holding config.json)"
        raise HFModelError(f"model.hf = {str(folder)!r}: {what}")
    if not path.is_file():
        raise HFModelError(f"model.hf: {path} not found (a Hugging Face model folder has a config.json)"
                           + _run_folder_hint(Path(folder).expanduser()))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFModelError(f"model.hf: {path} is not readable JSON: {e}") from None


# What marks an accelrun run folder (report.rundir), and the folder its exported model goes to
# (checkpoint.hf_on_finish, accelrun.train.run).
RUN_FOLDER_FILES = ("config.yaml", "command.txt")
RUN_EXPORT_FOLDER = "hf"


def _run_folder_hint(folder: Path) -> str:
    """model.hf given an accelrun run folder: the exported model is in its hf/, or not exported yet."""
    if not all((folder / f).is_file() for f in RUN_FOLDER_FILES):
        return ""
    export = folder / RUN_EXPORT_FOLDER
    if (export / "config.json").is_file():
        return f"; {folder} is an accelrun run folder: its exported model is in {export}/ (model.hf={export})"
    return (f"; {folder} is an accelrun run folder with no exported model in {export}/: write one with "
            f"`accelrun export {folder} --hf {export}` (or train with checkpoint.hf_on_finish = true)")


def hf_model_type(config: dict[str, Any], path: str) -> str:
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        by_class = {cls: t for t, (_, cls) in HF_MODEL_TYPES.items()}
        model_type = next((by_class[a] for a in config.get("architectures") or [] if a in by_class), None)
    if model_type is None:
        raise HFModelError(
            f"model.hf: {path}: model_type {config.get('model_type')!r} (architectures "
            f"{config.get('architectures')}) is not supported; supported: {supported()}"
        )
    return model_type


def _rope(config: dict[str, Any], path: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, rope scaling keys or None): transformers 4 writes rope_theta + rope_scaling, 5 writes
    rope_parameters (with rope_theta inside)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFModelError(f"model.hf: {path}: rope scaling type {kind!r} is not supported (default, llama3)")
    return float(theta), {
        "type": "llama3",
        "factor": scaling["factor"],
        "low_freq_factor": scaling["low_freq_factor"],
        "high_freq_factor": scaling["high_freq_factor"],
        "original_max_seq_len": scaling["original_max_position_embeddings"],
    }


def model_keys_from_hf_folder(folder: str) -> dict[str, Any]:
    """The ``model`` keys (dim, n_layers, ...) that ``folder``'s config.json describes."""
    config = read_hf_config(folder)
    path = str(Path(folder).expanduser() / "config.json")
    model_type = hf_model_type(config, path)
    config = {**HF_CLASS_DEFAULTS.get(model_type, {}), **config}  # (a key written as null stays null)
    _no_attention_dropout(config, path)
    family = HF_MODEL_TYPES[model_type][0]
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        keys: dict[str, Any] = {
            "arch": family,
            "dim": dim,
            "n_layers": int(config["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "ffn_dim": int(config["intermediate_size"]),
            "vocab_size": int(config["vocab_size"]),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "max_seq_len": int(config.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "init_std": float(config.get("initializer_range", 0.02)),
            "qkv_bias": model_type == "qwen2",
        }
    except KeyError as e:
        raise HFModelError(f"model.hf: {path} has no {e.args[0]!r} key") from None
    keys["rope_theta"], keys["rope_scaling"] = _rope(config, path)
    if family == "gemma":
        _gemma_keys(config, path, keys)
        keys["hf"] = str(Path(folder).expanduser().resolve())
        return keys
    keys["head_dim"] = None  # a Llama's is hidden_size / heads (checked below); no base recipe's may stay

    unsupported = {  # a key whose value accelrun's family cannot express: refuse rather than differ
        "hidden_act": (config.get("hidden_act", "silu") not in ("silu", "swish"), "only silu"),
        "attention_bias": (model_type != "qwen2" and bool(config.get("attention_bias")), "only false"),
        "mlp_bias": (bool(config.get("mlp_bias")), "only false"),
        "head_dim": (config.get("head_dim") not in (None, dim // heads), f"only hidden_size / heads = {dim // heads}"),
        "use_sliding_window": (model_type == "qwen2" and bool(config.get("use_sliding_window")), "only false"),
    }
    for key, (bad, allowed) in unsupported.items():
        if bad:
            raise HFModelError(f"model.hf: {path}: {key} = {config.get(key)!r} is not supported ({allowed})")
    window = config.get("sliding_window") if model_type == "mistral" else None
    if window:
        # Attention over at most `window` positions is full causal attention: exact up to there.
        keys["max_seq_len"] = min(keys["max_seq_len"], int(window))
    if not math.isfinite(keys["rope_theta"]):
        raise HFModelError(f"model.hf: {path}: rope_theta is not a finite number")
    # Absolute, so the ranks (and a later resume from another directory) find the same folder.
    keys["hf"] = str(Path(folder).expanduser().resolve())
    return keys


def _no_attention_dropout(config: dict[str, Any], path: str) -> None:
    """accelrun's families have no attention dropout: a folder that sets one is refused, not trained
    without it (a trial's attention_dropout 0.5 trained as 0, without a word)."""
    rate = config.get("attention_dropout") or 0.0
    if not isinstance(rate, int | float) or float(rate) != 0.0:
        raise HFModelError(f"model.hf: {path}: attention_dropout = {rate!r} is not supported (only 0: accelrun's "
                           "model of this folder has no dropout; model.custom with a factory returning "
                           "transformers' own class applies it)")


def _gemma_keys(config: dict[str, Any], path: str, keys: dict[str, Any]) -> None:
    """Gemma's own keys and defaults (transformers' GemmaConfig), and what the family cannot express."""
    keys["head_dim"] = int(config.get("head_dim") or keys["dim"] // keys["n_heads"])
    keys["tie_embeddings"] = bool(config.get("tie_word_embeddings", True))
    act_key = "hidden_activation" if config.get("hidden_activation") is not None else "hidden_act"
    act = config.get(act_key, "gelu_pytorch_tanh")
    allowed = GEMMA_ACTIVATIONS if act_key == "hidden_act" else GEMMA_ACTIVATIONS[:1]
    rope_key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"  # transformers 4 / 5
    unsupported = {
        act_key: (act not in allowed, f"only {' or '.join(allowed)}"),
        "attention_bias": (bool(config.get("attention_bias")), "only false"),
        "use_bidirectional_attention": (bool(config.get("use_bidirectional_attention")), "only false"),
        rope_key: (keys["rope_scaling"] is not None, "only the default rotary embedding"),
    }
    for key, (bad, allowed_text) in unsupported.items():
        if bad:
            raise HFModelError(f"model.hf: {path}: {key} = {config.get(key)!r} is not supported ({allowed_text})")
