"""transformers' GPT-2 as a user brings it to ``model.custom``: built from a config, random weights,
nothing downloaded (README: "Your own model").

    accelrun train configs/llama.yaml model.custom=examples.hf_gpt2:build train.steps=20
    accelrun ab configs/llama.yaml model.custom=examples.hf_gpt2:build --a compile.backend=eager \\
        --b compile.backend=accelrun --repeats 3 --steps 30

accelrun compiles its blocks, and its head (tied to the token table) with the cross-entropy as one
graph (``accelrun.models.causal_lm_head``); its dropout is drawn inside the compiled kernels.
"""

from __future__ import annotations

from torch import nn


def build(vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4, positions: int = 1024,
          dropout: float = 0.1) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=heads, n_positions=positions,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)
