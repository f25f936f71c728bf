"""Defining accelrun's custom ops does not walk every loaded module (accelrun.op_source_lookup): torch.library
looks up each op's source line through ``inspect``, whose first lookup resolved the paths of the loaded
modules (503 paths in a process of torch and accelrun, 1,645 modules; more with transformers' Llama's
3,138: 30-50 ms of every new process's warm start)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

COUNT_WALK = """
import os, sys, inspect
import torch
resolved = []
real = os.path.realpath
os.path.realpath = lambda p, *a, **k: (resolved.append(p), real(p, *a, **k))[1]
import accelrun.compile.fused.attention, accelrun.compile.fused.depthwise_conv, accelrun.models.document_attention
os.path.realpath = real
ops = [torch.ops.accelrun.dropout_uniform, torch.ops.accelrun.cpu_attention, torch.ops.accelrun.depthwise_conv1d,
       torch.ops.accelrun.document_attention]
print(len(resolved), len(sys.modules))
"""


def test_defining_the_ops_walks_no_loaded_module():
    done = subprocess.run([sys.executable, "-c", COUNT_WALK], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved, modules = map(int, done.stdout.split())
    assert modules > 1000 and resolved < 20, (resolved, modules)  # the walk resolves one path per module
