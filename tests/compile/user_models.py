"""Models written the way users write them, not the way accelrun's families are: torch.nn's own modules
in the repeated lists, data-dependent routing, convolutions, no ``ModuleList`` at all. Each maps token ids
``(B, T)`` to logits ``(B, T, vocab)``, so ``model.custom`` can train it as it is.

    model.custom: "tests.compile.user_models:mha_model"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 64, 32


class MHAModel(nn.Module):
    """Attention through ``nn.MultiheadAttention``; its lists hold torch.nn's own modules only."""

    def __init__(self, n_layers: int = 2, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attns = nn.ModuleList([nn.MultiheadAttention(dim, 4, batch_first=True) for _ in range(n_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(n_layers)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                   for _ in range(n_layers)])  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        T = tokens.shape[1]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
        for attn, norm, mlp in zip(self.attns, self.norms, self.mlps, strict=True):
            h = norm(x)
            x = x + attn(h, h, h, attn_mask=causal, need_weights=False)[0]
            x = x + mlp(norm(x))
        return self.head(x)


class CausalMHABlocks(nn.Module):
    """Blocks held as attributes, each ``nn.MultiheadAttention`` under a boolean causal mask made in the
    forward (as a new user wrote it): torch.nn turns the mask into a float one before attention."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.attn1, self.attn2 = (nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(2))
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        T = tokens.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tokens.device), 1)
        for attn in (self.attn1, self.attn2):
            x = x + attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return self.head(x + self.mlp(x))


class MaskedMHABlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MaskedMHALayers(nn.Module):
    """Blocks of ``nn.MultiheadAttention`` in a list, the causal mask (float, -inf above the diagonal)
    made once in the model's forward and handed to each block: compiled block by block, each graph is
    given the mask, whose values it cannot see."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([MaskedMHABlock(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


class RoutedMoE(nn.Module):
    """A top-1 mixture of experts routed by data-dependent indexing (``x[mask]``), experts as
    ``nn.Sequential``."""

    def __init__(self, n_experts: int = 4, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                      for _ in range(n_experts)])  # fmt: skip
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)
        gate = F.softmax(self.router(x), dim=-1)
        weight, choice = gate.max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = weight[mask, None] * expert(x[mask])
        x = self.norm(x + out)
        return self.head(x).view(*tokens.shape, -1)


class IndexedMoE(RoutedMoE):
    """The same mixture routed by indices (``torch.where``, ``index_add``): no branch on the data, so
    Dynamo traces it whole, every expert's token count a size read from the data."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)
        weight, choice = F.softmax(self.router(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.where(choice == e)[0]
            out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
        return self.head(self.norm(x + out)).view(*tokens.shape, -1)


class ConvMixer(nn.Module):
    """Depthwise and pointwise 1-d convolutions with GroupNorm, in ``nn.Sequential`` blocks."""

    def __init__(self, depth: int = 2, vocab: int = VOCAB, dim: int = DIM, kernel: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv1d(dim, dim, kernel, padding=kernel - 1, groups=dim), nn.GELU(), nn.GroupNorm(4, dim),
                          nn.Conv1d(dim, dim, 1), nn.GELU(), nn.GroupNorm(4, dim))
            for _ in range(depth)
        ])  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)  # (B, C, T)
        T = tokens.shape[1]
        for block in self.blocks:
            x = x + block(x)[..., :T]  # causal: the left-padded convolution's first T outputs
        return self.head(x.transpose(1, 2))


class ShortConvBlock(nn.Module):
    """A gated short causal convolution, written as Mamba writes its mixer's (``nn.Conv1d`` with
    ``groups`` = channels and ``padding`` = kernel - 1, the first T outputs kept), without the scan."""

    def __init__(self, dim: int, expand: int = 2, kernel: int = 4) -> None:
        super().__init__()
        inner = expand * dim
        self.norm = nn.LayerNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * inner)
        self.conv1d = nn.Conv1d(inner, inner, kernel_size=kernel, groups=inner, padding=kernel - 1)
        self.out_proj = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h, gate = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        h = self.conv1d(h.transpose(1, 2))[..., :T].transpose(1, 2)
        return x + self.out_proj(F.silu(h) * F.silu(gate))


class ShortConvLM(nn.Module):
    def __init__(self, n_layers: int = 2, vocab: int = VOCAB, dim: int = DIM, kernel: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([ShortConvBlock(dim, kernel=kernel) for _ in range(n_layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class PlainMLP(nn.Module):
    """No list at all: every layer an attribute of its own."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up1 = nn.Linear(dim, 2 * dim)
        self.down1 = nn.Linear(2 * dim, dim)
        self.up2 = nn.Linear(dim, 2 * dim)
        self.down2 = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down1(F.relu(self.up1(x)))
        x = x + self.down2(torch.tanh(self.up2(x)))
        return self.head(self.norm(x))


class EncoderLM(nn.Module):
    """torch.nn's ``TransformerEncoder`` with a causal mask, as its documentation builds one. Passed
    without ``is_causal=True`` (``causal_hint=False``), torch.nn compares the mask with a causal one on
    the host every call: a graph break."""

    def __init__(self, n_layers: int = 2, vocab: int = VOCAB, dim: int = DIM, causal_hint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.causal_hint = causal_hint

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hint = {"is_causal": True} if self.causal_hint else {}
        x = self.encoder(self.embed(tokens), mask=mask, **hint)  # a statement: Dynamo's log then omits this line
        return self.head(x)


class GRULM(nn.Module):
    """torch.nn's GRU between an embedding and a head, as a recurrent language model is written:
    Dynamo traces no RNN module, so the GRU runs eagerly and the code around it compiles."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(F.gelu(self.embed(tokens)))
        return self.head(self.norm(out))


class LSTMBlock(nn.Module):
    """A residual LSTM and MLP: the LSTM in each block of a list of the user's own blocks."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lstm(self.norm1(x))[0]
        return x + self.down(F.silu(self.up(self.norm2(x))))


class BlockStackLM(nn.Module):
    """A token table, a list of blocks of one class (``block_type``, built from the width), a head."""

    block_type: type[nn.Module]

    def __init__(self, n_layers: int = 2, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(self.block_type(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LSTMStack(BlockStackLM):
    block_type = LSTMBlock


def rows_picked_by_a_mask(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Routing as users write it with a boolean mask: the rows whose sum is positive go through a product
    and a tanh, the others stay zero; the picked rows' count is known only at run time."""
    rows = x.sum(-1) > 0
    out = torch.zeros_like(x)
    out[rows] = torch.tanh(x[rows] @ w) * 2 + 1
    return out


def mask_choices(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs for ``rows_picked_by_a_mask`` that pick some rows, every row, none, and one."""
    return x, x.abs(), -x.abs(), torch.cat([x[:1].abs() + 0.1, -x[1:].abs()])


def mha_model(**kwargs) -> nn.Module:
    return MHAModel(**kwargs)


def routed_moe(**kwargs) -> nn.Module:
    return RoutedMoE(**kwargs)


def conv_mixer(**kwargs) -> nn.Module:
    return ConvMixer(**kwargs)


def plain_mlp(**kwargs) -> nn.Module:
    return PlainMLP(**kwargs)


class BatchNormLM(nn.Module):
    """BatchNorm1d over the channels of a transposed activation. CPU batch norm returns such an input's
    output contiguous where its meta function says strided like the input, so the graph's ``view`` of
    it, traced on fake tensors, failed at run time (a walk's model; eager and Inductor train it)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(vocab, dim), nn.BatchNorm1d(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.embed(tokens))
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


class NanoGPTBlock(nn.Module):
    """nanoGPT's block: one qkv product split three ways, SDPA with dropout_p while training, dropout on
    both residual branches."""

    def __init__(self, dim: int, heads: int, dropout: float, tril_mask: bool = False) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.resid_dropout = nn.Dropout(dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))
        self.heads, self.dropout, self.tril_mask = heads, dropout, tril_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(C, dim=2))  # fmt: skip
        p = self.dropout if self.training else 0.0
        if self.tril_mask:  # causal as many write it: a (T, T) mask of their own
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model as its README trains it (dropout while training, the embedding tied to the head).
    Not in ``USER_MODELS``: with dropout its losses cannot equal eager's (another generator draws the
    masks); tests/compile/test_cpu_dropout.py and bench/user_models.py use it."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2, heads: int = 2, block: int = 1024,
                 dropout: float = 0.1, tril_mask: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([NanoGPTBlock(dim, heads, dropout, tril_mask) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class EncoderLayers(nn.Module):
    """A small GPT as many write it first: a ``layers`` list (the name accelrun takes for a user's blocks)
    of torch.nn's own ``TransformerEncoderLayer`` under a causal mask. Until 2026-12-06 the default compile
    crashed on it: each layer went through the graph cache on its own, and its module reached the
    compiled graph where a tensor belonged."""

    def __init__(self, n_layers: int = 2, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
                                     for _ in range(n_layers)])  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


class DictLayersLM(nn.Module):
    """``layers`` by the convention's name, each an ``nn.ModuleDict`` the forward reads its modules from
    (never calls): linear attention by a cumulative sum, as a user writes it without a block class."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim),
                                                   "out": nn.Linear(dim, dim)}) for _ in range(layers))  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["norm"](x)).chunk(3, -1)
            q, k = F.elu(q) + 1, F.elu(k) + 1
            y = q * torch.cumsum(k * v, dim=1) / (q * torch.cumsum(k, dim=1) + 1e-6)
            x = x + layer["out"](y)
        return self.head(x)


class MixerBlock(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MethodCalledBlocks(nn.Module):
    """``layers`` of a block class of the user's whose forward the model never calls: it calls ``mix``
    (which the block's forward calls too)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MixerBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer.mix(x)
        return self.head(x)


class BuiltEncoderLayer(nn.TransformerEncoderLayer):
    """A user's subclass of torch.nn's layer that changes only how it is built."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)


class SubclassedLayersLM(nn.Module):
    """``layers`` of that subclass: its forward is torch's own code."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(BuiltEncoderLayer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


class CausalFlagMHABlock(MaskedMHABlock):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.norm2(x))


class CheckpointedMHALayers(nn.Module):
    """Each block under ``torch.utils.checkpoint`` (non-reentrant), its ``nn.MultiheadAttention`` given a
    float causal mask and ``is_causal=True``: the block's forward is recomputed in the backward."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(CausalFlagMHABlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, mask, use_reentrant=False)
        return self.head(x)


class WindowAttentionLM(nn.Module):
    """Attention over a sliding window of 4 keys, the mask made from aranges: no causal mask, so the
    kernel declines it and ATen's attention runs it."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.embed, self.heads = nn.Embedding(VOCAB, dim), heads
        self.qkv, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pos = torch.arange(T, device=tokens.device)
        window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        return self.head(x + y.transpose(1, 2).reshape(B, T, D))


class Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(x)


def sequential_lm(vocab: int = VOCAB, dim: int = 32, depth: int = 2) -> nn.Module:
    """The whole model one ``nn.Sequential`` (torch's own forward at the top), blocks a residual wrapper
    around more of them: no class of the model's own but the wrapper."""
    def block() -> nn.Module:
        return Residual(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)))

    return nn.Sequential(nn.Embedding(vocab, dim), *[block() for _ in range(depth)], nn.LayerNorm(dim),
                         nn.Linear(dim, vocab))


USER_MODELS = {"subclassed_layers": SubclassedLayersLM, "dict_layers": DictLayersLM, "mha": MHAModel, "encoder_layers": EncoderLayers, "routed_moe": RoutedMoE, "indexed_moe": IndexedMoE, "conv_mixer": ConvMixer,
               "short_conv": ShortConvLM, "plain_mlp": PlainMLP, "encoder": EncoderLM, "gru": GRULM, "lstm_blocks": LSTMStack, "batchnorm": BatchNormLM}


class SkippedMoEBlock(nn.Module):
    """A block with a mixture routed by a branch on the data inside its loop over the experts: Dynamo
    skips the block's whole frame ("Data-dependent branching" inside a loop)."""

    def __init__(self, dim: int = DIM, n_experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(flat[rows]))
        return x + out.view_as(x)


class SkippedMoELM(BlockStackLM):
    block_type = SkippedMoEBlock
