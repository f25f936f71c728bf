"""Built-in executors; importing the package registers each (see ``base.register_executor``)."""

import importlib

for _name in ("aten", "inductor", "cpp", "triton"):
    importlib.import_module(f"{__name__}.{_name}")
