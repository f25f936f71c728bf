"""Padding vs concat vs document packing on a fine-tuning-like set (documents of varied lengths).

One process, one model, the default recipe's compiler (compile.backend = accelrun) unless told
otherwise; the three ways of batching the same documents are timed step by step, interleaved, and
each reports:
- tokens/s: positions computed per second (padding computes its pad tokens too);
- useful share: the fraction of computed positions whose target is in the loss (padding loses its pads,
  document packing one target per document boundary, concat none — but concat's tokens attend across
  documents, which fine-tuning must not);
- useful tokens/s: the two multiplied, the figure fine-tuning cares about.

    python bench/packing.py                        # the small size: seq_len 256, 300 documents
    python bench/packing.py --seq-len 2048 --docs 4000 --steps 30 --dim 512 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.config import load_config  # noqa: E402
from accelrun.data.document_packing import IGNORE_INDEX  # noqa: E402
from accelrun.data.loader import TokenBatchIterator  # noqa: E402
from accelrun.data.stream import TensorStream  # noqa: E402
from accelrun.train.setup import build_setup  # noqa: E402

VOCAB = 512


def documents(n: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """Lengths log-normal around seq_len / 6 (a long tail, as instruction data has), cut to [8, seq_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(n).log_normal_(mean=0.0, std=0.8, generator=g) * (seq_len / 6)
    return [torch.randint(2, VOCAB, (int(max(8, min(seq_len, n_tok))),), generator=g) for n_tok in lengths.tolist()]


def padded_batches(docs: list[torch.Tensor], seq_len: int, micro_batch: int) -> Iterator[tuple]:
    """One document per row, padded to seq_len; pad targets are -100."""
    i = 0
    while True:
        rows_x, rows_y = [], []
        for _ in range(micro_batch):
            doc = docs[i % len(docs)][: seq_len + 1]
            i += 1
            x = torch.zeros(seq_len, dtype=torch.int64)
            y = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
            x[: len(doc) - 1], y[: len(doc) - 1] = doc[:-1], doc[1:]
            rows_x.append(x)
            rows_y.append(y)
        yield torch.stack(rows_x), torch.stack(rows_y)


def packed_batches(docs: list[torch.Tensor], seq_len: int, micro_batch: int, packing: str) -> Iterator[tuple]:
    lengths = torch.tensor([len(d) for d in docs])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    stream = TensorStream([torch.cat(docs)], vocab_size=VOCAB, fingerprint={"source": "bench", "sha256": "bench"},
                          document_starts=starts)
    return TokenBatchIterator(stream, seq_len=seq_len, micro_batch=micro_batch, seed=0, packing=packing)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--docs", type=int, default=300)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (after 2 warm-up steps)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", default="accelrun", help="compile.backend (accelrun, inductor, eager)")
    args = p.parse_args()
    T, B = args.seq_len, args.micro_batch
    docs = documents(args.docs, T, seed=0)
    sources: dict[str, Callable[[], Iterator[tuple]]] = {
        "padding": lambda: padded_batches(docs, T, B),
        "concat": lambda: packed_batches(docs, T, B, "concat"),
        "document": lambda: packed_batches(docs, T, B, "document"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        resolved = load_config(REPO / "configs" / "llama.yaml", [
            "train.device=cpu", f"model.dim={args.dim}", f"model.n_layers={args.layers}", "model.n_heads=4",
            "model.n_kv_heads=2", f"model.ffn_dim={args.dim * 3}", f"model.vocab_size={VOCAB}",
            f"model.max_seq_len={max(T, 256)}", f"train.seq_len={T}", f"train.micro_batch={B}",
            f"train.global_batch={B}", "train.precision=fp32", f"compile.backend={args.backend}",
            "report.progress=none", f"report.runs_dir={tmp}/runs"])
        s = build_setup(resolved, Path(tmp) / "run")
        iters = {name: make() for name, make in sources.items()}
        seconds: dict[str, list[float]] = {name: [] for name in sources}
        useful: dict[str, list[float]] = {name: [] for name in sources}
        for step in range(args.steps + 2):
            for name, it in iters.items():  # interleaved: a machine's slow minute hits every variant
                inputs_BT, targets_BT, *positions = next(it)
                t0 = time.perf_counter()
                loss = s.loss_fn(inputs_BT, targets_BT, *positions)
                loss.backward()
                s.optimizer.step()
                s.optimizer.zero_grad(set_to_none=True)
                if step >= 2:  # the first steps compile
                    seconds[name].append(time.perf_counter() - t0)
                    useful[name].append(float((targets_BT != IGNORE_INDEX).float().mean()))
    print(f"seq_len {T}, micro_batch {B}, {len(docs)} documents (median length "
          f"{int(statistics.median(len(d) for d in docs))}), compile.backend={args.backend}, {args.steps} steps each")
    print(f"{'variant':<10}{'step ms':>10}{'tokens/s':>12}{'useful share':>14}{'useful tokens/s':>17}{'vs padding':>12}")
    base = None
    for name in sources:
        step_s = statistics.median(seconds[name])
        share = statistics.mean(useful[name])
        rate = B * T / step_s
        base = base or rate * share
        print(f"{name:<10}{step_s * 1e3:>10.1f}{rate:>12.0f}{share:>14.1%}{rate * share:>17.0f}"
              f"{rate * share / base:>11.2f}x")


if __name__ == "__main__":
    main()
