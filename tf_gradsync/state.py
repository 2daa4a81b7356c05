"""Every variable of one `CompressedAllReduce`, by stable name, in one checkpointable place.

Compressor state (error-feedback residuals, PowerSGD's Q, DGC momentum, adaptive ratios)
and the byte and step counters are created lazily, at the first trace of a step, because
their shapes come from the bucket plan. Names are stable across runs (compressor, plan
fingerprint, bucket, replica, field), so a checkpoint written by one run restores into
the next one, whichever way it is read:

* `tf.train.Checkpoint` (and `tf_keras` checkpoints): the variables live in a tracked
  dict; a restore issued before they exist is applied when they are created.
* Keras 3 weight files (`model.save_weights`, `BackupAndRestore`): see
  `tf_gradsync.track_state`; values loaded before the variables exist are kept and
  become their initial values.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import tensorflow as tf

from tf_gradsync import _tf_compat


class _Pending:
    """Loaded values waiting for their variables. A plain holder, so tf.Module does not
    track (and checkpoint) the numpy arrays."""

    def __init__(self):
        self.values: dict[str, np.ndarray] = {}


class SyncState(tf.Module):
    """Named variables of one set of cross-device ops.

    Example:
      >>> state = SyncState()
      >>> v = state.variable("steps", lambda: tf.constant(0, tf.int64))
      >>> state.values()
      {'steps': array(0)}
    """

    def __init__(self, name: str = "gradsync_state"):
        super().__init__(name=name)
        self._variables: dict[str, tf.Variable] = {}   # tracked: checkpointed
        self._pending = _Pending()

    def variable(self, key: str, initial_value: Callable[[], tf.Tensor],
                 device: str | None = None) -> tf.Variable:
        """The variable `key`, created on first use outside any function being traced.

        Args:
          key: stable name, identical across runs for the same role.
          initial_value: called once to build the initial value (unless a value for
            `key` was loaded earlier with `assign`).
          device: where the variable lives.

        Returns:
          The variable.

        Raises:
          ValueError: if a loaded value's shape does not match the new variable.
        """
        if key not in self._variables:
            # Created and inserted in the eager context: a deferred tf.train.Checkpoint
            # restore runs on insertion and must not become part of a traced step.
            with tf.init_scope():
                var = _tf_compat.plain_variable(initial_value, name=key, device=device)
                if key in self._pending.values:
                    _assign(var, key, self._pending.values.pop(key))
                self._variables[key] = var
        return self._variables[key]

    def __contains__(self, key: str) -> bool:
        return key in self._variables

    def __len__(self) -> int:
        return len(self._variables)

    def values(self) -> dict[str, np.ndarray]:
        """Current values of every variable (and of loaded values not yet used)."""
        out = dict(self._pending.values)
        out.update({k: v.numpy() for k, v in self._variables.items()})
        return out

    def assign(self, values: Mapping[str, np.ndarray]) -> None:
        """Assigns loaded values: now to existing variables, at creation to the others."""
        for key, value in values.items():
            value = np.asarray(value)
            if key in self._variables:
                _assign(self._variables[key], key, value)
            else:
                self._pending.values[key] = value


def _assign(var: tf.Variable, key: str, value: np.ndarray) -> None:
    """Assigns a loaded value, which must have the variable's shape."""
    if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"loaded value for {key!r} has shape {value.shape}, the variable "
                         f"has {tuple(var.shape)}")
    var.assign(value.astype(var.dtype.as_numpy_dtype))
