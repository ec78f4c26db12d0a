"""The report page: `report.html` from a run's data, key figures and rendered plots.

Invariant: the page opens offline — no script, no remote resource; each plot is embedded as a
data URI and links to its PNG file next to it — and every value on it is HTML-escaped and comes
from the `RunData`, key figures and plot results it is given (nothing is read or computed here).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from relayrl.analysis.plots import PlotResult
from relayrl.analysis.rundata import SAMPLE_CHARS, SAMPLE_STEPS, KeyFigure, Row, RunData, format_value

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1250px; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f4f4f4; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.src { color: #888; font-size: 0.85em; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; } .skip { color: #a33; } .error { color: #a00; font-weight: 600; }
.cols { columns: 2; column-gap: 2em; } .notes li { color: #a60; }
table.samples pre { white-space: pre-wrap; margin: 0; max-width: 480px; font-size: 0.9em; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _figures_table(figures: Sequence[KeyFigure]) -> str:
    rows = []
    for f in figures:
        raw = "" if f.value is None else json.dumps(f.value)
        rows.append(
            f'<tr data-key="{_e(f.key)}"><th>{_e(f.label)}</th>'
            f'<td class="num" data-value="{_e(raw)}">{_e(f.text)}</td><td class="src">{_e(f.source)}</td></tr>'
        )
    return '<table class="figures"><tr><th>figure</th><th>value</th><th>from</th></tr>' + "".join(rows) + "</table>"


def _last_row_table(rows: Sequence[Row]) -> str:
    if not rows:
        return '<p class="skip">metrics.jsonl has no complete row yet.</p>'
    last = rows[-1]
    cells = "".join(
        f'<tr data-key="{_e(k)}"><th>{_e(k)}</th><td class="num" data-value="{_e(json.dumps(v))}">{_e(format_value(v))}</td></tr>'
        for k, v in last.items()
    )
    return f'<div class="cols"><table class="last-metrics">{cells}</table></div>'


def _ledger_table(summary: Row | None) -> str:
    ledger = summary.get("ledger") if summary else None
    if not isinstance(ledger, dict):
        return ""
    cells = "".join(
        f'<tr><th>{_e(k)}</th><td class="num">{_e(json.dumps(v) if isinstance(v, dict) else format_value(v))}</td></tr>'
        for k, v in ledger.items()
    )
    return f'<h2>Ledger</h2><table class="ledger">{cells}</table>'


def _samples_table(data: RunData) -> str:
    """Up to SAMPLE_STEPS steps, evenly spaced: the best and the worst reward completion of each."""
    if not data.samples:
        return ""
    rows = "".join(
        f'<tr class="{_e(x.which)}"><td class="num">{_e(x.step)}</td><td>{_e(x.which)}</td>'
        f'<td class="num">{_e(format_value(x.reward))}</td><td><pre>{_e(x.prompt)}</pre></td><td><pre>{_e(x.completion)}</pre></td></tr>'
        for x in data.samples
    )
    return (
        '<h2>Sample completions</h2><p class="sub">The best and the worst reward completion of up to '
        f"{SAMPLE_STEPS} steps, evenly spaced (trajectory log; texts cut to {SAMPLE_CHARS} characters).</p>"
        '<table class="samples"><tr><th>step</th><th></th><th>reward</th><th>prompt</th><th>completion</th></tr>' + rows + "</table>"
    )


def _plot_html(result: PlotResult, run_dir: Path) -> str:
    title = _e(result.spec.title)
    if result.png is None:
        return f'<section><h2>{title}</h2><p class="skip">{_e(result.note)}</p></section>'
    rel = result.png.relative_to(run_dir).as_posix()
    data_uri = "data:image/png;base64," + base64.b64encode(result.png.read_bytes()).decode("ascii")
    return (
        f'<section><h2>{title}</h2><figure><a href="{_e(rel)}"><img src="{data_uri}" alt="{title}"></a>'
        f'<figcaption>{_e(result.note)} <a href="{_e(rel)}">{_e(rel)}</a></figcaption></figure></section>'
    )


def render_html(data: RunData, figures: Sequence[KeyFigure], plots: Sequence[PlotResult]) -> str:
    name = data.run_dir.resolve().name
    status = next((f.text for f in figures if f.key == "status"), "")
    error = data.summary.get("error") if data.summary else None
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>relayrl report — {_e(name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>relayrl run <code>{_e(name)}</code></h1>",
        f'<p class="sub">status <b>{_e(status)}</b> · {len(data.metrics)} step(s) in metrics.jsonl · report written {when}</p>',
    ]
    if error:
        parts.append(f'<p class="error">error: {_e(error)}</p>')
    if data.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in data.notes) + "</ul>")
    parts.append("<h2>Key figures</h2>" + _figures_table(figures))
    parts.extend(_plot_html(p, data.run_dir) for p in plots)
    parts.append(_samples_table(data))
    parts.append(_ledger_table(data.summary))
    step = data.metrics[-1].get("step") if data.metrics else None
    parts.append(f"<h2>Last metrics row (step {_e(format_value(step))})</h2>" + _last_row_table(data.metrics))
    parts.append("</body></html>\n")
    return "\n".join(parts)
