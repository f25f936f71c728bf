"""Search the layouts of a recipe on its cluster: degrees (context parallelism's included),
micro-batch, checkpointing, resharding, sequence and loss parallelism.

Every candidate is a set of ``key=value`` overrides applied to the recipe and validated by
``accelrun.config.validate`` exactly as ``accelrun train`` would validate it, so a layout that breaks
a rule (degrees that do not multiply to the world size, heads not divisible by ``tp``, a batch not
divisible by micro-batch × data-parallel degree, ...) is never proposed: the rules live in one place.
The global batch, sequence length, model and precision are the recipe's; the world is the whole
cluster. Candidates that fit in memory are ranked by predicted tokens per second.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from accelrun.config import ConfigError
from accelrun.config.compose import Composed, Source
from accelrun.config.validate import validate
from accelrun.plan.cluster import Cluster
from accelrun.plan.errors import PlanError
from accelrun.plan.predict import Plan, predict
from accelrun.plan.workload import PlanOptions

SEARCH_AC_MODES = ("none", "every_n", "selective", "full")  # what a recipe can select


# Keys every proposal states even when the recipe already has that value: the layout in brief.
ALWAYS_SHOWN = ("parallel.dp_shard", "parallel.tp", "train.micro_batch", "train.activation_checkpoint.mode")


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # every key the search set, ``key=value``
    plan: Plan
    changed: tuple[str, ...] = ()  # those that differ from the recipe, plus ALWAYS_SHOWN

    @property
    def line(self) -> str:
        """The overrides to add to the recipe's command line to train this layout."""
        return " ".join(self.changed or self.overrides)

    @property
    def summary(self) -> str:
        lay, w = self.plan.workload.layout, self.plan.workload
        parts = [f"pp {lay.pp}" if lay.pp > 1 else "", f"dp {lay.dp_replicate}×{lay.dp_shard}",
                 f"cp {lay.cp}" if lay.cp > 1 else "", f"tp {lay.tp}", f"ep {lay.ep}" if lay.ep > 1 else "",
                 f"micro {w.micro_batch}", f"ckpt {w.ac_mode}",
                 f"{lay.pp_microbatches} pipeline chunks" if lay.pp > 1 else "",
                 "sequence + loss parallel" if lay.sequence_parallel and lay.loss_parallel else "",
                 "" if lay.reshard_after_forward or not lay.fsdp else "no reshard"]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class SearchResult:
    best: list[Candidate]
    considered: int  # override sets tried
    valid: int  # of which the recipe rules accept
    fitting: int  # of which fit in memory


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_overrides(base_cfg, cluster: Cluster) -> list[dict[str, object]]:
    """Every combination the search tries, as {dotted key: value} (validation prunes the invalid)."""
    t, par = base_cfg.train, base_cfg.parallel
    world = cluster.size
    out: list[dict[str, object]] = []
    head: dict[str, object] = {"parallel.nnodes": cluster.nodes, "parallel.nproc_per_node": cluster.devices_per_node}
    if t.grad_accum is not None:
        head["train.grad_accum"] = None  # derived from the new layout
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for dp_replicate, cp in _replicate_and_cp(world // (pp * tp), t.seq_len):
                dp_shard = world // (pp * tp * dp_replicate * cp)
                dp = dp_replicate * dp_shard
                if t.global_batch % dp:
                    continue
                for micro in divisors(t.global_batch // dp):
                    for ac in SEARCH_AC_MODES:
                        for reshard in ((True, False) if dp_shard > 1 else (par.reshard_after_forward,)):
                            for chunks in ((pp, 2 * pp, 4 * pp) if pp > 1 else (None,)):
                                # Sequence and loss parallelism need tp > 1 (with or without pipelining).
                                for sharded in ((False, True) if tp > 1 else (False,)):
                                    o = {**head, "parallel.pp": pp, "parallel.dp_replicate": dp_replicate,
                                         "parallel.dp_shard": dp_shard, "parallel.cp": cp, "parallel.tp": tp,
                                         "train.micro_batch": micro,
                                         "train.activation_checkpoint.mode": ac,
                                         "parallel.sequence_parallel": sharded, "parallel.loss_parallel": sharded}
                                    if chunks is not None:
                                        o["parallel.microbatches"] = chunks
                                    if reshard != par.reshard_after_forward:
                                        o["parallel.reshard_after_forward"] = reshard
                                    out += _with_expert_parallel(o, base_cfg, dp_shard * cp)
    return out


def _with_expert_parallel(o: dict[str, object], base_cfg, shard_ranks: int) -> list[dict[str, object]]:
    """``o`` once per expert-parallel degree worth trying for a mixture of experts (those dividing both
    its expert count and the data-parallel shard ranks); other families: ``o`` as is."""
    m = base_cfg.model
    if m.custom is not None or m.arch != "moe":
        return [o]
    return [{**o, "parallel.ep": ep} for ep in divisors(shard_ranks) if m.n_experts % ep == 0]


def _replicate_and_cp(ranks: int, seq_len: int) -> list[tuple[int, int]]:
    """(dp_replicate, cp) pairs whose product divides ``ranks`` (dp_shard takes the rest). Context
    parallel degrees that cannot split the sequence into 2 × cp chunks are left out here rather than
    multiplied through the other keys only to be refused."""
    return [(rep, cp) for rep in divisors(ranks) for cp in divisors(ranks // rep) if seq_len % (2 * cp) == 0]


def override_text(key: str, value: object) -> str:
    """``key=value`` as a user types it (values are YAML)."""
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={shown}"


def _candidate(base: Composed, values: dict[str, object]) -> Composed:
    """``base`` with ``values`` set, as ``apply_override`` would set them (without parsing YAML again)."""
    data = copy.deepcopy(base.data)
    sources = dict(base.sources)
    for key, value in values.items():
        path = tuple(key.split("."))
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        sources[path] = Source("override", text=override_text(key, value))
    return Composed(data, sources, base.files)


def search_layouts(base: Composed, cluster: Cluster, options: PlanOptions | None = None,
                   top: int = 5) -> SearchResult:
    """The ``top`` layouts that fit, fastest first."""
    base_cfg = validate(base.data, base.sources)
    recipe = base_cfg.model_dump()
    if options and options.activation_checkpoint:
        # The search varies checkpointing itself; a what-if policy would override every candidate's.
        options = PlanOptions()
    considered = valid = 0
    fitting: list[Candidate] = []
    for values in candidate_overrides(base_cfg, cluster):
        considered += 1
        try:
            composed = _candidate(base, values)
            cfg = validate(composed.data, composed.sources)
        except ConfigError:
            continue
        valid += 1
        try:
            plan = predict(cfg, options, cluster)
        except PlanError:
            continue
        if plan.fits:
            every = tuple(override_text(k, v) for k, v in values.items())
            changed = tuple(override_text(k, v) for k, v in values.items()
                            if k in ALWAYS_SHOWN or _value(recipe, k) != v)
            fitting.append(Candidate(every, plan, changed))
    fitting.sort(key=lambda c: (-c.plan.tokens_per_s, c.plan.memory.total))
    return SearchResult(fitting[:top], considered, valid, len(fitting))


def _value(data: dict, key: str) -> object:
    node: object = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()
