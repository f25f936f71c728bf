"""Model definitions: the built-in Llama family, FLOP counts, and user models by import path.

Named sizes are recipe files (``recipes/model/*.yaml``), not code. Importing this package pulls in
torch only (not the config schema).
"""

from .build import ModelBuildError, build_model, model_flops_per_token, model_summary, transformer_blocks
from .flops import flops_per_token, forward_flops_per_token, param_count
from .llama import Llama, LlamaArgs, RMSNorm, TransformerBlock

__all__ = [
    "Llama",
    "LlamaArgs",
    "ModelBuildError",
    "RMSNorm",
    "TransformerBlock",
    "build_model",
    "flops_per_token",
    "forward_flops_per_token",
    "model_flops_per_token",
    "model_summary",
    "param_count",
    "transformer_blocks",
]
