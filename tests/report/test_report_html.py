"""report.html and the comparison pages: valid, self-contained (nothing from the network), plots with
matplotlib and tables without it; report.profile_steps writes a Chrome trace."""

from __future__ import annotations

import json
import re
import shutil
import sys
from html.parser import HTMLParser

import pytest

from accelrun.config import ConfigError, load_config
from accelrun.report import html as report_html
from accelrun.report import plots
from accelrun.report.compare import Group, compare_groups
from accelrun.report.compare_render import render_comparison_html
from accelrun.report.metrics import read_metrics
from accelrun.report.profiler import StepProfiler
from accelrun.report.rundata import load_run
from tests.conftest import DEFAULT_CONFIG
from tests.report.report_run_helpers import train_tiny

VOID = {"meta", "br", "hr", "img", "input", "link", "area", "base", "col", "embed", "source", "track", "wbr"}
SVG_NS = "http://www.w3.org/2000/svg"


class Checker(HTMLParser):
    """Tags nest and close, ids are unique, and nothing points outside the page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.ids, self.errors, self.tags = [], set(), [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._attrs(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self._attrs(tag, attrs)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def _attrs(self, tag, attrs):
        for k, v in attrs:
            if k == "id":
                if v in self.ids:
                    self.errors.append(f"duplicate id {v}")
                self.ids.add(v)
            if k in ("src", "href") and v and not (v.startswith("#") or v.startswith("profile/")):
                self.errors.append(f"<{tag} {k}={v!r}> points outside the page")


def check_self_contained(text: str) -> Checker:
    assert text.startswith("<!DOCTYPE html>")
    without_ns = text.replace(f'xmlns="{SVG_NS}"', "")
    assert "http" not in without_ns.lower(), re.findall(r".{40}http.{40}", without_ns)
    assert "<script" not in text.lower() and "@import" not in text and "url(http" not in text
    c = Checker()
    c.feed(text)
    c.close()
    assert not c.errors, c.errors[:5]
    assert not c.stack, f"unclosed: {c.stack}"
    for tag in ("html", "head", "title", "body"):
        assert c.tags.count(tag) == 1, tag
    return c


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    # The check: a 3-step tiny run with report.profile_steps: [2, 3].
    return train_tiny(tmp_path_factory.mktemp("html") / "runs", 3, "report.profile_steps=[2,3]")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("html2") / "runs", 5)


def test_profile_steps_write_a_chrome_trace_of_those_steps(profiled_run):
    trace = profiled_run / "profile" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"accelrun step 2", "accelrun step 3"} <= names and "accelrun step 1" not in names
    assert any(e.get("ph") == "X" and e.get("name", "").startswith("aten::") for e in events)  # real ops
    rows = read_metrics(profiled_run / "metrics.jsonl")
    assert [bool(r.get("profiled")) for r in rows] == [False, True, True]
    report = json.loads((profiled_run / "report.json").read_text())
    assert report["excluded_profiled_steps"] == 2 and report["steady_steps"] == 0
    assert "2 were profiled" in " ".join(report["notes"])
    assert 'href="profile/trace.json"' in (profiled_run / "report.html").read_text()


def test_run_report_html_is_valid_self_contained_and_has_plots(plain_run):
    text = (plain_run / "report.html").read_text()
    check_self_contained(text)
    assert text.count("<svg") == 4  # loss, step time, tokens/s, memory
    report = json.loads((plain_run / "report.json").read_text())
    assert report["config_hash"] in text and report["training_hash"] in text
    for needle in ("Step time breakdown", "forward", "backward", "optimizer", "tokens/s per device",
                   "config.yaml", "Environment", "warm-up"):
        assert needle in text, needle
    assert "Plots need matplotlib" not in text


def test_without_matplotlib_the_page_keeps_its_tables_and_says_how_to_get_plots(plain_run, tmp_path,
                                                                                monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert not plots.plots_available()
    report = json.loads((run / "report.json").read_text())
    report_html.write_report_html(report, {"name": "x", "config_hash": report["config_hash"]}, run)
    text = (run / "report.html").read_text()
    check_self_contained(text)
    assert "<svg" not in text and "Plots need matplotlib" in text and "pip install matplotlib" in text
    assert "Step time breakdown" in text and "forward" in text and report["config_hash"] in text


def test_a_plotting_error_or_a_rendering_bug_still_leaves_a_page(plain_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    report = json.loads((run / "report.json").read_text())

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(report_html, "run_plots", broken)
    report_html.write_report_html(report, {"name": "x"}, run)
    text = (run / "report.html").read_text()
    assert "plots could not be drawn: RuntimeError: boom" in text and "Step time breakdown" in text
    monkeypatch.setattr(report_html, "render_report_html", broken)
    report_html.write_report_html(report, {"name": "x"}, run)
    text = (run / "report.html").read_text()
    assert "could not be rendered" in text and "boom" in text
    check_self_contained(text)


def test_comparison_page_is_valid_and_self_contained(plain_run, profiled_run):
    groups = [Group("A", [load_run(plain_run, label="A")]), Group("B", [load_run(profiled_run, label="B")])]
    c = compare_groups(groups, resamples=200)
    text = render_comparison_html(c, title="A vs B <&>", verdict=["B is 1.00× faster than A"])
    check_self_contained(text)
    assert text.count("<svg") == 2 and "A vs B &lt;&amp;&gt;" in text
    assert "report.profile_steps" in text  # the config difference, with its source


def test_profiler_started_inside_the_range_and_stopped_early(tmp_path):
    import torch

    rec = {}
    with StepProfiler([2, 5], tmp_path, start_step=2) as prof:  # resumed at step 2: record from step 3
        assert prof.active
        torch.ones(8) @ torch.ones(8)
        prof.step(3, rec)
        torch.ones(4).sum()
    # Left after step 4 began (a preemption): what was recorded is kept.
    assert rec == {"profiled": True} and prof.profiled == [3] and not prof.active
    names = {e.get("name") for e in json.loads((tmp_path / "profile" / "trace.json").read_text())["traceEvents"]}
    assert {"accelrun step 3", "accelrun step 4"} <= names
    assert not StepProfiler(None, tmp_path).active


def test_profile_steps_are_validated():
    with pytest.raises(ConfigError, match="report.profile_steps: expected \\[first, last\\]"):
        load_config(DEFAULT_CONFIG, ["report.profile_steps=[5,3]"])
    with pytest.raises(ConfigError, match="report.profile_steps"):
        load_config(DEFAULT_CONFIG, ["report.profile_steps=[0,3]"])
    assert load_config(DEFAULT_CONFIG, ["report.profile_steps=[2,3]"]).config.report.profile_steps == (2, 3)


def test_a_compiled_runs_page_has_report_mds_compiler_section(plain_run):
    """report.html had no Compiler section, where the README says the page is report.md with plots."""
    from accelrun.report.markdown import render_report_md

    report = json.loads((plain_run / "report.json").read_text())
    report["compiler"] = {"compiled": "2 graphs, 13 fusion regions (cpp 13)", "dynamo_graphs": 2, "graph_breaks": 1,
                          "graph_break_reasons": {"a <branch> on data | here": 1},
                          "regions_per_executor": {"cpp": 13}}
    summary = {"name": "x", "config_hash": report["config_hash"]}
    page = report_html.render_report_html(report, summary, metrics=read_metrics(plain_run / "metrics.jsonl"))
    check_self_contained(page)
    assert "<h2>Compiler</h2>" in page or ">Compiler<" in page
    assert "<td>fusion regions by executor</td><td>cpp 13</td>" in page, page
    assert "graph break ×1: a &lt;branch&gt; on data | here" in page  # escaped once, as HTML (no markdown \\|)
    assert "| graph breaks | 1 |" in render_report_md(report, summary)
