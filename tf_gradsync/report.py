"""Plots and summarises JSON-lines files written by the tf_gradsync monitors.

Reads the files of `tf_gradsync.callbacks.CommunicationMonitor` or `StepMonitor`,
draws one figure with four panels against wall-clock time (bytes per step, compression
ratio, step time, loss) and prints a summary table:

    python -m tf_gradsync.report none.jsonl fp16.jsonl --out report.png

Runs are named after their file (stem). Plotting needs matplotlib
(`pip install tf_gradsync[report]`); the summary does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

import numpy as np


def load_run(path: str, name: str | None = None) -> dict:
    """Reads one JSON-lines file.

    Args:
      path: file written by a monitor.
      name: run name; the file stem by default.

    Returns:
      A dict with `name`, `batches` and `epochs` (lists of records, by `kind`).

    Raises:
      ValueError: if the file holds no batch records or a line before the last is not
        JSON (a last line cut short, as a running or killed job leaves it, is skipped).
    """
    batches, epochs = [], []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: not a record (a JSON object), got "
                             f"{type(rec).__name__}")
        (epochs if rec.get("kind") == "epoch" else batches).append(rec)
    if not batches:
        raise ValueError(f"{path}: no batch records")
    stem = os.path.splitext(os.path.basename(path))[0]
    return {"name": name or stem, "batches": batches, "epochs": epochs}


def summarise(run: dict) -> dict:
    """One row of the summary table.

    Args:
      run: as returned by `load_run`.

    Returns:
      `run`, `steps`, `bytes_per_step` (mean bytes sent per replica per step),
      `ratio` (dense / sent bytes), `p50_step_ms` (median time per step; NaN when no
      step was timed) and `final_loss` (the last epoch's, else the last batch's; NaN
      when none is finite).
    """
    b = run["batches"]
    steps = np.array([r.get("steps") or 1 for r in b], dtype=float)
    sent = float(np.sum(steps * _column(b, "comm_bytes")))
    dense = float(np.sum(steps * _column(b, "comm_bytes_dense")))
    times = _column(b, "step_time_ms")
    times = times[np.isfinite(times)]
    losses = _column(run["epochs"] or b, "loss")
    losses = losses[np.isfinite(losses)]
    return {
        "run": run["name"],
        "steps": int(b[-1].get("step") or steps.sum()),
        "bytes_per_step": sent / steps.sum(),
        "ratio": dense / sent if sent else 1.0,
        "p50_step_ms": float(np.median(times)) if times.size else math.nan,
        "final_loss": float(losses[-1]) if losses.size else math.nan,
    }


def format_table(rows: Sequence[dict]) -> str:
    """The summary rows as an aligned text table."""
    head = ("run", "steps", "bytes/step", "ratio", "p50 step ms", "final loss")
    body = [(r["run"], f"{r['steps']:,}", f"{r['bytes_per_step']:,.0f}", f"{r['ratio']:.2f}x",
             f"{r['p50_step_ms']:.2f}", f"{r['final_loss']:.4f}") for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = [head, tuple("-" * w for w in widths)] + body
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def plot(runs: Sequence[dict], out: str, smooth: int = 25) -> None:
    """Draws the four panels of `runs` into the image file `out`.

    Args:
      runs: as returned by `load_run`.
      out: image path; the format follows its extension (PNG, SVG, PDF).
      smooth: window (in records) of the rolling median drawn over step times.

    Raises:
      ImportError: if matplotlib is not installed.
    """
    plt = _pyplot()
    unit, scale = _bytes_unit(max(np.nanmax(_column(r["batches"], "comm_bytes_dense"))
                                  for r in runs))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    (ax_bytes, ax_ratio), (ax_time, ax_loss) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c, b = colors[i % len(colors)], run["batches"]
        t = _column(b, "wall_time_s")
        ax_bytes.plot(t, _column(b, "comm_bytes") / scale, color=c, lw=2, drawstyle="steps-post",
                      label=run["name"])
        ax_bytes.plot(t, _column(b, "comm_bytes_dense") / scale, color=c, lw=1, ls="--",
                      alpha=0.6, drawstyle="steps-post")
        ax_ratio.plot(t, _column(b, "compression_ratio"), color=c, lw=2, drawstyle="steps-post")
        ms = _column(b, "step_time_ms")
        ax_time.plot(t, ms, ".", color=c, ms=3, alpha=0.3)
        ax_time.plot(t, _rolling_median(ms, smooth), color=c, lw=1.5)
        rows = run["epochs"] or b
        ax_loss.plot(_column(rows, "wall_time_s"), _column(rows, "loss"), "o-" if run["epochs"]
                     else "-", color=c, lw=2, ms=3)
    ax_bytes.set(title="Bytes sent per replica per step (dashed: uncompressed)",
                 ylabel=f"bytes per step ({unit})")
    ax_bytes.set_ylim(bottom=0)
    ax_ratio.set(title="Compression ratio (uncompressed / sent)", ylabel="ratio (x)")
    ax_ratio.set_ylim(bottom=0)
    ax_time.set(title=f"Step time (dots: per record; line: rolling median of {smooth})",
                ylabel="time per step (ms)")
    all_ms = np.concatenate([_column(r["batches"], "step_time_ms") for r in runs])
    all_ms = all_ms[np.isfinite(all_ms)]
    if all_ms.size:
        ax_time.set_ylim(0, 1.25 * float(np.percentile(all_ms, 98)))
    ax_loss.set(title="Training loss" + (" (epoch means)" if all(r["epochs"] for r in runs)
                                         else ""), ylabel="loss")
    losses = np.concatenate([_column(r["epochs"] or r["batches"], "loss") for r in runs])
    if losses[np.isfinite(losses)].size and np.nanmin(losses) > 0:
        ax_loss.set_yscale("log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("wall-clock time since training began (s)")
    fig.legend(*ax_bytes.get_legend_handles_labels(), loc="upper center",
               ncol=min(len(runs), 6), frameon=False, fontsize="large")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `python -m tf_gradsync.report RUN.jsonl [...] --out report.png`.

    Args:
      argv: arguments without the program name (None: `sys.argv[1:]`).

    Returns:
      The exit status: 0, or 2 for files it cannot read or a figure it cannot write
      (with a message; the summary is printed before the figure is drawn).
    """
    parser = argparse.ArgumentParser(prog="python -m tf_gradsync.report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="monitor JSON-lines files")
    parser.add_argument("--out", default="report.png", help="figure to write (default: %(default)s)")
    parser.add_argument("--smooth", type=int, default=25,
                        help="rolling-median window for step times (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be a window of 1 or more steps, got {args.smooth}")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"--out={args.out}: folder {folder!r} does not exist")
    if os.path.isdir(args.out):
        parser.error(f"--out={args.out} is a folder; name a file (e.g. "
                     f"{os.path.join(args.out, 'report.png')})")
    if not os.path.splitext(args.out)[1]:
        args.out += ".png"       # what matplotlib writes; said as written
    try:
        runs = [load_run(p) for p in args.runs]
    except (OSError, ValueError) as e:
        parser.exit(2, f"report: {e}\n")
    _disambiguate(runs, args.runs)
    print(format_table([summarise(r) for r in runs]), flush=True)
    try:
        plot(runs, args.out, args.smooth)
    except ValueError as e:        # matplotlib's, for a format it does not write
        parser.exit(2, f"report: --out={args.out}: {e}\n")
    print(f"figure: {args.out}")
    return 0


def _pyplot():
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError("tf_gradsync.report needs matplotlib to plot: "
                          "pip install 'tf_gradsync[report]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    return plt


def _column(records: Sequence[dict], key: str) -> np.ndarray:
    """Values of `key` as floats, NaN where missing or null."""
    return np.array([math.nan if r.get(key) is None else float(r[key]) for r in records])


def _rolling_median(x: np.ndarray, window: int) -> np.ndarray:
    out = np.full_like(x, math.nan)
    for i in range(len(x)):
        part = x[max(0, i - window + 1):i + 1]
        part = part[np.isfinite(part)]
        if part.size:
            out[i] = np.median(part)
    return out


def _bytes_unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("MiB", 2.0**20), ("KiB", 2.0**10)):
        if largest >= 2 * scale:
            return unit, scale
    return "bytes", 1.0


def _disambiguate(runs: list[dict], paths: Sequence[str]) -> None:
    names = [r["name"] for r in runs]
    for run, path in zip(runs, paths):
        if names.count(run["name"]) > 1:
            parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
            run["name"] = f"{parent}/{run['name']}"
    seen: dict[str, int] = {}
    for run in runs:                # the same file given twice
        seen[run["name"]] = seen.get(run["name"], 0) + 1
        if seen[run["name"]] > 1:
            run["name"] += f" ({seen[run['name']]})"


if __name__ == "__main__":
    sys.exit(main())
