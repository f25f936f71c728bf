"""Built-in graph passes: importing this package registers each one (see ``base.register_pass``)."""

import importlib

# One module per pass; each decorates its function with @register_pass.
_MODULES = (
    "dce", "cse", "simplify", "fuse_attention", "cpu_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope",
    "fuse_linear_cross_entropy", "merge_parallel_linears", "loss_row_stats", "remat", "cpu_half_gemm", "cpu_gemm", "cpu_dropout", "cpu_depthwise_conv", "reinplace", "partition_regions",
    "bucket_collectives", "schedule_overlap",
)  # fmt: skip

for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")
