"""Tensor parallelism for the Llama blocks (Megatron layout).

Column-wise: q, k, v and the SwiGLU gate/up projections (each rank holds a slice of the heads and
of the hidden width); row-wise: the attention output and down projections (partial sums reduced
into a replicated residual stream). Embedding and output layer are split by rows/columns with
replicated outputs, so the loss sees full logits. The attention code infers its local head count
from the projection widths, so the model needs no change.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    # The recipe was checked before launch (accelrun.dist.mesh.check_supported): a built-in,
    # untied Llama.
    ends = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}
    # A pipeline stage may lack either end.
    parallelize_module(model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None})
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
