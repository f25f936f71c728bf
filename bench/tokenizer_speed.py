"""Tokenizing the built-in corpus: the byte tokenizer against a tokenizer.json (a byte-level BPE trained
here on the same text, nothing downloaded), through the same code a run and ``data prepare`` use.

    python bench/tokenizer_speed.py                      # 8 MiB of the standard library, BPE of 32,000 ids
    python bench/tokenizer_speed.py --mib 2 --vocab 8000

Prints seconds, MiB of text per second and tokens (best of ``--repeat``; the BPE's first stream is one
encoding, ``cached`` the memory-mapped re-read that ranks and later runs get), and the peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from bpe import train_bpe  # bench/bpe.py, beside this script

from accelrun.data import get_tokenizer, load_builtin, prepare_tokens, stdlib_files


def _train_bpe(mib: float, vocab: int, folder: Path) -> Path:
    """A BPE trained on about ``mib`` MiB of the standard library's source."""
    texts, size = [], 0
    for f in stdlib_files():
        if size > mib * 2**20:
            break
        texts.append(f.read_text(errors="replace"))
        size += len(texts[-1])
    return train_bpe(texts, vocab, folder)


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=8.0, help="MiB of the standard library to read")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    max_bytes = int(args.mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = _train_bpe(args.mib, args.vocab, Path(tmp) / "bpe")
        print(f"trained a BPE of {args.vocab:,} ids on {args.mib} MiB in {time.perf_counter() - t0:.1f} s")
        print(f"{'tokenizer':<12}{'what':<10}{'s':>8}{'MiB/s':>9}{'tokens':>13}")
        os.environ["ACCELRUN_CACHE_DIR"] = str(Path(tmp) / "cache")
        for name in ("byte", str(folder)):
            label = "byte" if name == "byte" else "bpe"
            tok = get_tokenizer(name)
            for what in ("stream", "cached"):  # the second read of a tokenizer.json's tokens is the cache's
                if what == "cached" and name == "byte":
                    continue
                s, stream = _best(lambda tok=tok: load_builtin("python-stdlib", max_bytes=max_bytes, tokenizer=tok),
                                  1 if what == "stream" and name != "byte" else args.repeat)
                print(f"{label:<12}{what:<10}{s:>8.2f}{args.mib / s:>9.1f}{len(stream):>13,}")
            out = Path(tmp) / f"{label}.tok"
            s, info = _best(lambda name=name, out=out: prepare_tokens(
                [str(f) for f in stdlib_files()], out, tokenizer=name, max_bytes=max_bytes), args.repeat)
            print(f"{label:<12}{'prepare':<10}{s:>8.2f}{info['bytes'] / 2**20 / s:>9.1f}{info['tokens']:>13,}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")


if __name__ == "__main__":
    main()
