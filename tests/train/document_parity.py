"""Helpers for document packing's parity with transformers: a packed token stream with a document index,
and each document's per-token losses from ``LlamaForCausalLM`` run on that document alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accelrun.data.stream import TensorStream

VOCAB = 320  # tests.models.hf_helpers.SHAPE
EOS = 1


def document_stream(lengths: list[int], seed: int = 0) -> TensorStream:
    """Random documents of ``lengths`` tokens (the last one EOS), concatenated, with their starts."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        doc = torch.randint(2, VOCAB, (n,), generator=g)
        doc[-1] = EOS
        docs.append(doc)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    return TensorStream([torch.cat(docs)], vocab_size=VOCAB, fingerprint={"source": "test", "sha256": "docs"},
                        document_starts=starts)


def document_pieces(positions_T: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, stop)`` pieces of one window's row: a piece starts where the position is 0."""
    starts = (positions_T == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], positions_T.numel()], strict=True))


@torch.no_grad()
def transformers_losses(hf_model, inputs_BT: torch.Tensor, targets_BT: torch.Tensor,
                        positions_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token losses, each document piece run alone through ``hf_model``; 0 where the target is
    -100 (the one that crosses into the next document)."""
    out_BT = torch.zeros(inputs_BT.shape, dtype=torch.float32)
    for b in range(inputs_BT.shape[0]):
        for start, stop in document_pieces(positions_BT[b]):
            logits_1SV = hf_model(inputs_BT[b : b + 1, start:stop]).logits.float()
            out_BT[b, start:stop] = F.cross_entropy(logits_1SV[0], targets_BT[b, start:stop], reduction="none")
    return out_BT
