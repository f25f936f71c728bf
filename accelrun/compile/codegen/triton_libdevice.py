"""The ``libdevice`` a generated Triton module calls: Triton's own, except under ``TRITON_INTERPRET=1``.

Triton's interpreter runs a kernel as Python over numpy arrays, with ``tl`` patched; it leaves
``triton.language.extra.libdevice`` alone, and those calls come back as ``None`` (the first use then
fails with an unrelated-looking error). Under the interpreter the module gets this stand-in instead:
the same names, computed by numpy on the interpreter's values, so kernels with ``tanh`` (GELU),
``pow``, ``log1p``, ``expm1`` or ``trunc`` are checked against eager too. On a GPU (and in the
cross-compile check) nothing changes: the generated code names Triton's libdevice.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any


def _interpreted() -> Any:
    import numpy as np
    import triton.language as tl

    from accelrun.torch_private import TensorHandle

    def elementwise(np_fn):
        def call(*args: Any, **_: Any) -> Any:
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            arrays = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a) for a in args]
            dtype = tensors[0].handle.dtype.scalar  # libdevice's overloads take operands of one type
            with np.errstate(all="ignore"):  # inf and NaN are values here, as on the device
                out = np.asarray(np_fn(*arrays)).astype(tensors[0].handle.data.dtype)
            block = tl.block_type(dtype, list(out.shape)) if out.ndim else dtype
            return tl.tensor(TensorHandle(out, dtype), block)

        return call

    return SimpleNamespace(tanh=elementwise(np.tanh), pow=elementwise(np.power), log1p=elementwise(np.log1p),
                           expm1=elementwise(np.expm1), trunc=elementwise(np.trunc))


def libdevice_for_this_process() -> Any:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _interpreted()
    from triton.language.extra import libdevice

    return libdevice
