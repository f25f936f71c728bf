"""Count, on accelrun's real Llama (and Gemma's block), what the planner's tables claim: saved bytes and memory traffic.

Batch 3 × sequence 67 tokens: a tensor whose size is a multiple of 201 grows with the tokens; weights
(multiples of 16 in every dimension) and the rotary tables (67 × head_dim/2, head_dim/2 not a multiple
of 3) never are, so they are told apart by size alone.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from accelrun.models.families.llama.model import Llama, LlamaArgs, TransformerBlock, rope_tables

B, T = 3, 67
TOKENS = B * T
# Products and attention are timed by FLOPs, not bytes; views move nothing.
NOT_TRAFFIC = {
    "mm", "bmm", "addmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "view", "_unsafe_view", "t", "transpose",
    "unsqueeze", "expand", "as_strided", "slice", "select", "detach", "unbind", "alias", "permute", "squeeze",
    "split", "split_with_sizes", "_reshape_alias", "empty", "empty_like", "zeros_like", "ones_like",
    "new_empty_strided", "empty_strided",
}


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written by every op outside NOT_TRAFFIC, for tensors that grow with the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in NOT_TRAFFIC:
            return out
        flat = [*args, *(out if isinstance(out, tuple | list) else [out])]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        tensors += [x for a in flat if isinstance(a, tuple | list) for x in a if isinstance(x, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors if t.numel() % TOKENS == 0)
        return out


def _mode(mode: str):
    if mode == "fp32":
        return torch.float32, contextlib.nullcontext()
    dtype = torch.bfloat16 if mode == "bf16-params" else torch.float32
    return dtype, torch.autocast("cpu", dtype=torch.bfloat16)  # accelrun's loop autocasts under bf16-mixed


def _saved_growing_with_tokens(block: torch.nn.Module, x: torch.Tensor):
    """(bytes by storage, a ``saved_tensors_hooks`` pack that fills it): what autograd saves of a size that
    grows with the tokens, the block's weights and its input ``x`` left out."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in skip and t.numel() % TOKENS == 0:
            saved[key] = t.untyped_storage().nbytes()
        return t

    return saved, pack


def count_block(dim: int, heads: int, kv_heads: int, ffn: int, mode: str, gemma_head_dim: int | None = None
                ) -> dict[str, float]:
    """Per token of one block (Llama's, or Gemma's with that head dimension): bytes autograd saves, and
    traffic in forward and in backward."""
    torch.manual_seed(0)
    if gemma_head_dim is None:
        args = LlamaArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=64)
        block = TransformerBlock(args)
    else:
        from accelrun.models.families.gemma.model import GemmaArgs, GemmaBlock

        args = GemmaArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, head_dim=gemma_head_dim,
                         ffn_dim=ffn, vocab_size=64)
        block = GemmaBlock(args)
    dtype, autocast = _mode(mode)
    block = block.to(dtype)
    cos, sin = rope_tables(args.head_dim, T, 1e4)
    x = torch.randn(B, T, dim, dtype=dtype, requires_grad=True)
    saved, pack = _saved_growing_with_tokens(block, x)
    forward = TrafficCounter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward, autocast:
        y = block(x, cos, sin)
    grad = torch.randn_like(y)
    backward = TrafficCounter()
    with backward:
        y.backward(grad)
    # The block's input is saved by its first norm; in fp32 and under autocast it is that very tensor.
    input_bytes = x.numel() * x.element_size() if mode != "bf16-params" else 0
    return {"saved": (sum(saved.values()) + input_bytes) / TOKENS,
            "forward": forward.bytes / TOKENS, "backward": backward.bytes / TOKENS}


def count_head(dim: int, vocab: int, mode: str) -> float:
    """Per token: traffic of embedding, final norm, fp32 logits and cross-entropy, forward + backward."""
    torch.manual_seed(0)
    args = LlamaArgs(dim=dim, n_layers=1, n_heads=4, ffn_dim=64, vocab_size=vocab)
    dtype, autocast = _mode(mode)
    model = Llama(args)
    model.layers = torch.nn.ModuleList()
    model = model.to(dtype)
    tokens = torch.randint(0, vocab, (B, T))
    counter = TrafficCounter()
    with counter:
        with autocast:
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
    return counter.bytes / TOKENS


def count_accelrun_block(dim: int, heads: int, kv_heads: int, ffn: int, mode: str) -> float:
    """Per token: bytes one Llama block keeps for the backward when accelrun's compiler (its default
    passes) compiles it, the block's input included."""
    from accelrun.compile.compile_model import compile_model
    from accelrun.config.schema import CompileConfig

    torch.manual_seed(0)
    args = LlamaArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=64)
    block = TransformerBlock(args)
    compile_model(block, [block], CompileConfig(backend="accelrun", scope="block"))
    dtype, autocast = _mode(mode)
    cos, sin = rope_tables(args.head_dim, T, 1e4)
    x = torch.randn(B, T, dim, dtype=dtype, requires_grad=True)
    saved, pack = _saved_growing_with_tokens(block, x)
    for _ in range(2):  # the first call compiles; count the second
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            y = block(x, cos, sin)
        y.float().sum().backward()
    return (sum(saved.values()) + x.numel() * x.element_size()) / TOKENS
