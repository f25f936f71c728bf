"""transformers' Qwen2 as a user brings it to ``model.custom``: built from a config, random weights,
nothing downloaded, optionally with transformers' own gradient checkpointing (README: "Your own model").

    accelrun train configs/llama.yaml model.custom=examples.hf_qwen2:build train.steps=20
    accelrun ab configs/llama.yaml model.custom=examples.hf_qwen2:build train.precision=bf16-mixed \\
        --a compile.backend=eager --b compile.backend=accelrun --repeats 3 --steps 15
    accelrun ab configs/llama.yaml model.custom=examples.hf_qwen2:build model.kwargs.checkpointing=true \\
        --a compile.backend=eager --b compile.backend=accelrun --repeats 3 --steps 15

Under bf16 autocast its rotary embedding leaves queries and keys in fp32 and values in bf16, which
accelrun's attention pass casts as autocast does; under checkpointing its RMSNorm changes Python state
(the `kernels` package), which accelrun's traces allow once, in the forward.
"""

from __future__ import annotations

from torch import nn


def build(vocab: int = 512, dim: int = 192, layers: int = 4, heads: int = 6, kv_heads: int = 2, ffn: int = 512,
          checkpointing: bool = False) -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
                                      max_position_embeddings=1024)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
