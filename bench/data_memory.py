"""Peak memory reading a corpus much larger than the memory the reader is allowed: data.source =
documents prepares it (streamed) into memory-mapped shards, then every window of the stream is read once
and a few training steps run on it.

    python bench/data_memory.py --gib 40 --allow-gib 2      # 20x the allowance (needs ~2.2x --gib of disk)
    python bench/data_memory.py --gib 0.05 --allow-gib 2     # a smoke run (what the test machine ran)
    python bench/data_memory.py --gib 40 --format parquet
    python bench/data_memory.py --gib 24 --allow-gib 2 --windows 400000   # 12x, a sample of the epoch's windows

The corpus (jsonl or parquet, documents of varied lengths) is generated on disk here. The reader runs in
a child process whose private memory is capped at ``--allow-gib`` (``RLIMIT_DATA``: heap and anonymous
maps; the memory-mapped shards are file pages the kernel can drop, not the process's own memory), so a
reader that held the corpus would fail, not just report a large number. Every window once takes long on a
corpus larger than the page cache (each is a random read from disk): ``--windows`` reads that many, in
the epoch's shuffled order, from all over the corpus. Printed: the corpus, the
peak private (anonymous) RSS of each phase sampled every 20 ms, the peak RSS with file pages
(``VmHWM``), and corpus size / peak private RSS. Size the corpus to the disk: the shards take about
as much again as jsonl text (2 bytes a token for a byte tokenizer: twice the text).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PARAGRAPH = ("The quick brown fox jumps over the lazy dog while the compiler fuses the pointwise "
             "kernels and the loader memory-maps the shards. ")


def write_corpus(path: Path, gib: float, fmt: str) -> int:
    """Documents of 100 B to 40 KiB until ``gib`` of text, written a batch at a time; returns the bytes
    of text (parquet compresses this repetitive text far below it)."""
    target, written, i = int(gib * 2**30), 0, 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        while written < target:
            texts = [f"{i + j}: " + PARAGRAPH * (1 + (i + j) * 7919 % 300) for j in range(2000)]
            table = pa.table({"id": list(range(i, i + 2000)), "text": texts})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
            written += sum(len(t) for t in texts)
            i += 2000
        writer.close()
        return written
    with open(path, "w") as fh:
        while written < target:
            line = json.dumps({"id": i, "text": f"{i}: " + PARAGRAPH * (1 + i * 7919 % 300)}) + "\n"
            fh.write(line)
            written += len(line)
            i += 1
    return written


def private_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """The largest private RSS seen while it runs, sampled on a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = private_rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, private_rss_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, private_rss_bytes())


def child(corpus: str, allow_gib: float, steps: int, windows: int) -> None:
    import torch

    from accelrun.config.schema import DataConfig
    from accelrun.data import TokenBatchIterator, load_stream

    limit = int(allow_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))  # after imports: they are not the reader's
    out: dict[str, float] = {"baseline_private": private_rss_bytes()}
    cfg = DataConfig(source="documents", paths=[corpus])
    with PeakSampler() as prepare:
        stream = load_stream(cfg, vocab_size=320, seed=0)
    out["prepare_private"] = prepare.peak
    out["tokens"] = len(stream)
    with PeakSampler() as read:
        it = TokenBatchIterator(stream, seq_len=1024, micro_batch=64, seed=0)
        batches = it.batches_per_epoch if windows <= 0 else min(it.batches_per_epoch, max(1, windows // 64))
        checksum, start = 0, time.perf_counter()
        for _ in range(batches):  # in the epoch's shuffled order: windows from all over the corpus
            checksum += int(next(it).inputs[:, 0].sum())
        out["read_seconds"] = time.perf_counter() - start
    out["read_private"] = read.peak
    out["windows_read"] = batches * 64
    out["windows_in_epoch"] = it.batches_per_epoch * 64
    if steps:
        model = torch.nn.Sequential(torch.nn.Embedding(320, 64), torch.nn.Linear(64, 320))
        opt = torch.optim.AdamW(model.parameters())
        it = TokenBatchIterator(stream, seq_len=256, micro_batch=8, seed=1)
        with PeakSampler() as train:
            for _ in range(steps):
                batch = next(it)
                loss = torch.nn.functional.cross_entropy(model(batch.inputs).flatten(0, 1), batch.targets.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
        out["train_private"] = train.peak
    out["hwm"] = hwm_bytes()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=40.0, help="corpus size on disk")
    ap.add_argument("--allow-gib", type=float, default=2.0, help="private memory the reader may use")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--steps", type=int, default=20, help="training steps after the full read")
    ap.add_argument("--windows", type=int, default=0,
                    help="windows of 1,024 tokens to read, in the epoch's shuffled order (0: every window once)")
    ap.add_argument("--dir", default=None, help="where to write the corpus and shards (default: a temp folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.allow_gib, args.steps, args.windows)
        return
    with tempfile.TemporaryDirectory(prefix="accelrun-bench-memory-", dir=args.dir) as tmp:
        corpus = Path(tmp) / f"corpus.{args.format}"
        start = time.perf_counter()
        size = write_corpus(corpus, args.gib, args.format)
        print(f"corpus: {size / 2**30:.2f} GiB of text as {args.format} ({os.path.getsize(corpus) / 2**30:.2f} GiB "
              f"on disk) written in {time.perf_counter() - start:.0f} s; "
              f"reader allowed {args.allow_gib:g} GiB of private memory (RLIMIT_DATA)")
        env = {**os.environ, "ACCELRUN_CACHE_DIR": str(Path(tmp) / "cache")}
        start = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--child", str(corpus), "--allow-gib", str(args.allow_gib),
                            "--steps", str(args.steps), "--windows", str(args.windows)], env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"the reader failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        gib = 2**30
        print(f"tokens: {out['tokens']:,}; {time.perf_counter() - start:.0f} s; read {out['windows_read']:,} of "
              f"{out['windows_in_epoch']:,} windows in {out['read_seconds']:.0f} s "
              f"({out['windows_read'] / max(out['read_seconds'], 1e-9):,.0f} windows/s)")
        print(f"private RSS after imports {out['baseline_private'] / gib:.2f} GiB; peak while preparing "
              f"{out['prepare_private'] / gib:.2f} GiB, reading windows {out['read_private'] / gib:.2f} GiB"
              + (f", training {out['train_private'] / gib:.2f} GiB" if "train_private" in out else ""))
        peak = max(v for k, v in out.items() if k.endswith("_private"))
        print(f"peak RSS with file pages (VmHWM) {out['hwm'] / gib:.2f} GiB; text / peak private RSS = "
              f"{size / peak:.1f}x")


if __name__ == "__main__":
    main()
