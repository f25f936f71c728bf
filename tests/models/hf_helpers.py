"""Tiny transformers models saved into a folder, for the Hugging Face interop tests (nothing downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def save_tiny_hf(folder: Path, kind: str = "llama", seed: int = 0, **save_kwargs) -> torch.nn.Module:
    """A transformers CausalLM of family ``kind`` (llama, llama3, qwen2, mistral, tied; gemma, with a head
    dimension of its own, and gemma-untied) with random weights (norms too, so a swapped norm shows),
    saved into ``folder``; returns the model."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(SHAPE)
    if kind == "llama3":
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if kind == "tied":
        kw["tie_word_embeddings"] = True
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    elif kind.startswith("gemma"):  # 4 heads of 24 in a 64-wide model: the attention is 96 wide
        config = transformers.GemmaConfig(**kw, head_dim=24, tie_word_embeddings=kind == "gemma")
        model = transformers.GemmaForCausalLM(config)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw, sliding_window=48))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(folder, **save_kwargs)
    return model
