"""`CommunicationMonitor`: a Keras callback for communication volume, step time and throughput."""

from __future__ import annotations

import csv
import importlib.util
import os
import time
import warnings

import tensorflow as tf

from tf_gradsync.callbacks import _common


class CommunicationMonitor(tf.keras.callbacks.Callback):
    """Adds communication and timing numbers to Keras logs and optionally writes them out.

    After every training batch and epoch the callback adds to `logs` (and so to the
    progress bar and to `History`):

    * `comm_bytes`: bytes each replica sent per step, from `ops.stats()` deltas since
      the previous batch end (traffic between batches, such as a `strategy.reduce` in
      another callback, counts towards the next batch).
    * `comm_bytes_dense`: what an uncompressed ring all-reduce would have sent.
    * `compression_ratio`: `comm_bytes_dense / comm_bytes`.
    * `comm_error`: the relative compression error ||x - C(x)|| / ||x|| of the latest
      gradient synchronisation, over its buckets and replicas (`ops.stats()`): what
      compression did to the gradients that were sent (0 for `none`); NaN in a batch
      whose gradient was not finite or that reduced nothing, and left out of the
      epoch's mean (Inf, a finite gradient's compression overflowing, is not).
    * `step_time_ms`: wall time per step between `on_train_batch_begin` and
      `on_train_batch_end`, divided by the steps the batch covered (more than one with
      `steps_per_execution > 1`). The first batch of training includes tracing and is
      left out of all timing.
    * `samples_per_sec`: global batch size x steps / wall time; only when the batch
      size is known: the `batch_size` argument, else `batch_size` in `self.params`,
      else `size` or `batch_size` in the batch logs (Keras 3 and tf_keras `fit` report
      none of these, so pass `batch_size`). A short final batch is counted as full.

    At epoch end the same keys hold the epoch's averages, plus `comm_bytes_total`
    (bytes sent per replica since this `fit` began) and `step_time_p50_ms`,
    `step_time_p90_ms` (percentiles of the epoch's per-step times). Timing keys are
    NaN for an epoch without timed batches.

    Files are opened in `on_train_begin` (overwriting; what a `fit` that raised left
    open is closed first) and closed in `on_train_end`, and only the chief writes
    them. Each row reaches its file as it is written, so a run that dies keeps them.
    CSV and JSON lines hold one row per batch (`kind` "batch") and per epoch (`kind`
    "epoch") with `step` (training steps since train begin), `epoch`, `wall_time_s`
    (since train begin), `loss`, `steps` (steps the row covers) and the numbers above;
    JSON lines also carry the other scalar Keras logs (accuracy, validation metrics),
    and write NaN as null. TensorBoard gets scalars
    `batch/<key>` (at the training step) and `epoch/<key>` (at the epoch).

    Works with Keras 3 and with tf_keras (`TF_USE_LEGACY_KERAS=1`): the base class is
    the `tf.keras.callbacks.Callback` selected when this module is imported.

    Args:
      ops_or_strategy: the `tf_gradsync.CompressedAllReduce` to read, or a strategy
        whose cross-device ops is one (its cluster resolver then decides who is chief;
        given ops, the model's strategy does).
      csv_path: CSV file to write, or None.
      tensorboard_dir: TensorBoard log directory, or None.
      jsonl_path: JSON-lines file to write (what `python -m tf_gradsync.report`
        reads), or None.
      batch_size: global batch size, for `samples_per_sec`.
      log_keys: which of the keys above go into Keras's `logs` (and so the progress bar
        and `History`); None: all. Files get every key regardless.

    Raises:
      ValueError: if `ops_or_strategy` is neither a `CompressedAllReduce` nor a
        strategy using one, a path is neither None nor a non-empty path, or
        `batch_size` is neither None nor a positive integer, or `log_keys` names an
        unknown key.
      ImportError: for a `tensorboard_dir` without the tensorboard package.

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("fp16")
      >>> strategy = tf.distribute.MirroredStrategy(cross_device_ops=ops)
      >>> monitor = CommunicationMonitor(ops, jsonl_path="fp16.jsonl", batch_size=64)
      >>> history = model.fit(x, y, batch_size=64, callbacks=[monitor])
      >>> history.history["comm_bytes"][-1]   # bytes per replica per step, last epoch
    """

    def __init__(self, ops_or_strategy, csv_path: str | None = None,
                 tensorboard_dir: str | None = None, jsonl_path: str | None = None,
                 batch_size: int | None = None, log_keys=None):
        super().__init__()
        who = "CommunicationMonitor"
        if isinstance(log_keys, str):
            raise ValueError(f"{who}: log_keys must be a list of key names, got the string "
                             f"{log_keys!r} (one: [{log_keys!r}])")
        if log_keys is not None:
            unknown = sorted(set(log_keys) - set(_common.EPOCH_KEYS))
            if unknown:
                raise ValueError(f"{who}: unknown log_keys {unknown}; valid keys: "
                                 f"{', '.join(_common.EPOCH_KEYS)}")
        self.log_keys = set(_common.EPOCH_KEYS if log_keys is None else log_keys)
        self.ops, self.strategy = _common.resolve(ops_or_strategy, who)
        self.csv_path = _common.check_path("csv_path", csv_path, who)
        self.tensorboard_dir = _common.check_path("tensorboard_dir", tensorboard_dir, who,
                                                  folder=True)
        if tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(f"{who}: tensorboard_dir={tensorboard_dir!r} needs the tensorboard "
                              "package: pip install tensorboard")
        self.jsonl_path = _common.check_path("jsonl_path", jsonl_path, who)
        self.batch_size = _common.check_batch_size(batch_size, who)
        self.is_chief = True
        self._csv = self._csv_file = self._jsonl = self._writer = None

    # ------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        self._close()      # Keras calls no on_train_end after a fit that raised
        self._meter = _common.Meter(self.ops)
        self._t0 = time.perf_counter()
        self._warm = False
        self._epoch, self._records = 0, []
        self._idle = False        # warned of an epoch that sent nothing
        strategy = self.strategy or getattr(self.model, "distribute_strategy", None)
        self.is_chief = _common.is_chief(strategy)
        if not self.is_chief:
            return
        if self.csv_path:
            # Line-buffered: every row is in the file as soon as it is written.
            self._csv_file = open(_parent_made(self.csv_path), "w", buffering=1, newline="",
                                  encoding="utf-8")
            self._csv = csv.DictWriter(self._csv_file, _common.FIELDS, extrasaction="ignore")
            self._csv.writeheader()
        if self.jsonl_path:
            self._jsonl = open(_parent_made(self.jsonl_path), "w", buffering=1, encoding="utf-8")
        if self.tensorboard_dir:
            self._writer = tf.summary.create_file_writer(self.tensorboard_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._records = epoch, []
        self._epoch_steps = self.ops.stats()["steps"]

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin, self._t_batch = batch, time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._t_batch
        logs = {} if logs is None else logs
        rec = self._meter.measure(elapsed if self._warm else None,
                                  batch - self._batch_begin + 1, self._known_batch_size(logs))
        self._warm = True
        self._records.append(rec)
        # A NaN (a batch without an error) stays out of the logs: tf_keras' progress bar
        # averages what it is given and would show NaN for the rest of the epoch.
        logs.update({k: rec[k] for k in _common.BATCH_KEYS
                     if rec[k] is not None and rec[k] == rec[k] and k in self.log_keys})
        self._write("batch", rec, logs)

    def on_epoch_end(self, epoch, logs=None):
        logs = {} if logs is None else logs
        if self._records and self.ops.stats()["steps"] == self._epoch_steps and not self._idle:
            # Zeros in every column would read as perfect compression.
            self._idle = True
            warnings.warn(f"CommunicationMonitor: no gradients went through {self.ops!r} in "
                          "this epoch: a strategy of one device never calls its cross-device "
                          "ops, so nothing is compressed or counted (split a CPU with "
                          "tf_gradsync.logical_cpus(N), or train on several devices)",
                          stacklevel=2)
        rec = _common.summarise(self._records, self._meter.total_sent())
        known = self._records and self._records[-1]["samples_per_sec"] is not None
        logs.update({k: rec[k] for k in _common.EPOCH_KEYS
                     if (k != "samples_per_sec" or known) and k in self.log_keys})
        rec["step"] = self._meter.step
        self._write("epoch", rec, logs)

    def on_train_end(self, logs=None):
        self._close()

    def _close(self) -> None:
        for f in (self._csv_file, self._jsonl, self._writer):
            if f:
                f.close()
        self._csv = self._csv_file = self._jsonl = self._writer = None

    # ------------------------------------------------------------ helpers
    def _known_batch_size(self, logs):
        for size in (self.batch_size, (self.params or {}).get("batch_size"),
                     logs.get("size"), logs.get("batch_size")):
            if size:
                return int(size)
        return None

    def _write(self, kind: str, rec: dict, logs: dict) -> None:
        if not (self._csv or self._jsonl or self._writer):
            return
        row = {k: v for k, v in logs.items() if _common.scalar(v) is not None}
        row.update(rec, kind=kind, epoch=self._epoch, loss=_common.scalar(logs.get("loss")),
                   wall_time_s=time.perf_counter() - self._t0)
        if self._csv:
            self._csv.writerow(row)
        if self._jsonl:
            self._jsonl.write(_common.json_line(row) + "\n")
        if self._writer:
            with self._writer.as_default():
                step = rec["step"] if kind == "batch" else self._epoch
                keys = _common.BATCH_KEYS if kind == "batch" else _common.EPOCH_KEYS
                for key in ("loss",) + keys:
                    value = _common.scalar(row.get(key))
                    if value is not None:
                        tf.summary.scalar(f"{kind}/{key}", value, step=step)


def _parent_made(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return path
