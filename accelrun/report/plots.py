"""Plots for the HTML reports, drawn with matplotlib (the optional ``plots`` extra) as inline SVG.

Every function returns SVG text that can be pasted into an HTML page as is: no XML prologue, no
DOCTYPE, no metadata, no xlink namespace, ids made unique per plot, and no URL other than the SVG
namespace itself, so a report opens offline and several plots share a page. Without matplotlib,
:func:`plots_available` is False and the functions raise :class:`PlotsUnavailable`; the HTML writers
then show tables only and say how to install plots (:data:`INSTALL_HINT`).

Example::

    if plots_available():
        svg = step_time_plot(read_metrics(run_dir / "metrics.jsonl"), warmup_steps=5)
"""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Sequence
from typing import Any

from accelrun.report.stats import median

INSTALL_HINT = "pip install matplotlib  (a dependency of accelrun; it is missing from this environment)"
WIDTH_IN, HEIGHT_IN = 7.2, 2.7
COLORS = ("#1f6fb4", "#e5731b", "#2a9d4b", "#c23b3b", "#8155ba", "#8c564b", "#d16bb3", "#6b6b6b")
WARMUP_COLOR, COMPILE_COLOR, PROFILED_COLOR, COLOR_OUT = "#d9d9d9", "#c23b3b", "#e5a11b", "#555555"
# Steps slower than this many times the steady median are drawn at the top edge and labelled, so one
# compile step of 40 s does not flatten the 20 ms steps into a line along the axis.
CLIP_FACTOR = 3.0

_ids = itertools.count()


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (the object-oriented API: no pyplot state)
    except ImportError as e:
        raise PlotsUnavailable(f"matplotlib is not installed; for plots: {INSTALL_HINT}") from e
    return matplotlib


def plots_available() -> bool:
    try:
        _matplotlib()
    except PlotsUnavailable:
        return False
    return True


def _figure(title: str, ylabel: str, xlabel: str = "step"):
    _matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, color="#eeeeee", linewidth=0.6)
    if xlabel == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def to_svg(fig) -> str:
    """A figure as SVG text fit for inlining (see the module docstring)."""
    matplotlib = _matplotlib()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "accelrun"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    svg = svg.replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "").replace("xlink:href=", "href=")
    svg = re.sub(r'\s(width|height)="[\d.]+pt"', "", svg, count=2)
    svg = svg.replace("<svg ", '<svg class="plot" role="img" ', 1)
    prefix = f"p{next(_ids)}-"  # several plots on one page: no id may repeat
    svg = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)
    return svg.strip()


def _steps(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [m for m in metrics if m.get(key) is not None]
    return [int(m["step"]) for m in rows], [float(m[key]) for m in rows]


def _shade_warmup(ax, metrics: list[dict], warmup_steps: int) -> None:
    if warmup_steps > 0 and metrics:
        first = int(metrics[0]["step"])
        last = int(metrics[min(warmup_steps, len(metrics)) - 1]["step"])
        ax.axvspan(first - 0.5, last + 0.5, color=WARMUP_COLOR, alpha=0.6, linewidth=0, label="warm-up")


def loss_plot(metrics: list[dict], warmup_steps: int = 0) -> str:
    fig, ax = _figure("Loss", "loss")
    _shade_warmup(ax, metrics, warmup_steps)
    steps, loss = _steps(metrics, "loss")
    ax.plot(steps, loss, color=COLORS[0], linewidth=1.2, label="train")
    val_steps, val_loss = _steps(metrics, "val_loss")
    if val_steps:  # eval.every: held-out loss at the steps it ran
        ax.plot(val_steps, val_loss, color=COLORS[1], linewidth=1.2, marker="o", markersize=3, label="validation")
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    return to_svg(fig)


def _marked_series(ax, metrics: list[dict], key: str, scale: float, unit: str, warmup_steps: int, *,
                   clip: bool) -> None:
    """One per-step series with warm-up shaded, compile and profiled steps marked, the steady median
    drawn, and (``clip``) outliers pinned to the top edge with their value written beside them."""
    _shade_warmup(ax, metrics, warmup_steps)
    rows = [m for m in metrics if m.get(key) is not None]
    xs = [int(m["step"]) for m in rows]
    ys = [float(m[key]) * scale for m in rows]
    steady = [y for m, y in zip(rows[warmup_steps:], ys[warmup_steps:], strict=True)
              if not m.get("compile") and not m.get("profiled")]
    top = None
    if clip and steady and max(ys) > CLIP_FACTOR * median(steady):
        top = CLIP_FACTOR * median(steady)
        above = [(x, y) for x, y in zip(xs, ys, strict=True) if y > top]
        for i, (x, y) in enumerate(above):
            ax.plot([x], [top], marker="^", color=COLOR_OUT, markersize=6, clip_on=False)
            ax.annotate(f"{y / 1000:.1f} s" if y >= 1000 else f"{y:.0f} {unit}", (x, top), fontsize=7,
                        xytext=(5, -10 - 9 * (i % 3)), textcoords="offset points", color=COLOR_OUT)  # staggered
    shown = [min(y, top) if top else y for y in ys]
    ax.plot(xs, shown, color=COLORS[0], linewidth=1.0, marker="o", markersize=2.2, label="step")
    ax.set_ylim(0, top * 1.05 if top else None)
    for flag, color, label in (("compile", COMPILE_COLOR, "compile"), ("profiled", PROFILED_COLOR, "profiled")):
        pts = [(x, y) for m, x, y in zip(rows, xs, shown, strict=True) if m.get(flag)]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=36, marker="x", color=color, zorder=5, label=label, clip_on=False)
    if steady:
        ax.axhline(median(steady), color=COLORS[1], linestyle="--", linewidth=0.9,
                   label=f"steady median {_short(median(steady))} {unit}")
    ax.legend(fontsize=7, frameon=False, loc="best")


def _short(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def step_time_plot(metrics: list[dict], warmup_steps: int = 0) -> str:
    fig, ax = _figure("Step time (warm-up shaded, compile steps marked)", "ms")
    _marked_series(ax, metrics, "step_time_s", 1000.0, "ms", warmup_steps, clip=True)
    return to_svg(fig)


def throughput_plot(metrics: list[dict], warmup_steps: int = 0) -> str:
    fig, ax = _figure("Tokens per second (this device)", "tokens/s")
    _marked_series(ax, metrics, "tokens_per_s", 1.0, "tokens/s", warmup_steps, clip=False)
    return to_svg(fig)


def memory_plot(metrics: list[dict]) -> str | None:
    """Peak memory per step in MiB; None when no step recorded memory."""
    steps, mem = _steps(metrics, "mem_peak_bytes")
    if not steps:
        return None
    fig, ax = _figure("Peak memory", "MiB")
    ax.plot(steps, [m / 2**20 for m in mem], color=COLORS[2], linewidth=1.2)
    ax.set_ylim(bottom=0)
    return to_svg(fig)


def run_plots(metrics: list[dict], warmup_steps: int) -> list[tuple[str, str]]:
    """(caption, svg) for one run's report: loss, step time, tokens/s, memory."""
    plots = [
        ("loss", loss_plot(metrics, warmup_steps)),
        ("step time", step_time_plot(metrics, warmup_steps)),
        ("tokens/s", throughput_plot(metrics, warmup_steps)),
    ]
    mem = memory_plot(metrics)
    if mem is not None:
        plots.append(("memory", mem))
    return plots


def loss_overlay_plot(curves: Sequence[tuple[str, dict[int, float]]]) -> str:
    """Several runs' loss curves on one plot (``(label, {step: loss})``)."""
    fig, ax = _figure("Loss", "loss")
    # Curves that agree lie on top of each other: dashes keep every one visible.
    for (label, curve), color, style in zip(curves, itertools.cycle(COLORS), itertools.cycle(("-", "--", ":", "-."))):
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], color=color, linestyle=style, linewidth=1.3, label=label)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    return to_svg(fig)


def step_time_box_plot(groups: Sequence[tuple[str, Sequence[float]]]) -> str:
    """Distributions of steady step times (seconds), one box per run or variant, in ms."""
    fig, ax = _figure("Steady step time (warm-up and compile left out)", "ms", xlabel="")
    labels = [label for label, _ in groups]
    data = [[t * 1000 for t in times] or [float("nan")] for _, times in groups]
    parts = ax.boxplot(data, tick_labels=labels, showfliers=True, widths=0.5, patch_artist=True,
                       medianprops={"color": "#222222"}, flierprops={"markersize": 3})
    for box, color in zip(parts["boxes"], itertools.cycle(COLORS)):
        box.set_facecolor(color)
        box.set_alpha(0.55)
    ax.set_ylim(bottom=0)
    return to_svg(fig)
