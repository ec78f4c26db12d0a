"""`relayrl plan --sweep KEY=V1,V2,...`: one prediction per value, as a table and a PNG (trainer
busy and samples/s against the value) drawn like `relayrl report`'s plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from relayrl.errors import UserError

SWEEP_PNG = "plan-sweep.png"


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """`KEY=V1,V2,...` → (key, values); UserError naming the spec when it is malformed."""
    key, sep, values = spec.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise UserError(f"--sweep {spec}: expected KEY=V1,V2,... (e.g. rollout.num_samplers=1,2,3)")
    return key.strip(), items


def _cell(figure: object, scale: float = 1.0, digits: int = 1) -> str:
    if not isinstance(figure, dict):
        return "-"
    return f"{figure['mean'] * scale:.{digits}f} ± {figure['std'] * scale:.{digits}f}"


def sweep_table(key: str, rows: Sequence[tuple[str, dict[str, object]]]) -> str:
    """Plain-text table: one row per value, the predicted figures with their spread."""
    header = (key, "samples/s", "trainer busy %", "step time ms", "staleness mean", "sync round ms")
    lines = [header]
    for value, p in rows:
        lines.append(
            (
                value,
                _cell(p.get("samples_per_s")),
                _cell(p.get("trainer_busy_fraction"), 100),
                _cell(p.get("step_time_s"), 1e3),
                _cell(p.get("staleness_mean"), 1, 2),
                _cell(p.get("sync_round_s"), 1e3),
            )
        )
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines) + "\n"


def _xs(values: Sequence[str]) -> tuple[list[float], list[str] | None]:
    try:
        return [float(v) for v in values], None
    except ValueError:
        return [float(i) for i in range(len(values))], list(values)


def draw_sweep(key: str, rows: Sequence[tuple[str, dict[str, object]]], path: Path, measured: dict[str, object] | None = None) -> Path:
    """Trainer busy (left axis) and samples/s (right axis) against `key`, error bars = min..max
    across seeds; the source run's measured point when `measured` is given. Returns `path`."""
    from matplotlib.figure import Figure

    xs, labels = _xs([v for v, _ in rows])

    def series(name: str, scale: float) -> tuple[list[float], list[list[float]]]:
        mean: list[float] = []
        err: list[list[float]] = [[], []]
        for _, p in rows:
            f = p.get(name)
            m = f["mean"] * scale if isinstance(f, dict) else float("nan")
            mean.append(m)
            err[0].append(m - f["min"] * scale if isinstance(f, dict) else 0.0)
            err[1].append(f["max"] * scale - m if isinstance(f, dict) else 0.0)
        return mean, err

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    busy, busy_err = series("trainer_busy_fraction", 100)
    ax.errorbar(xs, busy, yerr=busy_err, color="#d62728", marker="o", capsize=3, label="trainer busy % (predicted)")
    ax.set_ylabel("trainer busy %")
    ax.set_ylim(0, 105)
    rate_ax = ax.twinx()
    rate, rate_err = series("samples_per_s", 1)
    rate_ax.errorbar(xs, rate, yerr=rate_err, color="#1f77b4", marker="s", capsize=3, label="samples/s (predicted)")
    rate_ax.set_ylabel("samples/s")
    src_rate = measured.get("samples_per_s") if measured else None
    top = max([r + e for r, e in zip(rate, rate_err[1]) if r == r] + [float(src_rate) if isinstance(src_rate, int | float) else 0.0])
    rate_ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    if measured is not None and labels is None:
        src = measured.get("value")
        if isinstance(src, int | float):
            if isinstance(b := measured.get("trainer_busy_fraction"), int | float):
                ax.plot([src], [b * 100], marker="*", markersize=12, color="#d62728", linestyle="none", label="trainer busy % (source run)")
            if isinstance(r := measured.get("samples_per_s"), int | float):
                rate_ax.plot([src], [r], marker="*", markersize=12, color="#1f77b4", linestyle="none", label="samples/s (source run)")
    if labels is not None:
        ax.set_xticks(xs, labels)
    elif all(x == int(x) for x in xs):
        ax.set_xticks(xs)
    ax.set_title(f"Planned: trainer busy and samples/s against {key}", fontsize=11, loc="left")
    ax.set_xlabel(key)
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()
    more = rate_ax.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="lower left", fontsize=8)
    fig.savefig(path, dpi=100)
    return path
