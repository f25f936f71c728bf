#!/usr/bin/env bash
# CI stage 1: what a new user gets from the README's first install line, with no extras.
# A fresh venv, exactly `pip install torch==2.13.0 -e .`, then a 2-rank job and every multi-rank
# `accelrun train` example of the README (shortened to a few steps), `launch --dry-run` and `slurm -o`.
# The test extra brings packages (pytest, transformers, ...) that could hide a missing dependency, so
# this stage runs before the suite and outside its environment.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0 -e "$repo" 2>&1 | grep -v "^WARNING: Location" || true
export PATH="$work/venv/bin:$PATH" ACCELRUN_CACHE_DIR="$work/cache"
cd "$work" && cp -r "$repo/configs" .

short=(train.steps=2 report.log_every=1 report.progress=none "report.runs_dir=$work/runs")
run() {  # run an example; fail on a non-zero exit or on numpy's import warning
    echo "+ $*"
    if ! "$@" >"$work/out.txt" 2>&1; then tail -40 "$work/out.txt"; echo "plain install: failed: $*"; exit 1; fi
    if grep -q "Failed to initialize NumPy\|Numpy is not available" "$work/out.txt"; then
        cat "$work/out.txt"; echo "plain install: numpy missing: $*"; exit 1
    fi
}

run accelrun train configs/llama.yaml parallel.nproc_per_node=2 "${short[@]}"
# The README's multi-rank examples, as written plus the shortening overrides. The two-node example
# needs a second node: its per-node commands are checked by `launch --dry-run` below.
python - "$repo/README.md" > "$work/examples.txt" <<'PY'
import re, shlex, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
for line in text.splitlines():
    line = line.strip()
    if not line.startswith("accelrun "):
        continue
    words = shlex.split(line, comments=True)
    multi = any(re.fullmatch(r"parallel.nproc_per_node=([2-9]|\d\d+)", w) for w in words)
    if words[1] == "train" and multi and "--nnodes" not in words:
        print(shlex.join(words))
    elif words[1] in ("launch", "slurm"):
        print(shlex.join(words))
PY
[ "$(grep -c . "$work/examples.txt")" -ge 8 ] || { cat "$work/examples.txt"; echo "plain install: too few examples found"; exit 1; }
while read -r line; do
    eval "words=($line)"
    if [ "${words[1]}" = train ]; then run "${words[@]}" "${short[@]}"; else run "${words[@]}"; fi
done < "$work/examples.txt"
# A user's own data on a plain install: the README's example inputs (what needs no extra), a jsonl corpus
# trains, and a parquet file is one line naming the extra to install (exit 2), before anything runs.
run accelrun data examples
run accelrun train configs/llama.yaml data.source=documents 'data.paths=[corpus/docs.jsonl]' "${short[@]}"
printf 'PAR1' > corpus/theirs.parquet
code=0; accelrun validate configs/llama.yaml data.source=documents 'data.paths=[corpus/theirs.parquet]' \
    >"$work/out.txt" 2>&1 || code=$?
if [ "$code" -ne 2 ] || [ "$(grep -c '^error' "$work/out.txt")" -ne 1 ] || ! grep -q "pip install 'accelrun\[data\]'" "$work/out.txt"; then
    cat "$work/out.txt"; echo "plain install: a parquet file without pyarrow: exit $code, not one line naming the extra"; exit 1
fi
echo "plain install: ok ($(grep -c . "$work/examples.txt") README examples, a 2-rank job, a jsonl corpus, parquet's extra named)"
