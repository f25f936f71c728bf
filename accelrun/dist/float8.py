"""Float8 linear layers (``train.float8``, CUDA only): torchao's dynamic-scaling float8 training.

Each selected ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output gradient
are cast to float8 (e4m3 forward, e5m2 for gradients) with one scale per tensor from its amax, and the
matmuls run on the GPU's float8 tensor cores (H100 and newer); master weights and optimizer state
stay as they were. Which layers, as torchtitan chooses them:

- not the output head (``output``): the logits' precision decides the loss, and its backward is
  one large matmul of a few in the step;
- not a layer whose in or out features are not multiples of 16: float8 matmul kernels need
  16-element alignment (torch._scaled_mm).

torchao is imported only when the key is on (``pip install 'accelrun[float8]'``). The conversion
happens before tensor parallelism, compile and FSDP, so those see float8 layers, as torchtitan orders it.
"""

from __future__ import annotations

from torch import nn

from accelrun.config import ConfigError

HEAD_NAMES = frozenset({"output"})  # a family's output layer (Llama, Gemma, MoE): kept in high precision
ALIGNMENT = 16  # torch._scaled_mm: both matmul dims multiples of 16


def converts_to_float8(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (called ``fqn`` in the model) becomes a float8 linear layer."""
    if not isinstance(module, nn.Linear):
        return True  # torchao walks containers through this filter too: let it descend
    if fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def convert_to_float8(model: nn.Module) -> list[str]:
    """Swap the selected linear layers for torchao's float8 ones, in place; returns their names."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("train.float8 = true needs torchao (pip install 'accelrun[float8]'), which is not "
                          "installed; install it or set train.float8: false") from None
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and converts_to_float8(m, name)]
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=converts_to_float8)
    return chosen
