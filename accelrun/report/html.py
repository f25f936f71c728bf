"""``report.html``: one self-contained page per run, and the page toolkit ``compare`` and ``ab`` share.

Self-contained means it opens offline and asks the network for nothing: the CSS is inline, the
plots are inline SVG (:mod:`accelrun.report.plots`), there are no scripts, fonts or images from
elsewhere. Without matplotlib the page keeps its tables and says how to install plots.

Example::

    write_report_html(report, config_summary, run_dir, env=env)   # run_dir / "report.html"
"""

from __future__ import annotations

import html
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from accelrun.report import fmt
from accelrun.report.files import write_text_atomic
from accelrun.report.markdown import (
    compiler_items,
    compiler_rows,
    headline_rows,
    rank_rows,
    sparkline,
    threads_why,
    whole_run_line,
)
from accelrun.report.metrics import read_metrics
from accelrun.report.plots import INSTALL_HINT, PlotsUnavailable, run_plots
from accelrun.report.profiler import PROFILE_DIR

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f;
       max-width: 980px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 2px; } h2 { font-size: 17px; margin-top: 28px;
     border-bottom: 1px solid #e3e3e3; padding-bottom: 3px; }
.sub { color: #666; margin-top: 0; } code, pre { font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
table { border-collapse: collapse; margin: 8px 0; } th, td { padding: 3px 10px; border-bottom: 1px solid #eee;
       text-align: left; vertical-align: top; } th { background: #fafafa; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.verdict { font-size: 16px; font-weight: 600; padding: 8px 12px; background: #f1f6fb; border-left: 4px solid #1f6fb4; }
.bad { background: #fbf1f1; border-left-color: #c23b3b; } .warn { color: #9a5b00; }
.note { color: #555; } svg.plot { width: 100%; max-width: 780px; height: auto; display: block; margin: 6px 0 14px; }
figure { margin: 0; } figcaption { color: #666; font-size: 12px; }
details summary { cursor: pointer; color: #1f6fb4; }
"""


def esc(value: object) -> str:
    return html.escape("n/a" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    """A complete HTML5 document with the shared inline style."""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def section(title: str, *parts: str) -> str:
    return f"<section>\n<h2>{esc(title)}</h2>\n" + "\n".join(p for p in parts if p) + "\n</section>"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells are escaped, columns in ``numeric`` are right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{esc(c)}</td>' if i in numeric else f"<td>{esc(c)}</td>"
                         for i, c in enumerate(row)) + "</tr>\n"
        for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def paragraph(text: str, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<p{attr}>{esc(text)}</p>"


def bullet_list(items: Sequence[str], cls: str = "") -> str:
    if not items:
        return ""
    attr = f' class="{cls}"' if cls else ""
    return f"<ul{attr}>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


def details(summary: str, content_html: str) -> str:
    return f"<details><summary>{esc(summary)}</summary>\n{content_html}\n</details>"


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def plots_block(make: Callable[[], Sequence[tuple[str, str]]]) -> str:
    """The figures ``make`` draws; without matplotlib (or if drawing fails) a line that says so."""
    try:
        figures = make()
    except PlotsUnavailable:
        return paragraph(f"Plots need matplotlib, which is not installed here. To get them: {INSTALL_HINT}",
                         "warn plots-missing")
    except Exception as e:  # a plotting bug must not cost the run its report
        return paragraph(f"plots could not be drawn: {type(e).__name__}: {e}", "warn")
    return "\n".join(f"<figure>{svg}<figcaption>{esc(caption)}</figcaption></figure>" for caption, svg in figures)


def env_rows(env: dict) -> list[tuple[str, str]]:
    v, cpu, cuda, git = (env.get(k) or {} for k in ("versions", "cpu", "cuda", "git"))
    gpu = (", ".join(cuda.get("devices") or []) + f" (CUDA {cuda.get('cuda_version')})"
           if cuda.get("available") else "none")
    commit = git.get("commit")
    return [
        ("CPU", f"{cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores, "
                f"torch threads {cpu.get('torch_threads', '?')}{threads_why(cpu)}"),
        ("GPU", gpu),
        ("software", f"torch {v.get('torch', '?')}, Python {v.get('python', '?')}, "
                     f"triton {v.get('triton') or 'not installed'}, accelrun {v.get('accelrun', '?')}"),
        ("host", f"{env.get('hostname') or '?'} ({env.get('platform', '?')})"),
        ("git (the folder it ran in)", (commit[:12] + (" (dirty)" if git.get("dirty") else "")) if commit else "n/a"),
    ]


def breakdown_table(report: dict) -> str:
    """Median seconds per part of a steady step, and each part's share of their sum."""
    parts = report.get("step_breakdown_s")
    if not parts:
        return paragraph("No steady steps were measured, so there is no breakdown.", "note")
    total = sum(parts.values()) or 1.0
    rows = [(name, fmt.secs(t), fmt.pct(t / total)) for name, t in parts.items()]
    st = (report.get("step_time_s") or {}).get("median")
    rows.append(("whole step (median)", fmt.secs(st), ""))
    note = paragraph("Medians over steady steps (warm-up, compile and profiled steps left out); the parts' "
                     "medians need not add up to the step's. With several processes, communication is inside "
                     "these parts; the figures above give the time rank 0 spent blocked in it (CPU jobs).",
                     "note")
    return table(["part", "time", "share"], rows, numeric=(1, 2)) + note


def render_report_html(report: dict, config_summary: dict, *, metrics: list[dict], env: dict | None = None,
                       config_yaml: str = "", sources_text: str = "", traces: Sequence[str] = ()) -> str:
    name = config_summary.get("name", report.get("name", "run"))
    warmup = int(report.get("warmup_steps") or 0)
    head = (f"<h1>accelrun report: {esc(name)}</h1>\n<p class=\"sub\">status <b>{esc(report.get('status'))}</b> · "
            f"{esc(report.get('steps', 0))} steps · config hash <code>{esc(config_summary.get('config_hash'))}</code>"
            f" · training hash <code>{esc(report.get('training_hash'))}</code></p>")
    if report.get("error"):
        head += paragraph(f"error: {report['error']}", "verdict bad")
    figures = table(["figure", "value"], headline_rows(report))
    loss = _loss_fallback(report)
    plots = plots_block(lambda: run_plots(metrics, warmup))
    summary_rows = [(k, v) for k, v in config_summary.items() if k not in ("name", "config_hash")
                    and (v is None or isinstance(v, (str, int, float, bool)))]
    config_parts = [table(["key", "value"], summary_rows)]
    if config_yaml:
        config_parts.append(details("resolved config.yaml", pre(config_yaml)))
    if sources_text:
        config_parts.append(details("where each value came from (config.sources.txt)", pre(sources_text)))
    body = [head, section("Figures", figures), section("Plots", plots, loss),
            section("Step time breakdown", breakdown_table(report))]
    if ranks := rank_rows(report):
        body.append(section("Ranks", table(["rank", "peak memory", "step time (median)"], ranks, numeric=(1, 2))))
    if compiler := report.get("compiler"):  # report.md's Compiler section (the HTML had none)
        body.append(section("Compiler", table(["figure", "value"], compiler_rows(compiler)),
                            bullet_list([f"{label}: {text}" for label, text in compiler_items(compiler)], "note")))
    body.append(section("Configuration", *config_parts))
    if env:
        body.append(section("Environment", table(["", "this run"], env_rows(env))))
    if traces:
        links = "".join(f'<li><a href="{esc(t)}">{esc(t)}</a></li>' for t in traces)
        body.append(section("Profiler trace", f"<ul>{links}</ul>", paragraph(
            "Chrome trace format: open it in Perfetto (ui.perfetto.dev) or chrome://tracing.", "note")))
    notes = report.get("notes") or []
    if notes:
        body.append(section("Notes", bullet_list(notes, "note")))
    return page(f"accelrun report: {name}", "\n".join(body))


def _loss_fallback(report: dict) -> str:
    """The loss as text, for readers without plots (and for search)."""
    curve = report.get("loss_curve") or []
    if not curve:
        return ""
    val = (f"; validation loss {fmt.num(report['final_val_loss'])}"
           if report.get("final_val_loss") is not None else "")
    line = paragraph(f"loss {fmt.num(report.get('first_loss'))} → {fmt.num(report.get('final_loss'))}{val}  "
                     f"{sparkline([p['loss'] for p in curve])}", "note")
    if report.get("whole_run"):  # a resumed folder: the figures above are its own
        line += paragraph(whole_run_line(report["whole_run"]), "note")
    return line + details("loss at sampled steps", table(["step", "loss"], [(p["step"], fmt.num(p["loss"]))
                                                                            for p in curve], numeric=(0, 1)))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


def write_report_html(report: dict, config_summary: dict, run_dir: str | Path, *, env: dict | None = None) -> Path:
    """Write ``run_dir/report.html`` from the report, ``metrics.jsonl``, ``config.yaml`` and any traces.

    Never raises for a rendering problem: the run's other reports matter more, so a failure writes a
    page that names the error instead.
    """
    run_dir = Path(run_dir)
    path = run_dir / "report.html"
    try:
        metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        traces = sorted(str(p.relative_to(run_dir)) for p in (run_dir / PROFILE_DIR).glob("*.json"))
        text = render_report_html(report, config_summary, metrics=metrics, env=env,
                                  config_yaml=_read(run_dir / "config.yaml"),
                                  sources_text=_read(run_dir / "config.sources.txt"), traces=traces)
    except Exception:
        text = page("accelrun report", section("report.html could not be rendered", pre(traceback.format_exc()),
                                               paragraph("report.md and report.json have the figures.")))
    write_text_atomic(text, path)
    return path
