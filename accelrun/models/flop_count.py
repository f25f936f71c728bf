"""Training FLOPs per token, and where the number came from: TFLOP/s and MFU need it for every model.

- A model family's is its shape's formula (``Shape.model_flops_per_token``).
- A user's model may say its own with a ``flops_per_token(seq_len)`` method.
- Otherwise it is counted: one sequence of random tokens goes through the model's forward, as
  training calls it, under torch's ``FlopCounterMode``, which counts the matrix products,
  convolutions and attention by their shapes. Training FLOPs are 3× the forward's (each product's
  backward is two products of its size), the convention the families' formula and published MFU
  figures follow (PaLM's 6·N + 12·L·H·Q·T). It runs on the real device, not on fake tensors:
  transformers' models read tensor values in their mask code (``.item()``), and a mixture of experts
  routes by value. Training starts as it would have: the forward runs on a copy of the model's
  modules that shares its parameters and buffers (so the copy costs no memory, and Python state the
  forward changes, a call counter, changes in the copy), its randomness is forked, and its buffers
  (BatchNorm's running statistics) are put back. A forward that fails there on its own sizes is
  refused (``ModelSizesDisagree``, exit 2): the first step would fail the same way; any other failure
  leaves the FLOPs unknown.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accelrun.errors import UserError
from accelrun.models.forward_errors import said, sizes_disagree, users_line

if TYPE_CHECKING:  # torch is imported where it runs: the report reads COUNTED without it
    import torch
    from torch import nn

COUNTED = ("counted: torch's FlopCounterMode over one sequence's forward (matrix products, convolutions, "
           "attention), × 3 for forward and backward")  # fmt: skip


class ModelSizesDisagree(UserError):
    """A user's forward failed eagerly on its own sizes (a view to heads that do not divide the width)."""


@dataclass(frozen=True)
class FlopsPerToken:
    value: float | None  # training FLOPs per token; None: unknown
    source: str  # how it was found, or why it is unknown


def _cpu_attention_formulas() -> dict:
    """torch counts the GPUs' fused attention, not the CPU's (``_scaled_dot_product_flash_attention_for_cpu``,
    what ``F.scaled_dot_product_attention`` runs on a CPU): the same formula for it, by its shapes."""
    import torch
    from torch.utils.flop_counter import sdpa_flop_count

    def cpu_flash(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)  # as torch's: causal counted whole

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash}


@contextlib.contextmanager
def _rnn_libraries_off() -> Iterator[None]:
    """oneDNN and cuDNN off while counting (the FLOPs counted are the same either way; only which library
    runs them changes): ``nn.LSTM`` runs as one ``mkldnn_rnn_layer`` (or ``_cudnn_rnn``) call, which
    torch's counter has no formula for, so an LSTM language model counted its output head alone (MFU 6%
    where 85% was right, a new user's trial). Without them the same layers run as the matrix products it
    counts. Through torch's ``flags()`` context managers, the one way that works after a process called
    ``torch.backends.disable_global_flags()`` (torch's own test helpers do); they also set TF32, which
    counting does not read, and oneDNN's warns about Intel GPUs: kept quiet."""
    import warnings

    import torch

    mkldnn, cudnn = torch.backends.mkldnn, torch.backends.cudnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with (mkldnn.flags(enabled=False, deterministic=mkldnn.deterministic),
              cudnn.flags(enabled=False, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic)):
            yield


def counted_flops_per_token(model: nn.Module, seq_len: int, vocab_size: int, device: torch.device,
                            micro_batch: int = 1) -> FlopsPerToken:  # fmt: skip
    """``COUNTED``: the training FLOPs per token of ``model`` (a user's, whole on ``device``); a forward
    that fails on its own sizes there, and again on a micro-batch as training runs it, is refused."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from accelrun.models.build import training_loss_fn

    ids = torch.randint(0, vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    try:
        twin = copy.deepcopy(model, memo=shared)
    except Exception as e:  # noqa: BLE001 (a module holding what cannot be copied: a lock, a handle)
        return FlopsPerToken(None, f"its modules could not be copied to run a forward apart: {_one_line(e)}")
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}  # BatchNorm's running stats
    forked = [device.index or 0] if device.type == "cuda" else []
    def count(grad: bool, tokens: torch.Tensor = ids) -> int:
        with (torch.random.fork_rng(devices=forked), torch.set_grad_enabled(grad), _rnn_libraries_off(),
              FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas()) as counter):
            training_loss_fn(twin)(tokens[:, :-1], tokens[:, 1:])
        return counter.get_total_flops()

    def as_training_fails(e: Exception) -> Exception | None:
        """The sizes error a micro-batch as training runs it meets, or None: one sequence alone may be what
        the forward cannot take (a ``squeeze()`` of the batch, a view to a batch size it keeps)."""
        if micro_batch == 1:
            return e
        try:
            count(grad=False, tokens=ids.expand(micro_batch, -1))
        except Exception as again:  # noqa: BLE001
            return again if sizes_disagree(again) else None
        return None

    try:
        try:
            forward = count(grad=False)  # no autograd graph: the least memory
        except Exception as e:  # noqa: BLE001
            # The counter's module tracker asserts on a view of a parameter handed to a submodule without
            # grad ("Expected gradient function to be set": nn.TransformerDecoderLayer given an expanded
            # nn.Parameter as its memory); with grad the same forward counts. Its error, if both fail.
            try:
                forward = count(grad=True)
            except Exception:  # noqa: BLE001
                raise e from None
    except Exception as e:  # noqa: BLE001 (a forward that cannot run on one sequence: MFU is unknown, not fatal)
        if sizes_disagree(e) and (failed := as_training_fails(e)) is not None:  # eager, real tensors: as the
            # first step would
            raise ModelSizesDisagree(f"{type(model).__name__}.forward fails on a batch of {micro_batch} x {seq_len} "
                                     f"tokens: {said(failed)}{users_line(failed)}") from failed
        return FlopsPerToken(None, f"counting its FLOPs on one sequence failed: {_one_line(e)}")
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
    if forward <= 0:
        return FlopsPerToken(None, "its forward counted no matrix product, convolution or attention")
    return FlopsPerToken(3 * forward / seq_len, COUNTED)


def flops_per_token(cfg, seq_len: int, model: nn.Module, device: torch.device, vocab_size: int,
                    micro_batch: int = 1) -> FlopsPerToken:  # fmt: skip
    """The model's training FLOPs per token at ``seq_len`` and their source (see the module's docstring).
    ``cfg``: the recipe's ``model`` section; ``model``: built, whole, before any layout is applied."""
    from accelrun.models.build import model_flops_per_token

    if cfg.custom is None:
        return FlopsPerToken(model_flops_per_token(cfg, seq_len), "the model family's formula "
                             "(Shape.model_flops_per_token)")  # fmt: skip
    if callable(getattr(model, "flops_per_token", None)):
        return FlopsPerToken(model_flops_per_token(cfg, seq_len, model), "the model's own flops_per_token(seq_len)")
    return counted_flops_per_token(model, seq_len, vocab_size, device, micro_batch)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
