"""Text tables of a ``CompileRecord``: what each pass changed, who took each region and why not the others."""

from __future__ import annotations

from collections import Counter, defaultdict

from accelrun.compile.record import CompileRecord


def pass_rows(record: CompileRecord) -> list[tuple[str, str, str, str, str]]:
    """(graph, pass, ops before → after, what changed, seconds) per pass run."""
    return [
        (p.graph, p.name, f"{p.ops_before} → {p.ops_after}",
         (p.summary or ("changed" if p.counts.get("changed") else "-")) + (f"; numerics {p.numerics}" if p.numerics else ""),
         f"{p.seconds * 1000:.1f} ms")
        for p in record.passes
    ]  # fmt: skip


def executor_rows(record: CompileRecord) -> list[tuple[str, str, str, str]]:
    """(graph, executor, regions, compile seconds) per graph and executor."""
    by: dict[tuple[str, str], list] = defaultdict(list)
    for r in record.regions:
        by[(r.graph, r.executor)].append(r)
    return [(g, ex, str(len(rs)), f"{sum(r.compile_s for r in rs):.2f} s") for (g, ex), rs in by.items()]


def decline_reasons(record: CompileRecord) -> list[tuple[str, str, int]]:
    """(executor, reason, how many regions) — why executors earlier in the list did not take a region."""
    counts: Counter = Counter()
    for r in record.regions:
        for ex, why in r.declined.items():
            counts[(ex, why)] += 1
    return [(ex, why, n) for (ex, why), n in counts.most_common()]


def region_lines(record: CompileRecord, limit: int = 40) -> list[str]:
    lines = []
    for r in record.regions[:limit]:
        ops = ", ".join(r.ops[:8]) + (", …" if len(r.ops) > 8 else "")
        lines.append(f"{r.graph} region {r.region} ({len(r.ops)} ops: {ops}) → {r.executor}")
    if len(record.regions) > limit:
        lines.append(f"… and {len(record.regions) - limit} more (see compile/record.json)")
    return lines
