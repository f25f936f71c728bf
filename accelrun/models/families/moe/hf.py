"""MoE weights out as a Hugging Face Mixtral checkpoint (``accelrun export --hf``), in the per-expert
names Mixtral's published checkpoints use (``block_sparse_moe.experts.<e>.w1/w2/w3``, which
transformers converts on load); attention, norms and ends as the Llama family's (its q/k rotary
permutation included).

Mixtral's router is the same (softmax over all experts, top-k, renormalised) and has no shared
expert and no capacity limit: a model with ``shared_expert_ffn_dim > 0`` cannot be exported, and a
capacity-trained model's export runs without dropping. Reading Mixtral folders (``model.hf``) is not
supported: the loader reads one file tensor per parameter, and a stacked expert tensor is
``n_experts`` of them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from accelrun.errors import UserError
from accelrun.models.families.llama import hf as llama_hf

_ROUTED = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123])$")


class MixtralExportError(UserError, ValueError):
    pass


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    if args.shared_expert_ffn_dim:
        raise MixtralExportError(f"export --hf: model.shared_expert_ffn_dim = {args.shared_expert_ffn_dim}: a "
                                 "shared expert has no place in a Mixtral checkpoint")
    out, dense = {}, {}
    for name, t in sd.items():
        m = _ROUTED.fullmatch(name)
        if m is None:
            dense[name] = t
            continue
        prefix = f"model.layers.{m.group(1)}.block_sparse_moe"
        if m.group(2) == "router.weight":
            out[f"{prefix}.gate.weight"] = t.contiguous()
            continue
        leaf = m.group(2).split(".")[1]  # w1, w2, w3: accelrun stacks (X, in, out), HF stores (out, in)
        for e in range(t.shape[0]):
            out[f"{prefix}.experts.{e}.{leaf}.weight"] = t[e].t().contiguous()
    return {**llama_hf.state_dict_to_hf(dense, args), **out}


def hf_config(args: Any) -> dict[str, Any]:
    config = llama_hf.hf_config(args)
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key, None)
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=args.moe_ffn_dim,
                  num_local_experts=args.n_experts, num_experts_per_tok=args.experts_per_token,
                  router_aux_loss_coef=args.aux_loss_coef, output_router_logits=False, sliding_window=None)
    return config
