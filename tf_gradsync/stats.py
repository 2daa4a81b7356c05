"""Byte and step counters that live in tf.Variables and are updated inside the graph."""

from __future__ import annotations

import tensorflow as tf

from tf_gradsync import _tf_compat


class Stats(tf.Module):
    """Communication counters of one `CompressedAllReduce`.

    Counts are per replica: the bytes one replica sends, averaged over the replicas of
    a reduction. They are updated by graph ops at run time, so compressors whose
    payload size varies per step are counted as they run. Being variables on a
    `tf.Module`, they are saved and restored with the ops object.
    """

    _FIELDS = ("bytes_sent", "bytes_dense", "steps", "last_bytes_sent", "last_bytes_dense")

    def __init__(self):
        super().__init__(name="gradsync_stats")
        self._created = False

    def _ensure(self) -> None:
        # Created on first use, not in __init__: creating a variable initialises the
        # TensorFlow runtime, after which a multi-worker strategy can no longer
        # configure its collectives.
        if not self._created:
            for field in self._FIELDS:
                setattr(self, field, _tf_compat.plain_variable(
                    lambda: tf.constant(0, tf.int64), name=field))
            self._created = True

    def step_counter(self) -> tf.Tensor:
        """Synchronisations completed so far (read before this step's increment)."""
        self._ensure()
        return self.steps.read_value()

    def record(self, sent: tf.Tensor, dense: tf.Tensor, count_step: bool) -> None:
        """Adds one reduction's per-replica bytes (int64 scalars)."""
        self._ensure()
        self.bytes_sent.assign_add(sent)
        self.bytes_dense.assign_add(dense)
        if count_step:
            self.steps.assign_add(1)
            self.last_bytes_sent.assign(sent)
            self.last_bytes_dense.assign(dense)

    def reset(self) -> None:
        self._ensure()
        for field in self._FIELDS:
            getattr(self, field).assign(0)

    def as_dict(self) -> dict[str, float]:
        """Current values as Python numbers, plus the derived compression ratio.

        Returns:
          `bytes_sent` and `bytes_dense` (cumulative bytes per replica, sent and what
          an uncompressed ring all-reduce would send), `steps`, `last_bytes_sent`,
          `last_bytes_dense` (of the latest gradient synchronisation),
          `bytes_sent_per_step`, and `compression_ratio` (dense / sent; 1.0 before any
          traffic).
        """
        self._ensure()
        out = {f: int(getattr(self, f).numpy()) for f in self._FIELDS}
        out["compression_ratio"] = (out["bytes_dense"] / out["bytes_sent"]
                                    if out["bytes_sent"] else 1.0)
        out["bytes_sent_per_step"] = out["bytes_sent"] / out["steps"] if out["steps"] else 0.0
        return out
