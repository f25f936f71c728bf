"""PyTorch's OpInfo database through accelrun (and Inductor, to compare): every differentiable op with
the dtype on the CPU, its first sample, forward and first-order gradients against eager.

Prints ``ok N / tried M`` per backend and dtype, then each failure: ``crash`` (the compiler raised:
a bug, whatever the op), ``fallback`` (right numbers, but a pass or an executor gave up: the record's
reason is printed) or ``mismatch`` (ran, numbers outside the stated tolerance, see
``tests/compile/opinfo_check.TOLERANCES``). The target: no op where accelrun crashes and Inductor
does not.

    python bench/opinfo_sweep.py                         # accelrun, fp32 and bf16
    python bench/opinfo_sweep.py --backends accelrun,inductor --dtypes fp32
    python bench/opinfo_sweep.py --ops svd,logsumexp --executors cpp,aten
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.compile.opinfo_check

import torch  # noqa: E402

from tests.compile.opinfo_check import accelrun, check_op, differentiable_ops, op_name  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="accelrun", help="comma list of accelrun, inductor")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--executors", default="cpp,aten", help="accelrun's compile.executors")
    ap.add_argument("--passes", default="default", help="accelrun's pass preset")
    ap.add_argument("--ops", default="", help="only these OpInfo names (comma list)")
    ap.add_argument("--every", type=int, default=1, help="take every n-th op (a quick partial sweep)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch._logging.set_logs(dynamo=50, aot=50, inductor=50)  # quiet: failures are printed below
    wanted = {o for o in args.ops.split(",") if o}
    makers = {"accelrun": accelrun(args.executors.split(","), args.passes), "inductor": lambda: "inductor"}
    summary = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        ops = [o for o in differentiable_ops(dtype) if not wanted or op_name(o) in wanted or o.name in wanted]
        ops = ops[:: args.every]
        for backend in args.backends.split(","):
            t0 = time.perf_counter()
            outcomes = [check_op(op, dtype, makers[backend]) for op in ops]
            tried = [o for o in outcomes if o.status != "skip"]
            ok = sum(o.status == "ok" for o in tried)
            crashes = sum(o.status == "crash" for o in tried)
            fell = sum(o.status == "fallback" for o in tried)
            line = (f"{backend} {dname}: ok {ok} / tried {len(tried)} ({crashes} crash, "
                    f"{len(tried) - ok - crashes - fell} mismatch, {fell} right but with a compiler fallback, "
                    f"{len(outcomes) - len(tried)} skipped; "
                    f"{sum(o.regions > 0 for o in tried)} with a region compiled by a code generator) "
                    f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip
            print(line, flush=True)
            for o in tried:
                if o.status != "ok":
                    print(f"  {o.status:8s} {o.name}: {o.detail}", flush=True)
            summary.append((line, {o.name: o.status for o in tried}))
    if len(summary) > 1:
        print("\n".join(line for line, _ in summary))
    by_dtype: dict[str, dict[str, dict[str, str]]] = {}
    for line, statuses in summary:
        backend, dname = line.split(":")[0].split()
        by_dtype.setdefault(dname, {})[backend] = statuses
    for dname, per in by_dtype.items():
        if {"accelrun", "inductor"} <= set(per):
            worse = sorted(n for n, s in per["accelrun"].items() if s == "crash" and per["inductor"].get(n) != "crash")
            print(f"{dname}: ops where accelrun crashes and Inductor does not: {len(worse)} {worse}")


if __name__ == "__main__":
    main()
