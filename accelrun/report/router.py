"""The mixture-of-experts part of a report: router load, imbalance, dropped tokens, aux loss
(from the per-step ``moe_*`` figures of ``accelrun.train.router_metrics``)."""

from __future__ import annotations

import statistics

MOE_MFU_NOTE = ("mixture of experts: FLOPs per token, TFLOP/s and MFU count active parameters (each token's "
                "top-k routed experts, the shared expert, the router and attention), not every expert's")


def router_summary(metrics: list[dict]) -> dict | None:
    """Whole-run router figures, or None for a model without a router."""
    steps = [m for m in metrics if m.get("moe_tokens_per_expert") is not None]
    if not steps:
        return None
    totals = [sum(col) for col in zip(*(m["moe_tokens_per_expert"] for m in steps), strict=True)]
    mean = sum(totals) / len(totals)
    imbalance = [m["moe_imbalance"] for m in steps if m.get("moe_imbalance") is not None]
    dropped = sum(int(m.get("moe_dropped_tokens") or 0) for m in steps)
    assigned = sum(totals)
    return {
        "tokens_per_expert": totals,  # summed over the run's steps, layers and ranks
        "imbalance_run": max(totals) / mean if mean else None,  # max / mean of the run's totals
        "imbalance_step_median": statistics.median(imbalance) if imbalance else None,
        "imbalance_step_max": max(imbalance) if imbalance else None,
        "dropped_tokens": dropped,
        "dropped_frac": dropped / assigned if assigned else 0.0,
        "aux_loss_first": steps[0].get("moe_aux_loss"),
        "aux_loss_final": steps[-1].get("moe_aux_loss"),
        "ep_local_experts": steps[-1].get("ep_local_experts"),
        "ep_all_to_all_per_step": steps[-1].get("ep_all_to_all"),
    }


def router_section(r: dict) -> list[str]:
    """report.md's "Experts" section."""
    s = r.get("router")
    if not s:
        return []
    share = s["tokens_per_expert"]
    total = sum(share) or 1
    lines = ["## Experts (router)", "",
             "| figure | value |", "| --- | --- |",
             f"| load-balancing loss (first → final step) | {_f(s['aux_loss_first'])} → {_f(s['aux_loss_final'])} "
             "(1.0 = balanced) |",
             f"| imbalance, max / mean tokens per expert | {_f(s['imbalance_step_median'])} per step (median), "
             f"{_f(s['imbalance_step_max'])} worst step, {_f(s['imbalance_run'])} over the run |",
             f"| dropped (over capacity) | {s['dropped_tokens']:,} assignments ({100 * s['dropped_frac']:.2f}%) |"]
    if s.get("ep_local_experts") is not None:
        # (said of an eager run too, which has no compile to run outside of: a trial's)
        eagerly = ("; the dispatch (all-to-alls and the local experts) runs eagerly under compile: its splits are "
                   "read on the host" if not str(r.get("compiled") or "nothing").startswith("nothing") else "")
        lines.append(f"| expert parallel | {s['ep_local_experts']} experts per layer on each rank; "
                     f"{s['ep_all_to_all_per_step']} all-to-alls per step on rank 0{eagerly} |")
    lines += ["", "tokens per expert (assignments over the run, all layers and ranks): "
              + ", ".join(f"{i}: {100 * n / total:.1f}%" for i, n in enumerate(share)), "", MOE_MFU_NOTE + ".", ""]
    return lines


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
