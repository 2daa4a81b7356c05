"""Byte and step counters that live in tf.Variables and are updated inside the graph."""

from __future__ import annotations

import math

import tensorflow as tf

from tf_gradsync.state import SyncState


class Stats:
    """Communication counters of one `CompressedAllReduce`.

    Counts are per replica: the bytes one replica sends, averaged over the replicas of
    a reduction. They are updated by graph ops at run time, so compressors whose
    payload size varies per step are counted as they run. They live in the ops'
    `SyncState`, so checkpoints carry them with the compressor state.
    """

    _FIELDS = ("bytes_sent", "bytes_dense", "steps", "last_bytes_sent", "last_bytes_dense")
    #: Float fields: the last step's squared compression error and input norm.
    _ERROR_FIELDS = ("last_error_sq", "last_norm_sq")

    def __init__(self, state: SyncState | None = None):
        self._store = state if state is not None else SyncState()
        self._vars: dict[str, tf.Variable] = {}

    def _ensure(self) -> None:
        # Created on first use, not in __init__: creating a variable initialises the
        # TensorFlow runtime, after which a multi-worker strategy can no longer
        # configure its collectives. The step counter seeds per-step random choices,
        # so it is checkpointed with the rest of the state.
        if not self._vars:
            self._vars = {f: self._store.variable(f"stats_{f}", lambda: tf.constant(0, tf.int64))
                          for f in self._FIELDS}
            self._vars.update({
                f: self._store.variable(f"stats_{f}", lambda: tf.constant(0.0, tf.float64))
                for f in self._ERROR_FIELDS})
            # The step counter at the last `reset`: what `steps` reports counts from it.
            self._vars["steps_base"] = self._store.variable(
                "stats_steps_base", lambda: tf.constant(0, tf.int64))

    def step_counter(self) -> tf.Tensor:
        """Synchronisations completed so far (read before this step's increment)."""
        self._ensure()
        return self._vars["steps"].read_value()

    def record(self, sent: tf.Tensor, dense: tf.Tensor, count_step: bool,
               errors=(), part_of_step: bool = False) -> None:
        """Adds one reduction's per-replica bytes (int64 scalars).

        Args:
          sent: bytes sent per replica.
          dense: what an uncompressed ring all-reduce would have sent per replica.
          count_step: this reduction synchronised gradients (a step).
          errors: `(error_sq, norm_sq)` float64 scalars of the compressed buckets
            (||x - C(x)||^2 and ||x||^2 summed over local replicas).
          part_of_step: these bytes belong to the step recorded just before (added to
            its `last_bytes_*` too).
        """
        if count_step and part_of_step:
            raise ValueError("a reduction either counts a step or adds to the last one")
        self._ensure()
        v = self._vars
        v["bytes_sent"].assign_add(sent)
        v["bytes_dense"].assign_add(dense)
        if part_of_step:
            v["last_bytes_sent"].assign_add(sent)
            v["last_bytes_dense"].assign_add(dense)
        if count_step:
            v["steps"].assign_add(1)
            v["last_bytes_sent"].assign(sent)
            v["last_bytes_dense"].assign(dense)
            if errors:
                v["last_error_sq"].assign(tf.add_n([e for e, _ in errors]))
                v["last_norm_sq"].assign(tf.add_n([s for _, s in errors]))

    def start_at(self, step: int) -> None:
        """Sets the step counter to `step` (it seeds per-step random choices and ends
        compressors' warm-up), as if that many synchronisations had happened, and the
        reported `steps` with it."""
        self._ensure()
        self._vars["steps"].assign(step)
        self._vars["steps_base"].assign(0)

    def reset(self) -> None:
        """Zeroes the counters as reported. The step counter itself runs on, since it
        drives the compressors' schedules (warm-ups, per-step random choices): the
        reported `steps` count from here."""
        self._ensure()
        for field in self._FIELDS + self._ERROR_FIELDS:
            if field != "steps":
                self._vars[field].assign(tf.zeros_like(self._vars[field]))
        self._vars["steps_base"].assign(self._vars["steps"])

    def as_dict(self) -> dict[str, float]:
        """Current values as Python numbers, plus the derived compression ratio.

        Returns:
          `bytes_sent` and `bytes_dense` (cumulative bytes per replica, sent and what
          an uncompressed ring all-reduce would send), `steps`, `last_bytes_sent`,
          `last_bytes_dense` (of the latest gradient synchronisation),
          `bytes_sent_per_step`, `compression_ratio` (dense / sent; 1.0 before any
          traffic), and `comm_error`: the latest step's relative compression error
          ||x - C(x)|| / ||x|| over its buckets and local replicas, x what each replica
          compressed (its gradient, plus its residual under error feedback) and C(x)
          what its payload decodes to (0.0 before any step, and when not measured; NaN
          when a gradient of that step was not finite, Inf when a finite one's
          compression overflowed).
        """
        self._ensure()
        out = {f: int(self._vars[f].numpy()) for f in self._FIELDS}
        base = int(self._vars["steps_base"].numpy())
        # A counter restored from before the reset (an older checkpoint) counts whole.
        out["steps"] -= base if out["steps"] >= base else 0
        err, norm = (float(self._vars[f].numpy()) for f in self._ERROR_FIELDS)
        if not math.isfinite(norm):
            out["comm_error"] = math.nan      # a non-finite gradient: no error to tell
        else:      # Inf where a finite gradient's compression overflowed (fp16 past 65504)
            out["comm_error"] = (err / norm) ** 0.5 if norm > 0 else 0.0
        out["compression_ratio"] = (out["bytes_dense"] / out["bytes_sent"]
                                    if out["bytes_sent"] else 1.0)
        out["bytes_sent_per_step"] = out["bytes_sent"] / out["steps"] if out["steps"] else 0.0
        return out
