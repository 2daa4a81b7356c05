"""A bench suite's rows as a PNG bar chart (matplotlib, Agg backend).

What to plot comes from the suite module's optional `PLOT` constant: one panel
`(x column, metric column, y label)` or a tuple of such panels, each optionally with a
fourth entry, a series column, for grouped bars (e.g. one bar per bucket size). Without
`PLOT`, the first column whose values are all text is the x axis and the first other
numeric column the metric. Values that are missing or not numbers ("not reached")
get no bar and are written at the baseline instead; metrics named `vs_*` are ratios
and get a reference line at 1.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

Panel = tuple  # (x column, metric column, y label[, series column])


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    return None if math.isnan(float(v)) else float(v)


def panels(rows: Sequence[dict], columns: Sequence[str], plot=None) -> list[Panel]:
    """Normalises a suite's `PLOT` into a list of panels, or derives one panel.

    Args:
      rows: the suite's result rows.
      columns: the suite's columns, in table order.
      plot: a panel, a sequence of panels, or None to choose from the data.

    Returns:
      A non-empty list of `(x, metric, y label[, series])` tuples.

    Raises:
      ValueError: if a panel names a column that is not in `columns`, or, without
        `plot`, no column holds numbers.
    """
    if plot:
        out = [tuple(plot)] if isinstance(plot[0], str) else [tuple(p) for p in plot]
        for p in out:
            missing = [c for c in (p[0], p[1], *p[3:4]) if c not in columns]
            if len(p) not in (3, 4) or missing:
                raise ValueError(f"bad plot panel {p!r}: need (x, metric, y label[, series]) "
                                 f"naming columns of {list(columns)}")
        return out
    text = [c for c in columns if rows and all(isinstance(r.get(c), str) for r in rows)]
    x = text[0] if text else columns[0]
    numeric = [c for c in columns if c != x
               and any(_number(r.get(c)) is not None for r in rows)
               and all(r.get(c) is None or _number(r.get(c)) is not None for r in rows)]
    if not numeric:
        raise ValueError(f"no numeric column to plot among {list(columns)}")
    return [(x, numeric[0], numeric[0])]


def write_png(rows: Sequence[dict], columns: Sequence[str], path: str, plot=None,
              title: str = "") -> str:
    """Draws one bar chart per panel (one above the other) and saves it as a PNG.

    Args:
      rows: the suite's result rows.
      columns: the suite's columns.
      path: where to write the PNG.
      plot: the suite's `PLOT` (see the module docstring), or None.
      title: figure title.

    Returns:
      `path`.

    Raises:
      ImportError: if matplotlib is not installed.
      ValueError: see `panels`.

    Example:
      >>> write_png([{"mode": "stock", "vs_stock": 1.0}, {"mode": "fp16", "vs_stock": 0.5}],
      ...           ["mode", "vs_stock"], "/tmp/x.png", ("mode", "vs_stock", "step / stock"))
      '/tmp/x.png'
    """
    chosen = panels(rows, columns, plot)
    try:
        from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError("--png needs matplotlib: pip install 'tf_gradsync[bench]' "
                          "(or pip install matplotlib)") from e
    # A bare Figure renders with Agg on savefig; pyplot (and its global backend) is not needed.
    fig = Figure(figsize=(max(6.0, 0.6 * max(_slots(rows, p) for p in chosen) + 2),
                          4.0 * len(chosen)), layout="constrained")
    axes = fig.subplots(len(chosen), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, chosen):
        _bars(ax, rows, *panel)
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
    return path


def write_scatter(rows: Sequence[dict], path: str, scatter: tuple, title: str = "") -> str:
    """Plots one column against another, log-log, one marker series per group, with
    the diagonal and a +-15% band: a prediction against what was measured.

    Args:
      rows: the suite's result rows (rows lacking either value are left out).
      path: where to write the PNG.
      scatter: `(x column, y column, group column)`, e.g. the cluster suite's
        `("step_s", "predicted_s", "mode")`.
      title: figure title.

    Returns:
      `path`.
    """
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    x, y, group = scatter
    points = [r for r in rows if _number(r.get(x)) and _number(r.get(y))]
    fig = Figure(figsize=(6.0, 5.0), layout="constrained")
    ax = fig.subplots()
    for g in dict.fromkeys(str(r.get(group)) for r in points):
        mine = [r for r in points if str(r.get(group)) == g]
        ax.scatter([r[x] for r in mine], [r[y] for r in mine], label=g, s=18)
    if points:
        lo = min(min(r[x], r[y]) for r in points) * 0.8
        hi = max(max(r[x], r[y]) for r in points) * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15],
                        color="grey", alpha=0.15, label="+-15%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title)
    fig.savefig(path, format="png", dpi=100)
    return path


def _slots(rows, panel) -> float:
    """Horizontal room a panel needs, in bar-group widths."""
    if len(panel) < 4:
        return len(rows)
    labels = {str(r.get(panel[0])) for r in rows}
    groups = {r.get(panel[3]) for r in rows}
    return len(labels) * max(1.0, len(groups) / 3)


def _bars(ax, rows, x: str, metric: str, ylabel: str, series: str | None = None) -> None:
    labels = list(dict.fromkeys(str(r.get(x)) for r in rows))
    groups = list(dict.fromkeys(r.get(series) for r in rows)) if series else [None]
    width = 0.8 / len(groups)
    for g, group in enumerate(groups):
        members = [r for r in rows if series is None or r.get(series) == group]
        # Without a series, repeated x values keep a bar each (positions, not labels).
        pos = ([labels.index(str(r.get(x))) for r in members] if series
               else list(range(len(members))))
        pos = [p - 0.4 + width * (g + 0.5) for p in pos]
        values = [_number(r.get(metric)) for r in members]
        bars = ax.bar([p for p, v in zip(pos, values) if v is not None],
                      [v for v in values if v is not None], width,
                      label=None if series is None else f"{series}={group}")
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        for p, v, r in zip(pos, values, members):
            if v is None:
                ax.text(p, 0, "n/a" if r.get(metric) is None else str(r.get(metric)),
                        rotation=90, ha="center", va="bottom", fontsize=7)
    ticks = labels if series else [str(r.get(x)) for r in rows]
    ax.set_xticks(range(len(ticks)), ticks, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(ticks) - 0.4)   # room for slots that have no bar
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    if metric.startswith("vs_"):
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    if series:
        ax.legend(fontsize=8)
