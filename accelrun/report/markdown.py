"""``report.md``: the run's headline figures, loss curve, configuration and machine, readable as text."""

from __future__ import annotations

import math
from pathlib import Path

from accelrun.report.files import write_text_atomic
from accelrun.report.fmt import integer as _int
from accelrun.report.fmt import nbytes as _bytes
from accelrun.report.fmt import num as _num
from accelrun.report.fmt import pct as _pct
from accelrun.report.fmt import secs as _secs
from accelrun.report.router import router_section

SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def write_report_md(report: dict, config_summary: dict, path: str | Path, *, env: dict | None = None) -> None:
    """Write a markdown report for a :func:`~accelrun.report.summary.summarize` result.

    ``config_summary`` gives the title (``name``) and ``config_hash``; its other scalar keys
    (model size, precision, compile backend, ...) are listed as the run's configuration. ``env`` is a
    :func:`~accelrun.report.env.collect_env` result (default: ``report["env"]`` when present).
    """
    write_text_atomic(render_report_md(report, config_summary, env=env), path)


def render_report_md(report: dict, config_summary: dict, *, env: dict | None = None) -> str:
    env = env if env is not None else report.get("env")
    name = config_summary.get("name", "run")
    lines = [f"# accelrun report: {name}", ""]
    lines += [f"config hash `{config_summary.get('config_hash', 'unknown')}` · "
              f"{report.get('steps', 0)} steps{_of_the_whole_run(report)}", ""]
    lines += _headline(report) + [""]
    lines += _breakdown_section(report)
    ranks = rank_rows(report)
    if ranks:
        lines += ["## Ranks", "", "| rank | peak memory | step time (median) |", "| ---: | ---: | ---: |"]
        lines += [f"| {' | '.join(row)} |" for row in ranks] + [""]
    lines += _compiler_section(report.get("compiler"))
    lines += _loss_section(report) + [""]
    lines += router_section(report)
    extra = {k: v for k, v in config_summary.items()
             if k not in ("name", "config_hash") and (v is None or isinstance(v, (str, int, float, bool)))}
    if extra:
        lines += ["## Configuration", "", "| key | value |", "| --- | --- |"]
        lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in extra.items()] + [""]
    if env:
        lines += _env_section(env) + [""]
    notes = report.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


MAX_REGIONS_LISTED = 10  # regions left to ATen named one by one; the rest counted


def _compiler_section(c: dict | None) -> list[str]:
    if not c:
        return []
    out = ["## Compiler", "", "| figure | value |", "| --- | --- |"]
    out += [f"| {_cell(k)} | {_cell(v)} |" for k, v in compiler_rows(c)] + [""]
    items = compiler_items(c)
    out += [f"- {'**warning**' if label == 'warning' else label}: {_cell(text)}" for label, text in items]
    return out + [""] if items else out


def compiler_rows(c: dict) -> list[tuple[str, str]]:
    """(figure, value) rows of a run's compile section (``CompileRecord.summary``): report.md's and
    report.html's."""
    out: list[tuple[str, str]] = []
    if c.get("compiled"):
        out.append(("compiled", c["compiled"]))
    graphs = c.get("graph_cache") or {}
    if "dynamo_graphs" in c:
        loaded = c.get("graphs_loaded") or 0
        if loaded:  # a cached run compiled none of them: "graphs compiled 2 (2 loaded)" read as both
            out.append(("graphs", f"{c['dynamo_graphs'] + loaded}: {c['dynamo_graphs']} compiled in this run, "
                                  f"{loaded} loaded from the graph cache"))
        else:
            out.append(("graphs compiled", str(c["dynamo_graphs"])))
    out.append(("graph breaks", str(c.get("graph_breaks", 0))))
    dyn = c.get("dynamo") or {}
    if dyn:
        # Frames the graph cache took go around Dynamo's counters (record.refresh_dynamo adds them): which way.
        # "given a graph", not "compiled": a cached run's frames are loaded (a trial read "2 compiled" beside
        # "0 compiled in this run, 2 loaded").
        traced, from_cache = graphs.get("compiled"), graphs.get("loaded")
        via = [f"{traced} traced to be saved in the graph cache"] if traced else []
        if from_cache:
            via.append(f"{from_cache} loaded from " + ("it" if traced else "the graph cache"))
        # Frames Dynamo took whole but found no tensor operation in (a trial read "given a graph 6" beside
        # "graphs compiled 0" as a contradiction).
        empty = (" (no tensor operation in them to compile)" if dyn.get("frames_compiled", 0)
                 and not c.get("dynamo_graphs", 0) + (graphs.get("loaded") or 0) else "")
        out.append(("Dynamo frames seen / given a graph / skipped",
                    f"{dyn.get('frames_seen', 0)} / {dyn.get('frames_compiled', 0)} / "
                    f"{len(dyn.get('frames_skipped', []))}" + empty
                    + (f" ({', '.join(via)})" if via and dyn.get("frames_via_graph_cache") else "")))
    if "fallbacks" in c:
        out.append(("compiler fallbacks", str(len(c["fallbacks"]))))
    for stage, secs in (c.get("stage_seconds") or {}).items():
        out.append((stage, f"{secs:.2f} s"))
    if "cache" in c:
        out.append(("kernel cache (the regions' built kernels) hits / misses",
                    f"{c['cache']['hits']} / {c['cache']['misses']}"))
    if "off" in graphs:
        out.append(("graph cache", f"off: {graphs['off']}"))
    elif graphs:
        out.append(("graph cache: loaded / compiled and saved", f"{graphs['loaded']} / {graphs['saved']}"))
        if graphs.get("rejected"):
            out.append(("graph cache: entries whose guards rejected these calls (saved for other inputs or "
                        "module attributes), compiled again", str(graphs["rejected"])))
        if changed := graphs.get("state_changed"):
            out.append(("graph cache: compiled, held only under other settings", "; ".join(changed)))
        if errors := graphs.get("errors"):  # each one is also listed below the table
            # mostly not failures: why a method cannot be saved (a graph break), by design; or a load or save that failed
            out.append(("graph cache: not used or not saved, why", f"{len(errors)}: {errors[0]}"))
    if c.get("passes_fired"):
        fired = ", ".join(f"{k} ({v})" for k, v in c["passes_fired"].items())
        out.append(("passes that changed a graph (forward and backward graphs counted apart)", fired))
    if c.get("dropout_in_kernels"):
        out.append(("dropout drawn in accelrun's kernels (its own generator: masks unlike eager's, so losses "
                    "part from an eager run's)", f"{c['dropout_in_kernels']} call(s) in the graphs"))
    if c.get("regions_per_executor"):
        out.append(("fusion regions by executor", ", ".join(f"{k} {v}" for k, v in c["regions_per_executor"].items())))
    if c.get("regions_with_runtime_rows"):
        out.append(("fusion regions whose kernels read a changing size at each call (a row count or a length: "
                    "one graph for all sizes)", str(c["regions_with_runtime_rows"])))
    if "ops_left_to_aten" in c:
        out.append(("ops outside regions (ATen calls that compute; views left out)", str(c["ops_left_to_aten"])))
    if (cuda_graphs := c.get("cuda_graphs") or {}).get("row"):  # compile.cuda_graphs, and why not
        out.append(("CUDA graphs", cuda_graphs["row"]))
    return out


def compiler_items(c: dict) -> list[tuple[str, str]]:
    """(label, text) of what a compile section lists below its figures, one line each. Never silent:
    nothing compiled, frames Dynamo skipped, fallbacks (compile/coverage.py, record.py)."""
    graphs = c.get("graph_cache") or {}
    out = [("warning", w) for w in c.get("warnings") or []]
    out += [("fallback", f) for f in c.get("fallbacks") or []]
    out += [(f"attention left to ATen's kernel ({calls} call(s) in the graphs)", why)
            for why, calls in (c.get("attention_left_to_aten") or {}).items()]
    left = c.get("regions_left_to_aten") or []
    out += [("left to ATen", region) for region in left[:MAX_REGIONS_LISTED]]
    if len(left) > MAX_REGIONS_LISTED:
        out.append(("left to ATen", f"{len(left) - MAX_REGIONS_LISTED} more regions (report.json lists every one; "
                                    "`accelrun compile explain` says more)"))
    out += [(f"graph break ×{n}", reason) for reason, n in (c.get("graph_break_reasons") or {}).items()]
    out += [("graph cache", error) for error in graphs.get("errors", [])]
    return out


def _headline(r: dict) -> list[str]:
    return ["| figure | value |", "| --- | --- |"] + [f"| {k} | {_cell(v)} |" for k, v in headline_rows(r)]


def _loss_tokens(r: dict) -> str:
    """Targets in the loss per step against the tokens computed (which tokens/s counts)."""
    counted, computed = r.get("loss_tokens_per_step"), r.get("tokens_per_step")
    if counted is None or not computed:
        return "n/a"
    # (per device: the job's tokens over its devices, as tokens/s per device counts them; under tensor or
    # pipeline parallelism a group's devices each work on all of its tokens, so "computed" misled)
    return f"{counted:,.0f} per step per device, {share_said(counted, computed)} of its {computed:,} " \
        "(the job's tokens over its devices, as tokens/s counts them)"


def share_said(part: float, whole: float) -> str:
    """``part / whole`` as a percentage that reads 100% or 0% only when it is (4,089 of 4,096 read "100%")."""
    share = part / whole
    if part in (0, whole) or round(share, 2) == round(share, 6):
        return f"{share:.0%}"
    for digits in (1, 2, 3):
        said = f"{share:.{digits}%}"
        if float(said[:-1]) not in (0.0, 100.0):
            return said
    return "under 100%" if part < whole else "over 0%"


def headline_rows(r: dict) -> list[tuple[str, str]]:
    """(figure, value) pairs a report leads with: throughput, MFU, step time, memory, compile, warm-up."""
    st = r.get("step_time_s") or {}
    peak = r.get("peak") or {}
    if r.get("mfu") is not None:
        mfu = f"{_pct(r['mfu'])} of {_num(peak.get('tflops'))} TFLOP/s ({peak.get('source')})"
        if r["mfu"] > 1:
            mfu += "; above 100%: the peak is too low (see the notes)"
    elif r.get("flops_per_token") is None:  # whatever the peak, the model's FLOPs are unknown
        mfu = f"n/a (no FLOP count per token: {(r.get('model') or {}).get('flops_source', 'unknown')})"
    else:
        mfu = f"n/a (peak: {peak.get('source', 'unknown')})"
    step = (f"{_secs(st.get('median'))} (p10 {_secs(st.get('p10'))}, p90 {_secs(st.get('p90'))}; "
            f"{r.get('steady_steps', 0)} steady steps)")
    rows = [
        ("tokens/s (job)", _int(r.get("tokens_per_s_job") or r.get("tokens_per_s"))),
        ("tokens/s per device", _int(r.get("tokens_per_s"))),
        ("MFU", mfu),
        ("achieved TFLOP/s", _num(r.get("tflops"))),
        ("step time median", step),
        (_peak_label(r), _bytes(r.get("mem_peak_bytes"))),
        ("compile time (apart)", _secs(r.get("compile_time_s"))),
        ("warm-up time", f"{_secs(r.get('warmup_time_s'))} ({_warmup_steps_text(r)})"),
        ("data loading share", _pct(r.get("data_share"))),
        ("total step time", _secs(r.get("total_time_s"))),
    ]
    after_peak = rows.index((_peak_label(r), _bytes(r.get("mem_peak_bytes")))) + 1
    if (blocks := r.get("host_blocks")) is not None:  # train.cpu_malloc = blocks: rank 0's cache
        reused = f"{blocks['hits']:,} of {blocks['hits'] + blocks['misses']:,}"
        rows.insert(after_peak, ("host block cache", (
            f"{_bytes(blocks['peak_mapped'])} mapped at most, live blocks {_bytes(blocks['peak_live'])} (their "
            f"tensors asked for {_bytes(blocks['peak_requested'])}); {reused} requests from 1 MiB reused a mapped "
            "block")))
    if r.get("mem_reserved_bytes") is not None:  # CUDA: what the caching allocator held, its cache included
        rows.insert(after_peak, ("peak reserved (CUDA allocator)", _bytes(r.get("mem_reserved_bytes"))))
    comm = r.get("comm_time_s")
    if comm:  # multi-process CPU jobs only (accelrun.dist.comm_timing)
        rows.insert(4, (comm.get("what", "communication"),
                        f"{_secs(comm.get('median'))} per step (median); {_pct(comm.get('share'))} of the steady steps' "
                        "time in all"))
    cp = r.get("cp_comm")
    if cp:  # parallel.cp > 1: its share of the communication row (or a row of its own where none is timed)
        took = _secs(cp["seconds"]) if cp.get("seconds") is not None else "untimed (in compiled blocks)"
        text = (f"context parallel K/V all-gathers {took} ({int(cp.get('gathers') or 0)} "
                f"calls, {_bytes(int(cp.get('bytes') or 0))} received) per step")
        if comm:
            rows[4] = (rows[4][0], f"{rows[4][1]}; of which {text}")
        else:
            rows.insert(4, ("communication", text))
    ov = r.get("comm_overlap")
    if ov:  # accelrun.dist.comm_overlap
        rows.insert(5, ("FSDP communication exposed / in flight",
                        f"{_secs(ov.get('exposed_s'))} / {_secs(ov.get('busy_s'))} per step (median); "
                        f"overlap {_pct(ov.get('overlap_fraction'))}"))
    if r.get("loss_tokens_per_step") is not None:  # after the rows placed by index above, right after tokens/s
        rows.insert(2, ("tokens in the loss", _loss_tokens(r)))
    return rows


def _peak_label(r: dict) -> str:
    """What the peak is of: a CPU run's is the process's resident memory (ru_maxrss), a GPU run's the
    tensors allocated; both had read "peak memory"."""
    device = str(r.get("device") or "")
    of = "process RSS" if device.startswith("cpu") else "tensors allocated" if device.startswith("cuda") else ""
    if r.get("mem_peak_rank") is not None:  # a job's: its highest rank's
        of = ", ".join(w for w in (of, f"the rank with the highest peak: rank {r['mem_peak_rank']}") if w)
    return f"peak memory ({of})" if of else "peak memory"


def _warmup_steps_text(r: dict) -> str:
    """The steps that warm-up time sums: the first ones, and any later step that compiled (a recompile)."""
    steps = r.get("warmup_steps", 0)
    if isinstance(r.get("steps"), int):  # a run shorter than its warm-up: the steps it ran
        steps = min(steps, r["steps"])
    text = f"first {steps} step{'' if steps == 1 else 's'}"
    if recompiled := r.get("excluded_compile_steps", 0):
        text += f" + {recompiled} later step{'' if recompiled == 1 else 's'} that compiled"
    return text


def rank_rows(r: dict) -> list[tuple[str, str, str]]:
    """(rank, peak memory, median steady step time) of each rank of a multi-process job."""
    mem = r.get("mem_peak_bytes_per_rank") or []
    times = r.get("step_time_s_per_rank") or []
    if max(len(mem), len(times)) < 2:
        return []
    mem, times = [*mem, *[None] * (len(times) - len(mem))], [*times, *[None] * (len(mem) - len(times))]
    return [(str(i), _bytes(m), _secs(t)) for i, (m, t) in enumerate(zip(mem, times, strict=True))]


def _breakdown_section(r: dict) -> list[str]:
    """Median seconds per part of a steady step, when the loop measured them."""
    parts = r.get("step_breakdown_s")
    if not parts:
        return []
    total = sum(parts.values()) or 1.0
    lines = ["## Step time breakdown (steady-state medians)", "", "| part | time | share |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {_secs(t)} | {_pct(t / total)} |" for name, t in parts.items()]
    return lines + [""]


def _of_the_whole_run(r: dict) -> str:
    """For a resumed run's folder: which of the run's steps its figures cover."""
    whole = r.get("whole_run")
    if not whole:
        return ""
    return (f" in this folder (from step {r.get('first_step', '?')}) of the run's {whole['steps']} over "
            f"{whole['folders']} folders: the figures below are this folder's; the whole run's are under Loss")


def whole_run_line(whole: dict) -> str:
    """A resumed run's figures over all its folders (``summary.whole_run_summary``), in one line."""
    step = whole.get("step_time_median_s")
    tokens = whole.get("tokens")
    return (f"the whole run ({whole['steps']} steps over {whole['folders']} folders, as `accelrun runs list` and "
            f"`compare` show it): loss {_num(whole.get('first_loss'))} (step {whole.get('first_step')}) → "
            f"{_num(whole.get('final_loss'))}; median step {_secs(step) if step is not None else 'n/a'} over all "
            f"its folders" + (f"; {tokens:,} tokens" if tokens else ""))


def _loss_section(r: dict) -> list[str]:
    lines = ["## Loss", ""]
    if r.get("first_loss") is None:
        return lines + ["no loss recorded"]
    lines.append(f"first → final: {_num(r['first_loss'])} → {_num(r.get('final_loss'))} "
                 f"(mean of the last {r.get('final_loss_window')}: {_num(r.get('final_loss_mean'))})")
    if r.get("whole_run"):
        lines.append(f"\n{whole_run_line(r['whole_run'])}")
    if r.get("final_val_loss") is not None:
        lines.append(f"\nvalidation loss (held-out data, eval.every) at the end: {_num(r['final_val_loss'])}")
    curve = r.get("loss_curve") or []
    if curve:
        lines += ["", f"`{sparkline([p['loss'] for p in curve])}`", ""]
        if len(curve) < (r.get("loss_steps") or 0):
            lines += [f"The loss at {len(curve)} of the run's {r['loss_steps']} steps, spread evenly (to the nearest step), first "
                      "and last included (metrics.jsonl has every step):", ""]
        lines += ["| step | loss |", "| ---: | ---: |"]
        lines += [f"| {p['step']} | {_num(p['loss'])} |" for p in curve]
    return lines


def threads_why(cpu: dict) -> str:
    """``; why`` a run took fewer threads than cores, where it chose so (env.json's cpu section), or ""."""
    return f"; {cpu['threads_chosen']}" if cpu.get("threads_chosen") else ""


def _env_section(env: dict) -> list[str]:
    v, cpu, cuda, git = (env.get(k) or {} for k in ("versions", "cpu", "cuda", "git"))
    lines = ["## Environment", ""]
    lines.append(f"- CPU: {cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores, "
                 f"torch threads {cpu.get('torch_threads', '?')} (inter-op {cpu.get('torch_interop_threads', '?')})"
                 f"{threads_why(cpu)}")
    if cpu.get("malloc"):
        lines.append(f"- host malloc: {cpu['malloc']}")
    if cuda.get("available"):
        lines.append(f"- GPU: {', '.join(cuda.get('devices') or [])} (CUDA {cuda.get('cuda_version')}, "
                     f"cuDNN {cuda.get('cudnn_version')})")
    else:
        lines.append("- GPU: none")
    lines.append(f"- torch {v.get('torch', '?')}, Python {v.get('python', '?')}, "
                 f"triton {v.get('triton') or 'not installed'}, accelrun {v.get('accelrun', '?')}")
    host = env.get("hostname")
    commit = git.get("commit")
    lines.append(f"- host {host or '?'}, {env.get('platform', '?')}, git of the folder it ran in "
                 f"{(commit[:12] + (' (dirty)' if git.get('dirty') else '')) if commit else 'n/a'}")
    return lines


def sparkline(values: list[float]) -> str:
    """One character per value, ▁ (lowest) to █ (highest); × marks a non-finite value."""
    finite = [x for x in values if math.isfinite(x)]
    if not finite:
        return "×" * len(values)
    lo, hi = min(finite), max(finite)
    top = len(SPARK_LEVELS) - 1
    out = []
    for x in values:
        if not math.isfinite(x):
            out.append("×")
        else:
            out.append(SPARK_LEVELS[round((x - lo) / (hi - lo) * top) if hi > lo else 0])
    return "".join(out)


def _cell(v: object) -> str:
    return "n/a" if v is None else str(v).replace("|", "\\|").replace("\n", " ")
