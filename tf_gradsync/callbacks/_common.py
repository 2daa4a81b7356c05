"""Pieces shared by `CommunicationMonitor` and `StepMonitor`."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import tensorflow as tf

from tf_gradsync.cross_device_ops import CompressedAllReduce

#: The numbers of a batch's record; an epoch's adds its totals and percentiles.
BATCH_KEYS = ("comm_bytes", "comm_bytes_dense", "compression_ratio", "comm_error",
              "step_time_ms", "samples_per_sec")
EPOCH_KEYS = BATCH_KEYS + ("comm_bytes_total", "step_time_p50_ms", "step_time_p90_ms")
#: Columns of a record, in CSV order. JSON lines may carry extra scalar Keras metrics.
FIELDS = ("kind", "step", "epoch", "wall_time_s", "loss", "steps") + EPOCH_KEYS


def resolve(ops_or_strategy, who: str):
    """Returns `(ops, strategy or None)` for a `CompressedAllReduce` or a strategy using one."""
    if isinstance(ops_or_strategy, CompressedAllReduce):
        return ops_or_strategy, None
    extended = getattr(ops_or_strategy, "extended", None)
    ops = getattr(extended, "_cross_device_ops", None)
    if isinstance(ops, CompressedAllReduce):
        return ops, ops_or_strategy
    if extended is not None:
        raise ValueError(f"{who} needs a strategy whose cross_device_ops is a "
                         f"tf_gradsync.CompressedAllReduce; {ops_or_strategy!r} uses {ops!r}")
    raise ValueError(f"{who} needs a tf_gradsync.CompressedAllReduce or a tf.distribute "
                     f"strategy using one; got {ops_or_strategy!r}")


def check_batch_size(value, who: str) -> int | None:
    """Returns `value` if it is None or a positive integer; raises ValueError otherwise."""
    if value is None or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                         and value > 0):
        return value
    raise ValueError(f"{who}: batch_size must be a positive integer or None, got {value!r}")


def check_path(name: str, value, who: str, folder: bool = False):
    """Returns `value` if it is None or a non-empty path (of a file unless `folder`: not
    an existing folder); raises ValueError otherwise."""
    if (not folder and isinstance(value, (str, os.PathLike)) and os.fspath(value)
            and os.path.isdir(value)):
        raise ValueError(f"{who}: {name}={os.fspath(value)!r} is a folder; give a file path")
    if value is None or (isinstance(value, (str, os.PathLike)) and os.fspath(value)):
        return value
    raise ValueError(f"{who}: {name} must be a non-empty path (str or os.PathLike) or None, "
                     f"got {value!r}")


def is_chief(strategy) -> bool:
    """Whether this task should write logs for `strategy`.

    The chief is the task of type None or "chief", or worker 0 when the cluster has no
    chief. Strategies without a cluster resolver (MirroredStrategy, the default
    strategy, None) run in one process, which is the chief.
    """
    if strategy is None or isinstance(strategy, tf.distribute.MirroredStrategy):
        return True
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    if task_type == "worker" and (task_id or 0) == 0:
        return "chief" not in resolver.cluster_spec().as_dict()
    return False


class Meter:
    """Turns `ops.stats()` deltas and wall time into per-step numbers."""

    def __init__(self, ops: CompressedAllReduce):
        self._ops = ops
        self.start()

    def start(self) -> None:
        self._base = self._last = self._ops.stats()
        self.step = 0

    def measure(self, elapsed_s: float | None, fallback_steps: int = 1,
                batch_size: int | None = None) -> dict:
        """Numbers since the previous call; `elapsed_s` None leaves the timing out."""
        now, last = self._ops.stats(), self._last
        self._last = now
        steps = now["steps"] - last["steps"]
        sent = now["bytes_sent"] - last["bytes_sent"]
        dense = now["bytes_dense"] - last["bytes_dense"]
        n = steps or max(int(fallback_steps), 1)
        self.step += n
        rec = {"step": self.step, "steps": n, "comm_bytes": sent / n,
               "comm_bytes_dense": dense / n,
               "compression_ratio": dense / sent if sent else 1.0,
               # Of the latest synchronisation (the only one with steps_per_execution 1);
               # none in batches that reduced nothing (e.g. Keras 3 skipping a step whose
               # loss-scaled gradient overflowed, before any all-reduce).
               "comm_error": now["comm_error"] if steps else math.nan,
               "step_time_ms": None, "samples_per_sec": None}
        if elapsed_s is not None and elapsed_s > 0:
            rec["step_time_ms"] = 1000.0 * elapsed_s / n
            if batch_size:
                rec["samples_per_sec"] = batch_size * n / elapsed_s
        return rec

    def total_sent(self) -> int:
        """Bytes sent per replica since `start()` (as of the latest `measure`)."""
        return self._last["bytes_sent"] - self._base["bytes_sent"]


def summarise(records: list[dict], total_sent: int) -> dict:
    """Aggregates per-batch records into one epoch (or run) record."""
    steps = sum(r["steps"] for r in records)
    sent = sum(r["comm_bytes"] * r["steps"] for r in records)
    dense = sum(r["comm_bytes_dense"] * r["steps"] for r in records)
    timed = [r for r in records if r["step_time_ms"] is not None]
    time_s = sum(r["step_time_ms"] * r["steps"] for r in timed) / 1000.0
    timed_steps = sum(r["steps"] for r in timed)
    rates = [(r["samples_per_sec"], r["step_time_ms"] * r["steps"] / 1000.0)
             for r in timed if r["samples_per_sec"] is not None]
    rate_s = sum(t for _, t in rates)
    per_step = [r["step_time_ms"] for r in timed]
    # Steps without an error (a non-finite gradient, nothing reduced: NaN) tell nothing
    # of the compressor's: averaged, they would hide it (NaN) or halve it (0). An
    # overflow of the compression itself (Inf) is its error, and shows.
    measured = [r for r in records if not math.isnan(r["comm_error"])]
    measured_steps = sum(r["steps"] for r in measured)
    nan = float("nan")
    return {
        "steps": steps,
        "comm_bytes": sent / steps if steps else 0.0,
        "comm_bytes_dense": dense / steps if steps else 0.0,
        "compression_ratio": dense / sent if sent else 1.0,
        "comm_error": (sum(r["comm_error"] * r["steps"] for r in measured) / measured_steps
                       if measured_steps else nan),
        "step_time_ms": 1000.0 * time_s / timed_steps if timed_steps else nan,
        "samples_per_sec": sum(v * t for v, t in rates) / rate_s if rate_s else nan,
        "comm_bytes_total": total_sent,
        "step_time_p50_ms": float(np.percentile(per_step, 50)) if per_step else nan,
        "step_time_p90_ms": float(np.percentile(per_step, 90)) if per_step else nan,
    }


def scalar(value):
    """A Python float/int for a scalar log value, None for anything else or non-finite."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def json_line(record: dict) -> str:
    """One JSON line; NaN and infinities become null."""
    out = {}
    ordered = [k for k in FIELDS if k in record] + [k for k in record if k not in FIELDS]
    for key, value in ((k, record[k]) for k in ordered):
        out[key] = value if value is None or isinstance(value, str) else scalar(value)
    return json.dumps(out, allow_nan=False)
