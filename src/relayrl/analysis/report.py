"""Run report: a run directory's plots and key figures as `report.html` plus PNG files.

Job: `write_report(run_dir)` reads what a run wrote — metrics.jsonl, the trajectory log
(trajectories.parquet or trajectories/*.parquet when pyarrow can read it, else
trajectories.jsonl), trace.json, evals.jsonl, summary.json — and writes `report.html` with its
plots as PNGs under `report/`. The work is split by concern: `rundata` reads a run and computes
its key figures, `plots` draws the PNGs, `htmlpage` writes the page, `runlist` lists runs
(`list_runs`, `run_figures`, the `relayrl runs` table); this module puts them together and
re-exports their public names.

Invariant: never writes the run's logs, and tolerates a run still going or one that crashed (no
summary.json, a trace cut off mid-event, a partial last line): a missing file or column skips
that plot with a note in the HTML instead of failing. What is not a run is refused before
anything is written: a directory without any run file, a trace.json that is not a trace
(`tracer.load_trace`, the one trace reader, names the file and event). Every number shown comes from the
run's files — summary.json where it has the figure, else computed from metrics.jsonl, the trace
or evals.jsonl, and the table names which — so the HTML agrees with metrics.jsonl. The HTML opens
offline: no script, no remote resource; each plot is embedded as a data URI and links to its PNG
file next to it.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.analysis.htmlpage import render_html
from relayrl.analysis.plots import (
    PLOTS,
    SPAN_COLOURS,
    STEP_COMPONENTS,
    PlotResult,
    PlotSkipped,
    PlotSpec,
    render_plots,
    step_time_stack,
    timeline_window,
)
from relayrl.analysis.rundata import (
    KeyFigure,
    Row,
    RunData,
    format_value,
    key_figures,
    load_run,
    read_jsonl,
    read_trajectories,
)
from relayrl.analysis.runlist import RUN_FILES, is_run_dir, list_runs, run_figures
from relayrl.plan.check import check_html, read_check
from relayrl.rundir.jsonl import write_text_atomic

__all__ = [
    "PLOTS",
    "REPORT_DIR",
    "REPORT_HTML",
    "RUN_FILES",
    "SPAN_COLOURS",
    "STEP_COMPONENTS",
    "KeyFigure",
    "PlotResult",
    "PlotSkipped",
    "PlotSpec",
    "Row",
    "RunData",
    "format_value",
    "is_run_dir",
    "key_figures",
    "list_runs",
    "load_run",
    "read_jsonl",
    "read_trajectories",
    "render_html",
    "render_plots",
    "run_figures",
    "step_time_stack",
    "timeline_window",
    "write_report",
]

REPORT_HTML = "report.html"
REPORT_DIR = "report"  # the PNGs, relative to the run directory


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` and its PNGs under `run_dir/report/`; returns the HTML's path.
    Works on a finished, a crashed and a still running run. Writes nothing and raises
    FileNotFoundError naming the directory when it does not exist or holds none of `RUN_FILES`,
    and ValueError naming the file and event when its trace.json is not a trace."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not is_run_dir(run_dir):  # checked before anything is written into it
        raise FileNotFoundError(f"{run_dir}: not a run directory (no {', '.join(RUN_FILES)})")
    data = load_run(run_dir, strict=True)
    figures = key_figures(data)
    plots = render_plots(data, run_dir / REPORT_DIR)
    out = run_dir / REPORT_HTML
    html = render_html(data, figures, plots)
    checked = read_check(run_dir)  # planned from another run (relayrl plan --check): the prediction beside the figures
    if checked is not None and "</body>" in html:
        html = html.replace("</body>", check_html(checked) + "</body>", 1)
    write_text_atomic(out, html)  # a reader never sees a half-written report
    return out
