"""Built-in executors; importing the package registers each (see ``base.register_executor``)."""

import importlib

_MODULES = ("aten", "inductor", "cpp", "triton")

for _name in _MODULES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{_name}":
            raise
