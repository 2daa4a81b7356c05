"""When bucket exchanges run: a tf.profiler trace of training steps, read op by op.

The model and step are `single_host`'s (Dense layers, MirroredStrategy on logical CPU
devices, 2 by default: one per core of a 2-core host, so the replicas compute side by
side as GPUs would; a custom step in a tf.function). For each mode (a compressor spec,
`none:bucket_bytes=4194304` for instance) the suite traces a few steps with
`tf.profiler.experimental`, reads the XPlane the profiler writes and sorts every
executed op of a step into forward, backward (ops GradientTape emitted), the exchange
of each bucket (the pipeline's `gradsync/bucket_<i>` scopes, packing included) and
the optimizer update. Per step it reports when backpropagation ends, when the first
exchange starts, how long some exchange op was running (the union over threads), and
how much of that ran before backpropagation ended: the exchange time hidden behind
it. Buckets are planned from the last layer back, so with several buckets the last
layers' exchange can start while the first layers' gradients are still being
computed; one bucket waits for every gradient.

`--png` draws the hidden share per mode; `--timeline_png` draws one step of each mode
as a timeline (the step of median length).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import flags

import tf_gradsync as gs
from tf_gradsync import _tf_compat
from tf_gradsync.bench import ops_from_spec, single_host
from tf_gradsync.pipeline import SCOPE

flags.DEFINE_integer("timeline_steps", 5, "timeline: profiled steps per mode.", lower_bound=1)
flags.DEFINE_integer("timeline_replicas", 2, "timeline: logical CPU devices (replicas); one per "
                     "core runs them side by side, as GPUs do.", lower_bound=1)
flags.DEFINE_string("timeline_png", None, "timeline: draw one step of each mode to this PNG.")
FLAGS = flags.FLAGS

COLUMNS = ["mode", "buckets", "step_ms", "backprop_end_ms", "first_exchange_ms",
           "exchange_ms", "hidden_ms", "hidden_share"]
PLOT = ("mode", "hidden_share", "share of exchange time before backprop ends")

_BUCKET = re.compile(rf"{SCOPE}/bucket_(\d+)/")


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One executed op: start and end in seconds from its step's start, and its kind
    ("forward", "backward", "update" or "bucket <i>")."""
    start: float
    end: float
    kind: str
    name: str


def kind_of(name: str) -> str | None:
    """The kind of a traced op from its name, None for what is not a TensorFlow op."""
    if "::" in name or ":" not in name or name.startswith("Eager"):   # runtime bookkeeping
        return None
    m = _BUCKET.search(name)
    if m:
        return f"bucket {m.group(1)}"
    if f"{SCOPE}/" in name:                  # packing of all buckets, unpacking
        return "pack/unpack"
    if name.startswith("gradient_tape/"):
        return "backward"
    op_name = name.split(":", 1)[0]
    if re.search(r"(^|/)(sgd|adam|update)[^/]*/", op_name, re.IGNORECASE):
        return "update"
    return "forward"


def read_steps(logdir: str, step_name: str = "step") -> list[list[Op]]:
    """The ops of every call of the tf.function `step_name` in a profiler log.

    Args:
      logdir: the directory given to `tf.profiler.experimental.start`.
      step_name: the traced Python function's name (its calls delimit the steps).

    Returns:
      Per step, in order, its ops with times relative to the step's start.

    Raises:
      FileNotFoundError: if the directory holds no XPlane file.
    """
    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir!r}")
    space = _tf_compat.xspace(files[-1])
    calls, ops = [], []
    for plane in space.planes:
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for e in line.events:
                name = names.get(e.metadata_id, "")
                t0, t1 = (base + e.offset_ps) * 1e-12, (base + e.offset_ps + e.duration_ps) * 1e-12
                if name == step_name:
                    calls.append((t0, t1))
                elif (kind := kind_of(name)) is not None:
                    ops.append((t0, t1, kind, name))
    steps = []
    for t0, t1 in sorted(calls):
        steps.append(sorted(Op(a - t0, b - t0, k, n) for a, b, k, n in ops if t0 <= a < t1))
    return steps


def union_length(intervals: Sequence[tuple[float, float]], until: float = np.inf) -> float:
    """Length of the union of `[start, end)` intervals, counted before `until`."""
    total, reach = 0.0, -np.inf
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, until)
        if b > a:
            total += b - a
        reach = max(reach, b)
    return total


def summarize(ops: Sequence[Op]) -> dict:
    """One step's numbers (seconds): `step`, `backprop_end`, `first_exchange`,
    `exchange` (time some exchange op ran), `hidden` (of it, before backprop ended)."""
    back = [o.end for o in ops if o.kind == "backward"]
    exch = [(o.start, o.end) for o in ops if o.kind.startswith("bucket")]
    end = max(back) if back else 0.0
    return {"step": max(o.end for o in ops) if ops else 0.0, "backprop_end": end,
            "first_exchange": min(a for a, _ in exch) if exch else None,
            "exchange": union_length(exch), "hidden": union_length(exch, until=end)}


def profile(spec: str, devices: Sequence[str], steps: int, width: int, layers: int,
            global_batch: int) -> tuple[list[list[Op]], int]:
    """Traces `steps` steps of one mode; returns their ops and the number of buckets."""
    ops = ops_from_spec(spec)
    strategy = tf.distribute.MirroredStrategy(list(devices), cross_device_ops=ops)
    run, _ = single_host.make_step(strategy, width, layers, global_batch)
    for _ in range(3):          # trace, then settle allocations
        run()
    logdir = tempfile.mkdtemp(prefix="gs_timeline_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                run()
        finally:
            tf.profiler.experimental.stop()
        traced = read_steps(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return traced, len(set(o.kind for s in traced for o in s if o.kind.startswith("bucket")))


def draw(steps: dict[str, list[Op]], path: str) -> str:
    """One timeline panel per mode: a row per kind of op, a line where backprop ends."""
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "update": "#55a868",
              "pack/unpack": "#8c8c8c"}
    fig = Figure(figsize=(10, 1.2 + 0.35 * sum(len({o.kind for o in s}) for s in steps.values())))
    heights = [len({o.kind for o in s}) + 1 for s in steps.values()]
    axes = fig.subplots(len(steps), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (mode, ops) in zip(axes, steps.items()):
        buckets = sorted({o.kind for o in ops if o.kind.startswith("bucket")},
                         key=lambda k: int(k.split()[1]))
        rows = ["forward", "backward", *buckets, "pack/unpack", "update"]
        rows = [r for r in rows if any(o.kind == r for o in ops)]
        for y, row in enumerate(rows):
            spans = [(1e3 * o.start, 1e3 * (o.end - o.start)) for o in ops if o.kind == row]
            ax.broken_barh(spans, (y - 0.4, 0.8), color=colors.get(row, "#c44e52"))
        s = summarize(ops)
        ax.axvline(1e3 * s["backprop_end"], color="k", lw=0.8, ls="--")
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{mode}: {1e3 * s['hidden']:.1f} of {1e3 * s['exchange']:.1f} ms of "
                     f"exchange before backprop ends (dashed)", fontsize=9)
    axes[-1].set_xlabel("ms from the start of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def run() -> tuple[list[dict], list[str]]:
    """The suite: --compressors (default `none` with 4 and 32 MiB buckets)."""
    devices = gs.logical_cpus(FLAGS.timeline_replicas)
    modes = FLAGS.compressors or [f"none:bucket_bytes={m * 2**20}" for m in (4, 32)]
    rows, shown = [], {}
    for mode in modes:
        print(f"[bench] timeline {mode}", file=sys.stderr, flush=True)
        steps, buckets = profile(mode, devices, FLAGS.timeline_steps, FLAGS.width,
                                 FLAGS.layers, FLAGS.global_batch)
        sums = [summarize(s) for s in steps]
        median = lambda key: float(np.median([s[key] for s in sums]))  # noqa: E731
        firsts = [s["first_exchange"] for s in sums if s["first_exchange"] is not None]
        exchange = median("exchange")
        shares = [s["hidden"] / s["exchange"] for s in sums if s["exchange"] > 0]
        rows.append({"mode": mode, "buckets": buckets, "step_ms": 1e3 * median("step"),
                     "backprop_end_ms": 1e3 * median("backprop_end"),
                     "first_exchange_ms": 1e3 * float(np.median(firsts)) if firsts else None,
                     "exchange_ms": 1e3 * exchange, "hidden_ms": 1e3 * median("hidden"),
                     "hidden_share": float(np.median(shares)) if shares else None})
        order = np.argsort([s["step"] for s in sums])
        shown[mode] = steps[int(order[len(order) // 2])]
    if FLAGS.timeline_png:
        draw(shown, FLAGS.timeline_png)
    return rows, COLUMNS
