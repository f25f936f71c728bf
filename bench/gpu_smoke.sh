#!/usr/bin/env bash
# The first thing to run on a machine with an NVIDIA GPU (one is enough; two or more add a section):
#   1. accelrun's Triton code generator on the real device: its tests without the interpreter (every
#      region run by Triton's real compiler and checked against eager) and the cross-compile check
#      (registers and spills for sm_90 / sm_100);
#   2. 1-GPU training of configs/llama.yaml: eager, Inductor and accelrun (Triton) in fp32 and bf16-mixed;
#      resume from a checkpoint (losses after it equal the uninterrupted run's); a profiled run (trace
#      written); an 8B-shaped 2-layer model (dim 4096, GQA 32/8, ffn 14336, vocab 128256, bf16) through
#      the Triton executor; `accelrun plan --calibrate` and the plan of the eager run beside its measure;
#      float8 linear layers (train.float8, torchao) against bf16 under Inductor: step time and loss;
#   3. with 2+ GPUs: FSDP, HSDP (or plain replication on 2), TP + SP, each pipeline schedule, compiled
#      FSDP with the overlap passes, and a rank killed mid-run that the elastic agent restarts; every
#      layout's losses beside one GPU's.
#
#   bash bench/gpu_smoke.sh [STEPS]        # STEPS per run, default 40; about 10 minutes on one H100
#   SMOKE_DEVICE=cpu SMOKE_RANKS=2 bash bench/gpu_smoke.sh 4   # the same commands on this CPU (a check
#                                          # of the script itself: gloo ranks, no Triton, no GPU parts)
#   SMOKE_PARTS=train,8b bash bench/gpu_smoke.sh   # only some parts (of triton, train, moe, resume, profile,
#                                          # 8b, plan, float8, multi), e.g. to fit a command-time limit
#   SMOKE_PARTS=bench bash bench/gpu_smoke.sh   # not in the default list (about 8 minutes on an H100):
#                                          # the debug model with CUDA graphs on / off and tuned / untuned
#                                          # launches, and bench/compile_step.py on an 8-layer dim-2048
#                                          # Llama, eager vs Inductor vs accelrun's Triton, fp32 and bf16
#                                          # (its halves alone: bench-debug, bench-8layer; the latter
#                                          # lighter: SMOKE_BENCH_PRECISION=bf16-mixed SMOKE_BENCH_ROUNDS=6;
#                                          # SMOKE_BENCH_PROFILE=DIR adds each variant's kernels by kind)
#
# It stops at nothing: every part runs, and the exit code is 1 if any part failed.
#
# The GPU machine starts bare and reaches no package registry: run `bash bench/gpu_wheels.sh` here
# first and carry .gpu-wheels with the device command; this script installs those wheels and accelrun
# (editable, no dependency resolution: the image's torch and Triton stay) when accelrun is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v python >/dev/null; then  # the image's interpreter is python3; the parts below call python
    mkdir -p "${TMPDIR:-/tmp}/smoke-bin" && ln -sf "$(command -v python3)" "${TMPDIR:-/tmp}/smoke-bin/python"
    export PATH="${TMPDIR:-/tmp}/smoke-bin:$PATH"
fi
if ! python -c "import accelrun.config" 2>/dev/null || ! command -v accelrun >/dev/null; then
    if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
        python -m pip install -q --no-index --no-deps .gpu-wheels/*.whl
    fi
    python -m pip install -q --no-deps --no-build-isolation -e . || { echo "could not install accelrun"; exit 1; }
    export PATH="$(python -c 'import sys, os; print(os.path.dirname(sys.executable))'):$PATH"
    python -c "import accelrun.config" || {
        echo "accelrun does not import: run bash bench/gpu_wheels.sh here and carry .gpu-wheels"; exit 1; }
fi
STEPS="${1:-40}"
DEVICE="${SMOKE_DEVICE:-cuda}"
PARTS="${SMOKE_PARTS:-triton,train,moe,resume,profile,8b,plan,float8,multi}"
want() { [[ ",$PARTS," == *",$1,"* ]]; }
runs=$(mktemp -d)
failed=()
section() { printf '\n== %s\n' "$*"; }
# train NAME [KEY=VALUE ...]: configs/llama.yaml (or $RECIPE) on $DEVICE, quiet, its log and run under
# $runs/NAME.
train() {
    local name="$1"; shift
    if accelrun train "${RECIPE:-configs/llama.yaml}" train.device="$DEVICE" train.steps="$STEPS" checkpoint.resume=none \
            report.progress=none report.runs_dir="$runs/$name" "$@" >"$runs/$name.log" 2>&1; then
        echo "ok      $name"
    else
        echo "FAILED  $name (exit $?); the log's end:"
        tail -n 15 "$runs/$name.log" | sed 's/^/    /'
        failed+=("$name")
    fi
}
# The run's folder, or nothing when the run wrote no report (dirname of nothing would say ".").
run_dir() { local f; f=$(ls "$runs/$1"/*/*/report.json 2>/dev/null | head -n 1); [ -n "$f" ] && dirname "$f"; }

section "device"
if [ "$DEVICE" = cuda ]; then
    if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
        echo "no NVIDIA GPU here: nothing to smoke-test (SMOKE_DEVICE=cpu checks the script on a CPU)"
        exit 1
    fi
    GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    python -c "
import torch, triton
cap = ''.join(map(str, torch.cuda.get_device_capability()))
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}), triton {triton.__version__}, '
      f'{torch.cuda.get_device_name()} sm_{cap}')
" || failed+=("device")
else
    GPUS="${SMOKE_RANKS:-1}"
    echo "SMOKE_DEVICE=$DEVICE: the GPU-only parts are left out; $GPUS rank(s) for the multi-rank section"
fi

if [ "$DEVICE" = cuda ] && want triton; then
    section "Triton code generator on the GPU (no interpreter)"
    env -u TRITON_INTERPRET ACCELRUN_TRITON_TEST_DEVICE=cuda \
        python -m pytest tests/compile/test_codegen_triton.py tests/compile/test_triton_real_compile.py \
        tests/compile/test_triton_runtime_rows.py \
        -q -p no:cacheprovider -rs || failed+=("triton tests")
    section "Triton cross-compile for sm_90 and sm_100 (registers, spills)"
    python bench/triton_cross_compile.py | tail -n 5 || failed+=("triton cross-compile")
fi

TRITON=()
[ "$DEVICE" = cuda ] && TRITON=("compile.executors=[triton,aten]")
want train && section "1 device: configs/llama.yaml, $STEPS steps per run"
want train && for precision in fp32 bf16-mixed; do
    train "eager-$precision" train.precision="$precision"
    train "inductor-$precision" train.precision="$precision" compile.backend=inductor
    train "accelrun-$precision" train.precision="$precision" compile.backend=accelrun "${TRITON[@]}"
done

# The MoE recipe trains compiled by default since 2026-12-07 and never has on a GPU: bf16 takes torch's
# grouped kernel, fp32 each expert's own products (counts read at run time), both traced whole.
want moe && section "1 device: configs/moe.yaml, $STEPS steps per run"
want moe && for precision in fp32 bf16-mixed; do
    RECIPE=configs/moe.yaml train "moe-eager-$precision" train.precision="$precision" compile.backend=eager
    RECIPE=configs/moe.yaml train "moe-accelrun-$precision" train.precision="$precision" "${TRITON[@]}"
done

if want resume; then
section "resume: a run restarted from its middle checkpoint continues with the same losses"
half=$((STEPS / 2))
train resume-whole checkpoint.every="$half"
whole=$(run_dir resume-whole)
if [ -n "$whole" ]; then
    train resume-second-half checkpoint.resume="$whole/checkpoints/step-$(printf '%06d' "$half")"
    python - "$whole" "$(run_dir resume-second-half)" "$half" <<'EOF' || failed+=("resume losses")
import json, sys
from pathlib import Path
def losses(d):
    return {m["step"]: m["loss"] for m in map(json.loads, (Path(d) / "metrics.jsonl").read_text().splitlines()) if "loss" in m}
a, b, half = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
after = sorted(s for s in b if s > half)
worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in after) if after else float("nan")
print(f"resumed at step {half}: steps {after[0] if after else '-'}..{after[-1] if after else '-'}, "
      f"largest relative loss difference from the uninterrupted run {worst:.2e}")
sys.exit(0 if after and min(after) == half + 1 and worst < 1e-4 else 1)
EOF
fi
fi

if want profile; then
# Steady steps, past the first ones: CUDA graphs capture at a graph's fourth call (three eager warm-ups).
first=$((STEPS / 2)); last=$((first + 1))
section "profile: a torch profiler trace of steps $first-$last"
train profiled "report.profile_steps=[$first,$last]"
if [ -n "$(run_dir profiled)" ] && ls "$(run_dir profiled)"/profile/* >/dev/null 2>&1; then
    ls -la "$(run_dir profiled)"/profile | tail -n +2 | head -n 4
else
    echo "no trace under profile/"; failed+=("profile trace")
fi
fi

if [ "$DEVICE" = cuda ] && want 8b; then
    section "an 8B-shaped 2-layer model through the Triton executor (bf16-mixed)"
    train llama8b-shape-2layers model.dim=4096 model.n_layers=2 model.n_heads=32 model.n_kv_heads=8 \
        model.ffn_dim=14336 model.vocab_size=128256 train.seq_len=2048 train.micro_batch=1 train.global_batch=2 \
        train.precision=bf16-mixed compile.backend=accelrun "compile.executors=[triton,aten]" train.steps=10 \
        report.warmup_steps=3
fi

if [ "$DEVICE" = cuda ] && want plan; then
    section "accelrun plan --calibrate, then the plan of the eager fp32 run beside what it measured"
    if accelrun plan --calibrate --output "$runs/cluster.yaml" >"$runs/calibrate.log" 2>&1; then
        tail -n 8 "$runs/calibrate.log"
        accelrun plan configs/llama.yaml --cluster "$runs/cluster.yaml" train.precision=fp32 | tail -n 12 \
            || failed+=("plan")
    else
        tail -n 15 "$runs/calibrate.log"; failed+=("plan --calibrate")
    fi
fi

if [ "$DEVICE" = cuda ] && want float8; then
    section "float8 linear layers (train.float8, torchao) against bf16, Inductor, one GPU"
    train float8-off-bf16 train.precision=bf16-mixed compile.backend=inductor
    train float8-on-bf16 train.precision=bf16-mixed compile.backend=inductor train.float8=true
    python - "$(run_dir float8-off-bf16)" "$(run_dir float8-on-bf16)" <<'EOF' || failed+=("float8 vs bf16")
import json, sys
from pathlib import Path
def run(d):
    rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((Path(d) / "report.json").read_text())
    return report["step_time_s"]["median"], next(m["loss"] for m in reversed(rows) if "loss" in m)
(bf16_s, bf16_loss), (f8_s, f8_loss) = run(sys.argv[1]), run(sys.argv[2])
rel = abs(f8_loss - bf16_loss) / abs(bf16_loss)
print(f"step: bf16 {bf16_s * 1e3:.2f} ms, float8 {f8_s * 1e3:.2f} ms (x {f8_s / bf16_s:.2f}); final loss: bf16 "
      f"{bf16_loss:.4f}, float8 {f8_loss:.4f} (relative difference {rel:.1e}; the debug model's layers are small, "
      "so the casts can cost more than float8's matmuls save)")
sys.exit(0 if rel < 0.05 else 1)  # float8 trains: its loss stays within 5% of bf16's after the same steps
EOF
fi

if [ "$DEVICE" = cuda ] && { want bench || want bench-debug; }; then
    # compile.cuda_graphs and compile.tune_launches (issue 31, item 5) on the debug model, in a cache of
    # their own so that the first runs are cold: untuned launches without CUDA graphs, then tuned (the
    # tuning is in that run's compile time), then tuned with CUDA graphs (a new process: graphs, kernels
    # and tuned launches from the caches, so its compile time is accelrun's warm start), beside Inductor
    # cold and warm.
    section "CUDA graphs and tuned launch configurations on configs/llama.yaml (accelrun's Triton)"
    export ACCELRUN_CACHE_DIR="$runs/bench-cache"
    for p in fp32 bf16-mixed; do
        accel=(train.precision="$p" compile.backend=accelrun "compile.executors=[triton,aten]")
        train "bench-untuned-nocg-$p" "${accel[@]}" compile.tune_launches=false compile.cuda_graphs=off
        train "bench-tuned-nocg-$p" "${accel[@]}" compile.tune_launches=true compile.cuda_graphs=off
        train "bench-tuned-cg-$p" "${accel[@]}" compile.tune_launches=true compile.cuda_graphs=on
        train "bench-inductor-$p" train.precision="$p" compile.backend=inductor
        train "bench-inductor-warm-$p" train.precision="$p" compile.backend=inductor
    done
    unset ACCELRUN_CACHE_DIR
    python - "$runs" <<'EOF' || failed+=("bench: CUDA graphs and tuning")
import json
import sys
from pathlib import Path

runs = Path(sys.argv[1])
def report(name):
    found = sorted((runs / name).glob("*/*/report.json"))
    return json.loads(found[0].read_text()) if found else None
def ms(r):
    median = ((r or {}).get("step_time_s") or {}).get("median")
    return median * 1e3 if median is not None else float("nan")
ok = True
for p in ("fp32", "bf16-mixed"):
    r = {k: report(f"bench-{k}-{p}") for k in ("untuned-nocg", "tuned-nocg", "tuned-cg", "inductor", "inductor-warm")}
    if any(v is None for v in r.values()):
        print(f"{p}: a run is missing"); ok = False; continue
    ind = ms(r["inductor-warm"])
    print(f"{p}: step ms untuned {ms(r['untuned-nocg']):.2f}, tuned {ms(r['tuned-nocg']):.2f} "
          f"({ms(r['untuned-nocg']) / ms(r['tuned-nocg']):.3f}x), tuned + CUDA graphs {ms(r['tuned-cg']):.2f} "
          f"({ms(r['tuned-nocg']) / ms(r['tuned-cg']):.3f}x); Inductor {ind:.2f}: accelrun "
          f"{ind / ms(r['tuned-cg']):.3f}x Inductor")
    print(f"{p}: first step (compile) s: accelrun cold {r['tuned-nocg'].get('compile_time_s')}, warm "
          f"{r['tuned-cg'].get('compile_time_s')}; Inductor cold {r['inductor'].get('compile_time_s')}, warm "
          f"{r['inductor-warm'].get('compile_time_s')}")
    c = r["tuned-cg"].get("compiler") or {}
    graphs = c.get("cuda_graphs") or {}
    print(f"{p}: compiled: {c.get('compiled')}")  # its CUDA graphs' line among them
    print(f"{p}: CUDA graphs' timed eager call and replay, ms: {graphs.get('timings_ms')}; warm start's stages, s: "
          f"{ {k: round(v, 2) for k, v in (c.get('stage_seconds') or {}).items()} }")
    ok &= bool((c.get("cuda_graphs") or {}).get("captured"))  # something was captured
sys.exit(0 if ok else 1)
EOF
fi

if [ "$DEVICE" = cuda ] && { want bench || want bench-8layer; }; then
    section "eager, Inductor and accelrun's Triton on an 8-layer dim-2048 Llama (bench/compile_step.py)"
    # SMOKE_BENCH_PRECISION / SMOKE_BENCH_ROUNDS: both precisions and 12 rounds ran past a 10-minute
    # device command on an H200 (2026-11-27); bf16-mixed alone with 6 rounds fits one.
    # SMOKE_BENCH_PROFILE=DIR: also each variant's kernels, by kind (bench/kernel_profile.py), into DIR
    python bench/compile_step.py --device cuda --executors triton,aten --precision "${SMOKE_BENCH_PRECISION:-both}" \
        --rounds "${SMOKE_BENCH_ROUNDS:-12}" ${SMOKE_BENCH_PROFILE:+--profile-kernels "$SMOKE_BENCH_PROFILE"} \
        model.dim=2048 model.n_layers=8 model.n_heads=16 model.n_kv_heads=8 model.ffn_dim=5632 \
        model.vocab_size=32000 train.seq_len=2048 train.micro_batch=4 train.global_batch=4 || failed+=("bench")
fi

if [ "$GPUS" -ge 2 ] && want multi; then
    section "2 ranks: each layout of configs/llama.yaml, fp32 (losses beside one device's)"
    two=(parallel.nproc_per_node=2)
    train fsdp2 "${two[@]}"
    if [ "$GPUS" -ge 4 ]; then
        train hsdp2x2 parallel.nproc_per_node=4 parallel.dp_replicate=2 parallel.dp_shard=2
    else
        train replicate2 "${two[@]}" parallel.dp_replicate=2 parallel.dp_shard=1
    fi
    # tensor parallelism alone trains eager: compiled, torch 2.13 hands DTensor's redistribute a plain
    # gradient (the recipe's validation says so); with FSDP it compiles (hsdp/fsdp layouts above)
    train tp2-sp "${two[@]}" parallel.dp_shard=1 parallel.tp=2 parallel.sequence_parallel=true compile.backend=eager
    for schedule in gpipe 1f1b interleaved_1f1b zero_bubble; do
        train "pp2-$schedule" "${two[@]}" parallel.dp_shard=1 parallel.pp=2 parallel.pp_schedule="$schedule"
    done
    train compiled-fsdp2-overlap "${two[@]}" parallel.fsdp_impl=compiled compile.backend=accelrun \
        compile.passes=overlap "${TRITON[@]}"

    echo "-- kill-and-restart: one rank killed mid-run, the agent restarts the group from the last checkpoint"
    long=$((STEPS * 5))
    accelrun train configs/llama.yaml train.device="$DEVICE" train.steps="$long" checkpoint.every=5 \
        checkpoint.resume=none report.progress=none report.runs_dir="$runs/restart" "${two[@]}" --max-restarts 1 \
        >"$runs/restart.log" 2>&1 &
    job=$!
    for _ in $(seq 600); do  # up to 5 minutes for step 10
        metrics=$(ls "$runs"/restart/*/*/metrics.jsonl 2>/dev/null | head -n 1)
        [ -n "$metrics" ] && [ "$(wc -l <"$metrics")" -ge 10 ] && break
        kill -0 "$job" 2>/dev/null || break
        sleep 0.5
    done
    # The ranks are children of the launcher's fork server, itself a child of the job's process.
    server=$(pgrep -P "$job" -f forkserver | head -n 1)
    victim=$([ -n "$server" ] && pgrep -P "$server" | tail -n 1)
    if [ -n "$victim" ]; then
        kill -9 "$victim"; echo "killed rank process $victim"
    else
        echo "no rank process found to kill"
    fi
    # (the console wraps long lines: joined before the search)
    if wait "$job" && tr '\n' ' ' <"$runs/restart.log" | grep -q "restart 1 of the group"; then
        echo "ok      restart: the job finished after the agent restarted the group once"
    else
        echo "FAILED  restart; the log's end:"; tail -n 15 "$runs/restart.log" | sed 's/^/    /'
        failed+=("kill-and-restart")
    fi
fi

section "figures"
python - "$runs" <<'EOF'
import json
import sys
from pathlib import Path

runs = Path(sys.argv[1])
reports = {p.relative_to(runs).parts[0]: p for p in sorted(runs.glob("*/*/*/report.json"))}
def final_loss(d):
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return next((m["loss"] for m in reversed(rows) if "loss" in m), None)
# Every layout trains the same batches from the same weights: its final loss beside one device's eager run.
base = {p: final_loss(reports[f"eager-{p}"].parent) for p in ("fp32", "bf16-mixed") if f"eager-{p}" in reports}
print(f"{'run':<28} {'status':<8} {'tok/s':>10} {'step ms':>8} {'MFU %':>6} {'alloc GiB':>9} {'resv GiB':>8} "
      f"{'compile s':>9} {'final loss':>11} {'vs 1-dev':>9}")
for name, path in reports.items():
    r = json.loads(path.read_text())
    loss = final_loss(path.parent)
    ref = base.get("bf16-mixed" if "bf16" in name else "fp32")
    same_run = not name.startswith(("llama8b", "restart"))  # another model / another number of steps
    rel = f"{abs(loss - ref) / abs(ref):.1e}" if loss is not None and ref and same_run else "-"
    t = r.get("step_time_s") or {}
    resv = "-" if r.get("mem_reserved_bytes") is None else f"{r['mem_reserved_bytes'] / 2**30:.2f}"  # CUDA only
    print(f"{name:<28} {str(r.get('status')):<8} {r.get('tokens_per_s') or 0:>10.0f} {(t.get('median') or 0) * 1e3:>8.2f} "
          f"{100 * (r.get('mfu') or 0):>6.1f} {(r.get('mem_peak_bytes') or 0) / 2**30:>9.2f} "
          f"{resv:>8} {r.get('compile_time_s') or 0:>9.1f} "
          f"{loss if loss is not None else float('nan'):>11.5f} {rel:>9}")
    c = r.get("compiler") or {}
    if c.get("regions_per_executor") or c.get("fallbacks"):
        print(f"{'':<28} regions by executor {c.get('regions_per_executor')}; fallbacks {len(c.get('fallbacks', []))}")
        for line in c.get("fallbacks", [])[:3]:
            print(f"{'':<28}   {line}")
EOF
echo "runs and logs kept in $runs"

section "result"
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu smoke: all parts passed"
else
    printf 'gpu smoke: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
