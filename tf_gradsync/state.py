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
  become their initial values. Values that no variable takes once a bucket plan's
  variables all exist are named in a warning (`SyncState.seal`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import tensorflow as tf
from absl import logging

from tf_gradsync import _tf_compat


class _Pending:
    """Loaded values waiting for their variables, and each variable's initial value. A
    plain holder, so tf.Module does not track (and checkpoint) them."""

    def __init__(self):
        self.values: dict[str, np.ndarray] = {}
        self.initial: dict[str, Callable[[], tf.Tensor]] = {}
        self.sealed: set[str] = set()      # key prefixes whose variables all exist
        self.named: set[str] = set()       # keys a warning named as of another plan
        self.restored: set[str] = set()    # keys of variables made with a loaded value


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
          The variable: with the value loaded for `key`, unless that has another shape
          (another configuration of the compressor: PowerSGD's rank, say), which a
          warning names.
        """
        if key not in self._variables:
            # Created and inserted in the eager context: a deferred tf.train.Checkpoint
            # restore runs on insertion and must not become part of a traced step.
            with tf.init_scope():
                var = _tf_compat.plain_variable(initial_value, name=key, device=device)
                if key in self._pending.values:
                    _assign(var, key, self._pending.values.pop(key))
                    self._pending.restored.add(key)
                # TensorFlow restores on insertion, and skips a value of another shape
                # without a word.
                for shape in _tf_compat.deferred_shapes(self._variables, key):
                    if shape is not None and tuple(shape) != tuple(var.shape):
                        _warn_shape(key, shape, var.shape)
                    else:
                        self._pending.restored.add(key)
                self._variables[key] = var
                self._pending.initial[key] = initial_value
        return self._variables[key]

    def reset(self, prefix: str) -> None:
        """Puts every variable whose key starts with `prefix` back at its initial value
        (state handed to a new owner), eagerly, even while a function is traced, and
        drops loaded values under it that wait for a variable."""
        with tf.init_scope():
            for key, var in self._variables.items():
                if key.startswith(prefix):
                    with tf.device(var.device):     # built where it lives, not copied
                        var.assign(self._pending.initial[key]())
        for key in [k for k in self._pending.values if k.startswith(prefix)]:
            del self._pending.values[key]

    def get(self, key: str) -> tf.Variable | None:
        """The variable `key`, or None before it is created."""
        return self._variables.get(key)

    def __len__(self) -> int:
        return len(self._variables)

    def values(self) -> dict[str, np.ndarray]:
        """Current values of every variable (and of loaded values not yet used)."""
        out = dict(self._pending.values)
        out.update({k: v.numpy() for k, v in self._variables.items()})
        return out

    def seal(self, prefix: str) -> None:
        """Declares every variable whose key starts with `prefix` created (a bucket
        plan's state, once traced). Loaded values under it that no variable took (now,
        or from a Keras weight file loaded later) are state of another version or
        configuration of the ops: they restore nothing, and a warning names them; those
        of Keras weight files are kept and saved again."""
        waiting = self.waiting()
        if prefix not in self._pending.sealed:
            self._pending.sealed.add(prefix)
            _warn_unclaimed([k for k in waiting if k.startswith(prefix)])
        # The rest waits for a plan of its own: another compressor's, or of other tensors
        # or another bucket_bytes (keys hold both). A step over those may still come (a
        # second model); if none does, their state is lost, so say so once.
        others = sorted(k for k in waiting if k not in self._pending.named
                        and not any(k.startswith(p) for p in self._pending.sealed))
        if others:
            self._pending.named.update(others)
            names = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
            if any(k.startswith(prefix) for k in self._pending.restored):
                # This plan resumed: most likely a second model's state, whose step
                # comes next (a GAN's discriminator, a twin of one shape).
                logging.info(
                    "tf_gradsync: %d loaded state values wait for a step over other tensors "
                    "(%s): a second model's reduction takes them; without one they restore "
                    "nothing.", len(others), names)
            else:
                logging.warning(
                    "tf_gradsync: %d loaded state values are of another compressor or bucket "
                    "plan than the step just built (%s): unless a step over those tensors "
                    "with that compressor and bucket_bytes follows, they restore nothing, and "
                    "the state of this one (error feedback, momentum, warm starts) starts from "
                    "its initial values.", len(others), names)

    def waiting(self) -> set[str]:
        """Keys of loaded values no variable has taken yet: loaded from Keras 3 weight
        files (`assign`), or restored by `tf.train.Checkpoint`, which holds them until a
        variable of their name joins the tracked dict."""
        return set(self._pending.values) | set(_tf_compat.deferred_restores(self._variables))

    def assign(self, values: Mapping[str, np.ndarray]) -> None:
        """Assigns loaded values: now to existing variables, at creation to the others."""
        unclaimed = []
        for key, value in values.items():
            value = np.asarray(value)
            if key in self._variables:
                _assign(self._variables[key], key, value)
            else:
                self._pending.values[key] = value
                if any(key.startswith(p) for p in self._pending.sealed):
                    unclaimed.append(key)
        _warn_unclaimed(unclaimed)


def _warn_unclaimed(keys: list[str]) -> None:
    if keys:
        keys = sorted(keys)
        logging.warning(
            "tf_gradsync: %d loaded state values match no variable and are not restored "
            "(%s%s): they come from another version or configuration of the compressor, "
            "or from replicas this run does not have, and the state they held (error "
            "feedback, momentum, warm starts) starts from its initial values.", len(keys),
            ", ".join(keys[:4]), ", ..." if len(keys) > 4 else "")


def _assign(var: tf.Variable, key: str, value: np.ndarray) -> None:
    """Assigns a loaded value of the variable's shape; warns of one of another shape,
    written by another configuration of the compressor, and leaves the variable."""
    if tuple(value.shape) != tuple(var.shape):
        _warn_shape(key, value.shape, var.shape)
        return
    var.assign(value.astype(var.dtype.as_numpy_dtype))


def _warn_shape(key: str, loaded, shape) -> None:
    logging.warning(
        "tf_gradsync: the loaded value for %s has shape %s, the variable %s: it is of "
        "another configuration of the compressor (a rank or block size changed, say), "
        "is not restored, and that state starts from its initial values.", key,
        tuple(loaded), tuple(shape))
