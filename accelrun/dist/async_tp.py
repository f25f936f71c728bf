"""Asynchronous tensor parallelism (``parallel.async_tp``, CUDA only).

Under TP a column-parallel matmul waits for the all-gather of its input (sequence parallelism) and a
row-parallel one's output waits in a reduce-scatter. Inductor's micro-pipeline pass
(``torch._inductor.config._micro_pipeline_tp``) rewrites each such pair in the compiled graph into a
fused op that splits the matmul into chunks and moves each chunk over symmetric memory (buffers every
rank of the group can address, NVLink peer access) while the next chunk computes. The TP group's
symmetric memory must be enabled before the first compile. Needs compile.backend = inductor (the pass
is Inductor's) and tp > 1; the recipe checks say so before a rank starts (accelrun.config.gpu_only).
"""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on Inductor's micro-pipelined TP and symmetric memory for this rank's TP group."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # The pass matches all-gather → matmul and matmul → reduce-scatter in post-grad graphs.
    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # torch 2.13 enables it itself and calls this deprecated; older ones need it
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
