"""A :class:`~accelrun.report.compare.Comparison` as rows of text, markdown and a self-contained HTML page.

The same table feeds the terminal (``accelrun compare``), ``compare.md`` / ``ab.md`` and the HTML
pages, so the three never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

from accelrun.report import fmt, html
from accelrun.report.compare import ABSENT, FEW_REPEATS, NOT_READ, Comparison, GroupFigures
from accelrun.report.plots import loss_overlay_plot, step_time_box_plot
from accelrun.report.stats import RatioCI


def ratio_text(ci: RatioCI | None, baseline: bool = False, processes: int = FEW_REPEATS) -> str:
    """``1.23× (1.19–1.27)``, ``*`` marking an interval that excludes 1 over ``processes`` runs enough to
    call it (the fewer of the two rows'): one process's steps do not show another's pace."""
    if baseline:
        return "baseline"
    if ci is None:
        return "n/a"
    marked = ci.significant and processes >= FEW_REPEATS
    return f"{ci.ratio:.3f}× ({ci.low:.3f}–{ci.high:.3f}){' *' if marked else ''}"


def processes(c: Comparison, row: GroupFigures) -> int:
    """The runs a row's speed interval rests on: the fewer of its own and the first row's."""
    return min(row.runs, c.rows[0].runs)


def _significant(c: Comparison, marked_rows: bool) -> bool:
    """Some row's interval excludes 1, over enough runs to carry the ``*`` (or, ``marked_rows`` False, not)."""
    return any(r.speedup is not None and r.speedup.significant and (processes(c, r) >= FEW_REPEATS) == marked_rows
               for r in c.rows[1:])


def marked(c: Comparison) -> bool:
    """Some row's speed carries the ``*`` (see ``ratio_text``)."""
    return _significant(c, True)


def unmarked(c: Comparison) -> bool:
    """Some row's interval excludes 1 over too few processes to be marked."""
    return _significant(c, False)


def parity_text(row: GroupFigures, reference: str) -> str:
    if row.parity is None:
        return "reference"
    text = row.parity.describe(reference, row.label)
    return f"{text} ({row.parity_cause})" if row.parity_cause else text


def summary_table(c: Comparison) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: one row per group, figures as strings."""
    repeats = any(r.runs > 1 for r in c.rows)
    headers = ["run", *(["runs"] if repeats else []), "steady steps", "step time (median)", "tokens/s (job)",
               "speed vs " + c.rows[0].label + " (95% CI)", "MFU", "peak memory", "compile", "final loss"]
    rows = []
    for i, r in enumerate(c.rows):
        rows.append([r.label, *([str(r.runs)] if repeats else []), str(r.steady_steps), fmt.secs(r.median_step_s),
                     fmt.integer(r.tokens_per_s), ratio_text(r.speedup, i == 0, processes(c, r)),
                     fmt.pct(r.mfu),
                     fmt.nbytes(r.mem_peak_bytes), fmt.secs(r.compile_time_s), fmt.loss(r.final_loss)])
    if any(r.final_val_loss is not None for r in c.rows):  # eval.every in any of them
        headers.append("final val loss")
        for row, r in zip(rows, c.rows, strict=True):
            row.append(fmt.loss(r.final_val_loss))
    return headers, rows


NUMERIC_COLUMNS_FROM = 1  # every column after the label is a figure
SPEED_NOTE = ("Speed is throughput against the first: its median step time over this one's (scaled by tokens "
              "per step where they differ; > 1: faster), over steady steps (warm-up, compile and profiled "
              "steps left out), with a seeded bootstrap 95% interval on that ratio of medians; * marks an "
              f"interval that excludes 1 over {FEW_REPEATS} or more runs of each. With repeats, runs are resampled before steps, so differences "
              "between processes count as noise; ab's rounds (A1 B1, A2 B2, ...) are resampled as pairs.")


# A new user compared eager's 786 MiB with accelrun's 674 and took both for tensors.
MEMORY_NOTE = ("Peak memory: on a CPU the process's peak resident memory (Python, torch, the compiler and the "
               "data included); on a GPU the peak of the tensors allocated.")


def parity_lines(c: Comparison) -> list[str]:
    """Each row's loss parity, saying against what: the reference's own repeats against its first run
    (a bare "A: identical" read as if compared with nothing), every other row against the reference."""
    ref = c.rows[0].label

    def against(i: int, r: GroupFigures) -> str:
        if i == 0:
            return f"{r.label}'s repeats against its first run: "
        return "" if r.parity.status == "differ" else f"{r.label} against {ref}: "  # "B parts from A" names both

    return [f"{against(i, r)}{parity_text(r, ref)}" for i, r in enumerate(c.rows) if r.parity is not None]


def spread_lines(c: Comparison) -> list[str]:
    """How much the repeats of each setting differ, and (paired rounds) each round's speed ratio."""
    lines = [f"{r.label}: the repeats' median step times differ by up to {fmt.pct(r.run_spread)}"
             for r in c.rows if r.run_spread is not None]
    ref = c.rows[0].label
    lines += [f"{r.label} vs {ref}, round by round: " + ", ".join("n/a" if x is None else f"{x:.3f}×"
                                                                  for x in r.round_ratios)
              for r in c.rows if r.round_ratios]
    return lines


def diff_rows(c: Comparison, limit: int | None = None) -> tuple[list[str], list[list[str]]]:
    labels = c.labels
    headers = ["key", *labels]
    rows = [[d.key, *(src if src in (ABSENT, NOT_READ) else f"{v!r}  ({src})"
                      for v, src in zip(d.values, d.sources, strict=True))]
            for d in c.diff[:limit]]
    return headers, rows


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, numeric: bool = True) -> list[str]:
    def cell(v: str) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join(["---"] + ["---:" if numeric else "---"] * (len(headers) - 1)) + " |"]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def render_comparison_md(c: Comparison, *, title: str, verdict: Sequence[str] = (), intro: Sequence[str] = ()) -> str:
    lines = [f"# {title}", ""]
    lines += [f"**{v}**" for v in verdict] + ([""] if verdict else [])
    lines += [f"- {i}" for i in intro] + ([""] if intro else [])
    headers, rows = summary_table(c)
    lines += _md_table(headers, rows) + [""]
    lines += [SPEED_NOTE, "", MEMORY_NOTE, ""]
    lines += ["## Loss parity", "", f"relative tolerance {c.rtol:g}", ""] + [f"- {p}" for p in parity_lines(c)] + [""]
    spread = spread_lines(c)
    if spread:
        lines += ["## Run-to-run spread", ""] + [f"- {line}" for line in spread] + [""]
    lines += ["## Config differences", ""]
    if c.diff:
        lines += _md_table(*diff_rows(c), numeric=False) + [""]
    else:
        lines += ["none: every run has the same resolved config", ""]
    if c.warnings or c.notes:
        lines += ["## Warnings and notes", ""] + [f"- {w}" for w in c.warnings + c.notes] + [""]
    lines += ["## Runs", ""] + [f"- {g.label}: " + ", ".join(f"`{r.path}`" for r in g.runs) for g in c.groups]
    return "\n".join(lines) + "\n"


def render_comparison_html(c: Comparison, *, title: str, verdict: Sequence[str] = (), bad: bool = False,
                           intro: Sequence[str] = ()) -> str:
    headers, rows = summary_table(c)
    numeric = tuple(range(NUMERIC_COLUMNS_FROM, len(headers)))
    parts = [f"<h1>{html.esc(title)}</h1>"]
    parts += [html.paragraph(v, "verdict bad" if bad else "verdict") for v in verdict]
    parts += [html.paragraph(i, "sub") for i in intro]
    parts.append(html.section("Speed", html.table(headers, rows, numeric=numeric), html.paragraph(SPEED_NOTE, "note"),
                              html.paragraph(MEMORY_NOTE, "note")))
    parts.append(html.section("Plots", html.plots_block(lambda: _plots(c))))
    parity = html.bullet_list(parity_lines(c)) or html.paragraph("only one run: nothing to compare", "note")
    parts.append(html.section("Loss parity", html.paragraph(f"relative tolerance {c.rtol:g}", "note"), parity))
    spread = spread_lines(c)
    if spread:
        parts.append(html.section("Run-to-run spread", html.bullet_list(spread)))
    diff = (html.table(*diff_rows(c)) if c.diff
            else html.paragraph("none: every run has the same resolved config", "note"))
    parts.append(html.section("Config differences", diff))
    if c.warnings or c.notes:
        parts.append(html.section("Warnings and notes", html.bullet_list(c.warnings, "warn"),
                                  html.bullet_list(c.notes, "note")))
    runs = html.bullet_list([f"{g.label}: " + ", ".join(str(r.path) for r in g.runs) for g in c.groups])
    parts.append(html.section("Runs", runs))
    return html.page(title, "\n".join(parts))


def _plots(c: Comparison) -> list[tuple[str, str]]:
    curves = [(g.label if len(g.runs) == 1 else f"{g.label} (run 1)", g.runs[0].losses()) for g in c.groups]
    boxes = [(g.label, [t for r in g.runs for t in r.steady_step_times()]) for g in c.groups]
    return [("loss per step", loss_overlay_plot(curves)),
            ("steady step times (all runs of each)", step_time_box_plot(boxes))]
