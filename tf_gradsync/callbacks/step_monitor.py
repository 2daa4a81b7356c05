"""`StepMonitor`: the numbers of `CommunicationMonitor` for custom training loops."""

from __future__ import annotations

import contextlib
import os
import time

from tf_gradsync.callbacks import _common


class StepMonitor:
    """Records communication volume, step time and throughput around training steps.

    Each `with monitor.step(...)` block is one record: a dict with `kind` ("batch"),
    `step`, `epoch`, `wall_time_s` (since the monitor was created), `loss`, `steps`,
    `comm_bytes`, `comm_bytes_dense`, `compression_ratio`, `comm_error`, `step_time_ms`
    and `samples_per_sec`, with the same meaning as in `CommunicationMonitor`. The dict
    is yielded by the block (set `rec["loss"]` inside it, a tensor is fine), filled in when
    the block exits, appended to `records`, and written to `jsonl_path` if given. The
    first block's time includes tracing and is left out (`step_time_ms` is None).

    A block may cover several steps (e.g. a `tf.function` that loops): their count is
    taken from the ops' step counter. Wall time is measured around the block, so the
    step function must have finished when the block exits (eager calls of a
    `tf.function` do; reading a result with `.numpy()` makes sure).

    Args:
      ops_or_strategy: the `tf_gradsync.CompressedAllReduce` to read, or a strategy
        whose cross-device ops is one.
      jsonl_path: JSON-lines file to write (readable by `python -m tf_gradsync.report`),
        or None. Only the chief writes it.

    Raises:
      ValueError: if `ops_or_strategy` is neither a `CompressedAllReduce` nor a
        strategy using one, or `jsonl_path` is neither None nor a non-empty path.

    Example:
      >>> monitor = StepMonitor(ops, jsonl_path="run.jsonl")
      >>> for epoch in range(epochs):
      ...     for batch in dist_dataset:
      ...         with monitor.step(batch_size=64) as rec:
      ...             rec["loss"] = train_step(batch)   # runs strategy.run(...)
      ...     print(monitor.end_epoch())                # epoch summary, also written
      >>> monitor.close()
      >>> monitor.records[-1]["comm_bytes"]             # bytes per replica per step
    """

    def __init__(self, ops_or_strategy, jsonl_path: str | None = None):
        self.ops, strategy = _common.resolve(ops_or_strategy, "StepMonitor")
        self.jsonl_path = _common.check_path("jsonl_path", jsonl_path, "StepMonitor")
        self.records: list[dict] = []
        self.epoch = 0
        self._epoch_records: list[dict] = []
        self._meter = _common.Meter(self.ops)
        self._t0 = time.perf_counter()
        self._jsonl = None
        if jsonl_path and _common.is_chief(strategy):
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "w", encoding="utf-8")

    @contextlib.contextmanager
    def step(self, batch_size: int | None = None):
        """Measures one block of training steps.

        Args:
          batch_size: global batch size, for `samples_per_sec` (None leaves it out).

        Yields:
          The record dict, filled in when the block exits.

        Raises:
          ValueError: if `batch_size` is neither None nor a positive integer.
        """
        _common.check_batch_size(batch_size, "StepMonitor.step")
        rec: dict = {}
        t = time.perf_counter()
        yield rec
        elapsed = time.perf_counter() - t
        rec.update(self._meter.measure(elapsed if self.records else None, 1, batch_size),
                   kind="batch", epoch=self.epoch, loss=_common.scalar(rec.get("loss")),
                   wall_time_s=time.perf_counter() - self._t0)
        self.records.append(rec)
        self._epoch_records.append(rec)
        self._write(rec)

    def end_epoch(self) -> dict:
        """Closes the current epoch.

        Returns:
          The epoch record (`kind` "epoch"): averages over the epoch's blocks plus
          `comm_bytes_total`, `step_time_p50_ms` and `step_time_p90_ms`; `loss` is the
          last block's.
        """
        rec = _common.summarise(self._epoch_records, self._meter.total_sent())
        loss = self._epoch_records[-1].get("loss") if self._epoch_records else None
        rec.update(kind="epoch", step=self._meter.step, epoch=self.epoch, loss=loss,
                   wall_time_s=time.perf_counter() - self._t0)
        self._write(rec)
        self.epoch += 1
        self._epoch_records = []
        return rec

    def close(self) -> None:
        """Closes the JSON-lines file."""
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, rec: dict) -> None:
        if self._jsonl:
            self._jsonl.write(_common.json_line(rec) + "\n")
            self._jsonl.flush()
