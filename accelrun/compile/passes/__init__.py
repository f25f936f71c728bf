"""Built-in graph passes: importing this package registers each one (see ``base.register_pass``)."""

import importlib

# One module per pass. A module that is missing (a pass not written yet) is skipped here so the
# registry holds what exists; `resolve_passes` then names the unknown pass in the recipe's error.
_MODULES = (
    "dce", "cse", "fuse_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope",
    "fuse_linear_cross_entropy", "remat", "partition_regions",
)  # fmt: skip

for _name in _MODULES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{_name}":
            raise
