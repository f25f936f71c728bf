"""Checks across keys for the MoE family and expert parallelism (``parallel.ep``); each message names
every key involved and where it was set. Called by ``accelrun.config.validate``."""

from __future__ import annotations

from collections.abc import Callable

from accelrun.config.schema import RunConfig


def moe_problems(cfg: RunConfig, deg: dict[str, int], v: Callable[[str], str]) -> list[str]:
    """``deg``: the parallel degrees with -1 resolved (they are known to multiply to the world size)."""
    m, par = cfg.model, cfg.parallel
    out: list[str] = []
    is_moe = m.custom is None and m.arch == "moe"
    if is_moe and m.experts_per_token > m.n_experts:
        out.append(f"{v('model.experts_per_token')} exceeds {v('model.n_experts')}")
    if par.ep == 1:
        if is_moe:
            out += _unsupported_layouts(deg, v)
        return out
    if not is_moe:
        out.append(f"{v('parallel.ep')} needs a mixture-of-experts model (model.arch = moe), but "
                   f"{v('model.custom') if m.custom is not None else v('model.arch')}")
        return out
    dp_ranks = deg["dp_shard"] * deg.get("cp", 1)
    if m.n_experts % par.ep:
        out.append(f"{v('parallel.ep')} does not divide {v('model.n_experts')} (each expert-parallel rank "
                   f"holds n_experts / ep experts)")
    if dp_ranks % par.ep:
        out.append(f"{v('parallel.ep')} does not divide the data-parallel shard ranks dp_shard × cp = {dp_ranks} "
                   f"({v('parallel.dp_shard')}): experts are spread over ranks carved out of them")
    if par.fsdp_impl == "compiled":
        out.append(f"{v('parallel.ep')} needs parallel.fsdp_impl = fsdp2, but {v('parallel.fsdp_impl')}")
    return out + _unsupported_layouts(deg, v)


def _unsupported_layouts(deg: dict[str, int], v: Callable[[str], str]) -> list[str]:
    out = []
    if deg["tp"] > 1:
        out.append(f"model.arch = moe with {v('parallel.tp')} is not supported yet (no tensor-parallel plan "
                   "for the experts)")
    if deg["pp"] > 1:
        out.append(f"model.arch = moe with {v('parallel.pp')} is not supported yet (the load-balancing loss "
                   "is added outside the pipeline's loss)")
    return out


MOE_KEYS = ("n_experts", "experts_per_token", "moe_ffn_dim", "shared_expert_ffn_dim", "aux_loss_coef",
            "capacity_factor")


def moe_warnings(cfg: RunConfig, set_by_user: Callable[..., object]) -> list[str]:
    """Keys the user set that the model will not read: the MoE keys on another family, ffn_dim on MoE."""
    m = cfg.model
    if m.custom is not None:
        return []  # the custom-model warning names every family key already
    if m.arch != "moe":
        ignored = [f"model.{k}" for k in MOE_KEYS if set_by_user("model", k)]
        one = len(ignored) == 1
        return [f"{', '.join(ignored)} {'is' if one else 'are'} read only by model.arch = moe; model.arch = "
                f"{m.arch} ignores {'it' if one else 'them'}"] if ignored else []
    if set_by_user("model", "ffn_dim"):
        return ["model.ffn_dim has no effect with model.arch = moe (routed experts are model.moe_ffn_dim wide, "
                "the shared expert model.shared_expert_ffn_dim)"]
    return []
