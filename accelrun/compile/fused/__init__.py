"""Fused ops that the pattern-fusion passes put into pre-grad graphs.

Each is a plain function (so a dumped graph names it: ``accelrun.compile.fused.rmsnorm.rms_norm``) that
calls a ``torch.autograd.Function``: the forward is written with torch ops and the backward by hand,
cheaper than autograd's (it saves less, or recomputes instead of saving). AOTAutograd traces both into
ATen ops, so later passes and the executors see ordinary graphs. Each module is one op.

``attention`` and ``depthwise_conv`` are the exceptions: C++ kernels behind torch.library custom ops
(forward and backward), which AOTAutograd keeps as single nodes; the ``cpu_attention`` pass calls the
first before autograd, the ``cpu_depthwise_conv`` pass puts the second into the forward and backward
graphs after it.
"""

from accelrun.compile.fused.linear_cross_entropy import linear_cross_entropy
from accelrun.compile.fused.rmsnorm import rms_norm
from accelrun.compile.fused.rope import rope
from accelrun.compile.fused.swiglu import swiglu

__all__ = ["linear_cross_entropy", "rms_norm", "rope", "swiglu"]
