"""The planner's efficiency constants: one fixed set for every recipe and every cluster.

They turn a datasheet figure into the rate a training step achieves. They were set from what the
kernels are known to reach and were not changed after comparing with published training runs: they
are not fitted, per case or overall. ``tests/plan/test_plan_published.py`` checks predictions made
with them against torchtitan's published Llama 3.1 runs: 8B with FSDP, 70B with FSDP × TP and 405B
with FSDP × TP × PP (1F1B and interleaved). Figures a cluster description marks as
measured (``accelrun plan --calibrate``) are already achieved rates and are used as they are.
"""

from __future__ import annotations

# Matrix multiplies: fraction of the dense datasheet peak. Large bf16 GEMMs sustain about 70–85% of
# the datasheet figure in cuBLAS on A100 and H100; a training step's products are smaller in one
# dimension (weight gradients reduce over tokens, key/value projections are narrow) and run near
# the low end.
MATMUL_OF_PEAK = 0.70

# Fused (flash) attention, forward and backward, on the FLOPs it executes (half the score matrix
# under a causal mask, scores recomputed in backward): FlashAttention-2, PyTorch's fused SDPA kernel,
# reaches 50–70% of peak forward on A100 but about 35% on H100, which it does not program with
# Hopper's asynchronous tensor-core instructions; backward is slower than forward.
ATTENTION_OF_PEAK = 0.35

# Elementwise and reduction kernels: fraction of the datasheet DRAM bandwidth. Large streaming
# kernels reach 80–90%; eager PyTorch's many small ones sit at the low end.
MEMORY_OF_PEAK = 0.80

# Collectives: fraction of a link's per-direction bandwidth that a ring collective's bus bandwidth
# reaches (nccl-tests all-gather on 8 H100 over NVLink: about 350–370 of 450 GB/s; on InfiniBand or
# RoCE, 80–95% of the line rate).
NETWORK_OF_PEAK = 0.80

# Backward's working set at its peak, as a share of one block's saved activations: the gradients of
# activations alive at once while the block's own saved tensors are freed as fast as they are used
# (measured on the debug Llama, CPU allocator: 0.23-0.33 of a block nothing checkpointed, eager and
# compiled; near 0 on top of a rebuilt block; tests/plan/test_plan_checkpoint_memory.py).
BACKWARD_WORKING_SET_OF_BLOCK = 0.25

# Memory the caching allocator holds above the peak of live tensors (block rounding, segments
# cached for reuse): published memory figures are the allocator's reserved peak.
ALLOCATOR_OVERHEAD = 0.05

# Device memory a GPU process cannot give to tensors: the CUDA context and communicator buffers.
GPU_RESERVED_GIB = 1.0

# Backward of flash attention executes 2.5x the forward's FLOPs (five matmuls to the forward's two).
ATTENTION_BACKWARD_RATIO = 2.5


def describe() -> list[tuple[str, float, str]]:
    """(name, value, what it scales) for the report."""
    return [
        ("MATMUL_OF_PEAK", MATMUL_OF_PEAK, "datasheet dense peak → matmul rate"),
        ("ATTENTION_OF_PEAK", ATTENTION_OF_PEAK, "datasheet dense peak → fused attention rate"),
        ("MEMORY_OF_PEAK", MEMORY_OF_PEAK, "datasheet memory bandwidth → elementwise kernels"),
        ("NETWORK_OF_PEAK", NETWORK_OF_PEAK, "link bandwidth → collective bus bandwidth"),
        ("ALLOCATOR_OVERHEAD", ALLOCATOR_OVERHEAD, "allocator reserve above live tensors"),
    ]
