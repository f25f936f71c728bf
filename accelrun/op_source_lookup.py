"""torch.library finds a custom op's source line (for its error messages) through ``inspect``, whose
first lookup of a frame's module walks every module loaded so far and resolves each one's path: 30-50
ms in a process that has imported torch and transformers' Llama (3,138 modules), paid by the first
``torch.library.custom_op`` accelrun defines, in every new process, its warm start included.

``known_to_inspect(__name__)``, called by a module before it defines ops, tells ``inspect`` which module
its own file is (the entry the walk would have made for it), so the lookup is a dictionary read.
"""

from __future__ import annotations

import inspect
import os
import sys


def known_to_inspect(module_name: str) -> None:
    """Record ``module_name``'s file in ``inspect``'s file-to-module table, under each spelling
    ``inspect.getmodule`` looks it up by (as given, absolute, resolved)."""
    path = getattr(sys.modules[module_name], "__file__", None)
    if path is None:
        return
    table = getattr(inspect, "modulesbyfile", None)
    if isinstance(table, dict):  # a Python that keeps no such table: the walk, as before
        for spelling in {path, os.path.normcase(os.path.abspath(path)), os.path.realpath(path)}:
            table.setdefault(spelling, module_name)
