"""``accelrun data prepare`` on record files: one worker against ``--workers N``, and both against
``datasets.map`` with the same tokenizer's batch encoding (the way a Hugging Face pipeline tokenizes).

    python bench/data_prepare.py                         # 64 MiB of jsonl, a 32,000-id BPE, 2 workers
    python bench/data_prepare.py --mib 8 --repeat 1      # a quick smoke (what the test machine ran)
    python bench/data_prepare.py --tokenizer byte --workers 4

The corpus is generated here (documents of varied lengths cut from the standard library's source, as
jsonl) and the BPE is trained here on it; nothing downloads. Every contender reads the same file and
encodes the same texts with the same tokenizer.json; ``datasets.map`` also appends nothing (its EOS
is not counted), so its token count is the documents' tokens without the separators. Prints seconds
(median of ``--repeat``), MiB/s of input, tokens/s and each one's ratio to one accelrun worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bpe import train_bpe  # bench/bpe.py, beside this script

from accelrun.data import stdlib_files


def write_corpus(path: Path, mib: float) -> int:
    """jsonl documents of 200 B to 20 KiB cut from the standard library's source, until ``mib``."""
    target, written, i = int(mib * 2**20), 0, 0
    sources = [f.read_text(errors="replace") for f in stdlib_files()[:400]]
    with open(path, "w") as fh:
        while written < target:
            text = sources[i % len(sources)]
            start = (i * 7919) % max(len(text) - 1, 1)
            length = 200 + (i * 104729) % 20_000
            line = json.dumps({"id": i, "text": text[start:start + length] or "x"}) + "\n"
            fh.write(line)
            written += len(line.encode())
            i += 1
    return written


def corpus_bpe(corpus: Path, vocab: int, folder: Path) -> Path:
    """A BPE trained on the corpus's first 2,000 documents."""
    with open(corpus) as fh:
        sample = [json.loads(line)["text"] for _, line in zip(range(2000), fh, strict=False)]
    return train_bpe(sample, vocab, folder)


def accelrun_prepare(corpus: Path, tokenizer: str, workers: int, work: Path) -> int:
    from accelrun.data.prepare_records import prepare_records

    out = work / f"prepared-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    return prepare_records([str(corpus)], out, tokenizer=tokenizer, workers=workers).tokens


def datasets_map(corpus: Path, tokenizer: str, workers: int, work: Path) -> int:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    if tokenizer == "byte":
        def encode(batch):
            return {"input_ids": [list(t.encode()) for t in batch["text"]]}
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer)

        def encode(batch):
            return {"input_ids": tok(batch["text"], add_special_tokens=False)["input_ids"]}

    cache = work / "hf-cache"
    shutil.rmtree(cache, ignore_errors=True)
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    mapped = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=workers if workers > 1 else None)
    return sum(len(ids) for ids in mapped["input_ids"])


CONTENDERS = {"accelrun": accelrun_prepare, "datasets": datasets_map}


def timed(kind: str, corpus: Path, tokenizer: str, workers: int, work: Path) -> tuple[float, int]:
    """(seconds, tokens) of one contender's run in a new process, as `accelrun data prepare` runs: a process
    that has used the tokenizer's thread pool (this one, training the BPE) hands its forked workers a
    library that turns that pool off, and a multiprocessing pool left behind by one contender would slow
    the next. The seconds are the run's own, without the interpreter's start and imports."""
    got = subprocess.run([sys.executable, __file__, "--one", kind, str(corpus), tokenizer, str(workers), str(work)],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(got[-2]), int(got[-1])


def one(kind: str, corpus: str, tokenizer: str, workers: str, work: str) -> None:
    fn = CONTENDERS[kind]
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    import accelrun.data.prepare_records  # noqa: F401  (imports before the clock starts, as for datasets')

    start = time.perf_counter()
    tokens = fn(Path(corpus), tokenizer, int(workers), Path(work))
    print(time.perf_counter() - start, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--tokenizer", default="bpe", help="bpe (trained here) or byte")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="accelrun-bench-prepare-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("ACCELRUN_CACHE_DIR", str(work / "cache"))
        corpus = work / "corpus.jsonl"
        size = write_corpus(corpus, args.mib)
        tokenizer = "byte" if args.tokenizer == "byte" else str(corpus_bpe(corpus, args.vocab, work / "bpe"))
        contenders = {
            "accelrun prepare, 1 worker": ("accelrun", 1),
            f"accelrun prepare, {args.workers} workers": ("accelrun", args.workers),
            "datasets.map, 1 process": ("datasets", 1),
            f"datasets.map, {args.workers} processes": ("datasets", args.workers),
        }
        print(f"corpus: {size / 2**20:.1f} MiB of jsonl; tokenizer: {args.tokenizer}"
              f"{f' ({args.vocab:,} ids)' if args.tokenizer != 'byte' else ''}; {os.cpu_count()} CPUs; "
              f"median of {args.repeat}")
        # Round by round, each contender in turn, so that a neighbour's load falls on all of them alike.
        rounds = [{name: timed(kind, corpus, tokenizer, n, work) for name, (kind, n) in contenders.items()}
                  for _ in range(args.repeat)]
        results = {name: (statistics.median(r[name][0] for r in rounds), rounds[-1][name][1]) for name in contenders}
        print("each round's seconds: " + "; ".join(f"{name}: {', '.join(f'{r[name][0]:.2f}' for r in rounds)}"
                                                   for name in contenders))
        base = results["accelrun prepare, 1 worker"][0]
        print(f"{'':36} {'seconds':>8} {'MiB/s':>8} {'tokens/s':>12} {'vs 1 worker':>12}")
        for name, (seconds, tokens) in results.items():
            print(f"{name:36} {seconds:8.2f} {size / 2**20 / seconds:8.1f} {tokens / seconds:12,.0f} "
                  f"{base / seconds:11.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(*sys.argv[2:])
    else:
        main()
