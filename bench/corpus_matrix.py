"""The compiler's differential corpus, whole: every model of ``tests/compile/corpus_models.py`` (transformers'
causal LMs and plain-nn models) × pass preset (default, max) × executor (cpp, aten) × dtype (fp32, bf16), plus
Triton under its interpreter in fp32, one training step each against eager (the checks and tolerances of
``tests/compile/test_hf_corpus.py``: loss, every gradient and buffer; strict, so a fallback fails).

    python bench/corpus_matrix.py                       # the whole matrix: a parity table, then failures
    python bench/corpus_matrix.py --models llama gpt2 --executors cpp

The suite runs a pairwise covering subset of this matrix (each model with each level of every factor,
each pair of factor levels somewhere); this is the rest, for a note's table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.compile

import torch  # noqa: E402

from tests.compile.corpus_models import MODELS  # noqa: E402
from tests.compile.test_hf_corpus import _check_step  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--presets", nargs="+", default=["default", "max"])
    ap.add_argument("--executors", nargs="+", default=["cpp", "aten", "triton"])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch._logging.set_logs(dynamo=50, aot=50, inductor=50)
    combos = [(p, e, d) for p in a.presets for e in a.executors for d in a.dtypes
              if e != "triton" or (d == "fp32" and p == "default")]  # the interpreter: fp32, default passes
    failures = []
    head = " ".join(f"{p[:3]}/{e}/{d}" for p, e, d in combos)
    print(f"{'model':<16} {head}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        for name in a.models:
            cells = []
            for preset, executor, dname in combos:
                if executor == "triton":
                    os.environ["TRITON_INTERPRET"] = "1"  # read when the generated module is imported
                try:
                    _check_step(name, preset, executor, DTYPES[dname], Path(cache))
                    cells.append("ok")
                except Exception as e:  # an assertion (numbers, fallback) or a crash: recorded, go on
                    cells.append("FAIL")
                    failures.append((name, preset, executor, dname, e))
                finally:
                    os.environ.pop("TRITON_INTERPRET", None)
                torch._dynamo.reset()
            print(f"{name:<16} " + " ".join(f"{c:>{len(f'{p[:3]}/{e}/{d}')}}" for c, (p, e, d)
                                             in zip(cells, combos, strict=True)), flush=True)
    total = len(a.models) * len(combos)
    print(f"corpus matrix: ok {total - len(failures)} / {total} in {time.perf_counter() - t0:.0f} s")
    for name, preset, executor, dname, e in failures:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        print(f"  FAIL {name} {preset} {executor} {dname}: {last[:400]}")


if __name__ == "__main__":
    main()
