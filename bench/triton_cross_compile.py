"""Every Triton kernel accelrun generates for its test regions, the debug Llama and an 8B-shaped block,
cross-compiled by Triton's real compiler for each target GPU, with registers and spills (ptxas -v).

Needs no GPU. The cases are those of tests/compile/test_triton_real_compile.py (which asserts on a
subset, for time); here all of them run for every target, in fp32 and bf16 (the 8B block's bf16: its
parameters in bf16, since autocast leaves meta tensors alone):

    python bench/triton_cross_compile.py                 # sm_90 and sm_100
    python bench/triton_cross_compile.py --arch 90

Prints a line per kernel and target, then ``triton cross-compile: N kernels, F failed, S spilled``;
exits 1 if any kernel failed to compile or spilled.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CASES = REPO / "tests" / "compile" / "test_triton_real_compile.py"


def load_cases():
    if str(REPO) not in sys.path:  # the cases import their helpers as ``tests.compile...``
        sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("triton_real_compile_cases", CASES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90,100", help="compute capabilities, comma-separated (default 90,100)")
    archs = tuple(int(a) for a in parser.parse_args().arch.split(","))
    warnings.filterwarnings("ignore")
    cases = load_cases()
    from accelrun.models.families.llama.model import LlamaArgs

    rows, declined = [], []

    def add(case, regions):
        r, d = cases.compile_regions(case, regions, archs)
        rows.extend(r)
        declined.extend(d)

    for width in cases.WIDTHS:
        for dtype in (torch.float32, torch.bfloat16):
            for name, regions in cases.width_regions(width, dtype).items():
                add(f"{name}_{str(dtype)[6:]}_{width}", regions)
    debug = LlamaArgs(dim=192, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=512, max_seq_len=256)
    tokens = torch.randint(0, 512, (16, 256), generator=torch.Generator().manual_seed(0))
    for autocast in (False, True):
        add("debug_llama_" + ("bf16" if autocast else "fp32"), cases.llama_regions(debug, tokens, "cpu", autocast))
    big = LlamaArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                    max_seq_len=2048)  # fmt: skip
    tokens = torch.zeros(1, 2048, dtype=torch.int64, device="meta")
    add("llama_8b_block_fp32", cases.llama_regions(big, tokens, "meta"))
    add("llama_8b_block_bf16", cases.llama_regions(big, tokens, "meta", dtype=torch.bfloat16))
    cases.report(rows, declined)
    return 1 if any(r.error is not None or r.spill_bytes for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
