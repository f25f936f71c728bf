#!/usr/bin/env bash
# The first thing to run on a machine with an NVIDIA GPU (one is enough):
#   1. accelrun's Triton code generator on the real device: its tests without the interpreter
#      (every region run by Triton's real compiler and checked against eager), and the
#      cross-compile check (registers and spills for sm_90 / sm_100);
#   2. a short 1-GPU training run of configs/llama.yaml, eager and then compile.backend=accelrun
#      (fp32 and bf16-mixed), with each run's figures and the compiler's regions and fallbacks.
#
#   bash bench/gpu_smoke.sh [STEPS]      # STEPS per run, default 60; a few minutes on one H100
#
# Written on a CPU-only machine, where it could not be run: the first run on a GPU is its test.
# It stops at nothing: every part runs, and the exit code is 1 if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-60}"
failed=()
section() { printf '\n== %s\n' "$*"; }

section "device"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    echo "no NVIDIA GPU here: nothing to smoke-test"
    exit 1
fi
python -c "
import torch, triton
cap = ''.join(map(str, torch.cuda.get_device_capability()))
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, '
      f'{torch.cuda.get_device_name()} sm_{cap}')
" || failed+=("device")

section "Triton code generator on the GPU (no interpreter)"
env -u TRITON_INTERPRET ACCELRUN_TRITON_TEST_DEVICE=cuda \
    python -m pytest tests/compile/test_codegen_triton.py tests/compile/test_triton_real_compile.py \
    -q -p no:cacheprovider -rs || failed+=("triton tests")

section "1-GPU training: configs/llama.yaml, $STEPS steps"
runs=$(mktemp -d)
for variant in "eager fp32" "accelrun fp32" "eager bf16-mixed" "accelrun bf16-mixed"; do
    set -- $variant
    echo "-- compile.backend=$1 train.precision=$2"
    if ! accelrun train configs/llama.yaml compile.backend="$1" train.precision="$2" train.device=cuda \
            train.steps="$STEPS" checkpoint.resume=none report.runs_dir="$runs/$1-$2" >"$runs/$1-$2.log" 2>&1; then
        tail -n 20 "$runs/$1-$2.log"
        failed+=("train $1 $2")
    fi
done
python - "$runs" <<'EOF'
import json
import sys
from pathlib import Path

rows = []
for report in sorted(Path(sys.argv[1]).glob("*/*/*/report.json")):
    r = json.loads(report.read_text())
    variant = report.parts[-4]
    c = r.get("compiler") or {}
    rows.append((variant, r))
    t = r.get("step_time_s") or {}
    print(f"{variant:<22} {r.get('status')}: {r.get('tokens_per_s') or 0:>10.0f} tok/s, step {t.get('median', 0) * 1e3:7.2f} ms "
          f"(median), MFU {100 * (r.get('mfu') or 0):5.1f}%, peak {(r.get('mem_peak_bytes') or 0) / 2**30:5.2f} GiB, "
          f"compile {r.get('compile_time_s') or 0:5.1f} s, final loss {r.get('final_loss')}")
    if c:
        print(f"{'':<22} regions by executor {c.get('regions_per_executor')}; fallbacks: {len(c.get('fallbacks', []))}")
        for line in c.get("fallbacks", [])[:5]:
            print(f"{'':<22}   {line}")
by = dict(rows)
for precision in ("fp32", "bf16-mixed"):
    e, a = by.get(f"eager-{precision}"), by.get(f"accelrun-{precision}")
    if e and a and e.get("tokens_per_s") and a.get("tokens_per_s"):
        print(f"accelrun / eager, {precision}: {a['tokens_per_s'] / e['tokens_per_s']:.3f}x tokens/s, "
              f"final loss {a.get('final_loss')} vs {e.get('final_loss')}")
EOF
echo "runs kept in $runs"

section "result"
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu smoke: all parts passed"
else
    printf 'gpu smoke: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
