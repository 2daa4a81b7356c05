"""`track_state`: make compression state part of a Keras model's checkpoints."""

from __future__ import annotations

import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.cross_device_ops import CompressedAllReduce

#: The model attribute that holds the state.
ATTRIBUTE = "gradsync_state"


class _ModelState(tf.__internal__.tracking.AutoTrackable, _tf_compat.keras_saveable_base()):
    """Carries a `SyncState` inside a model: a tracked child for TensorFlow checkpoints,
    and a saveable with its own variables for Keras 3 weight files. No `tf.Module`:
    tf_keras counts a module's variables among the model's weights (`get_weights`,
    and `compile`'s check that each was made under the strategy)."""

    def __init__(self, ops: CompressedAllReduce):
        super().__init__()
        self.ops = ops

    def _obj_type(self) -> str:
        # Keras accepts only its own kinds here; the kind only selects which attributes
        # its walk skips, and this object has no Keras children to walk into.
        return "Loss"

    def save_own_variables(self, store) -> None:
        for key, value in sorted(self.ops._state.values().items()):  # pylint: disable=protected-access
            store[key] = value

    def load_own_variables(self, store) -> None:
        self.ops._state.assign({key: store[key] for key in store.keys()})  # pylint: disable=protected-access


def track_state(model, ops: CompressedAllReduce) -> None:
    """Saves and restores `ops`' state (error-feedback residuals, PowerSGD's Q, DGC
    momentum, adaptive ratios, step and byte counters) with `model`'s checkpoints.

    After this call `tf.train.Checkpoint(model=model)`, `model.save_weights` /
    `load_weights` (Keras 3 `.weights.h5`; tf_keras' TensorFlow format) and Keras
    `BackupAndRestore` carry the state. State restored before the first training step,
    when its variables do not exist yet, is applied when they are created, so a resumed
    run continues exactly where the saved one stopped. Custom loops can instead put the
    ops into their checkpoint directly: `tf.train.Checkpoint(model=..., gradsync=ops)`.

    In a multi-worker job every worker restores the chief's copy: state that is the same
    on every worker (step counter, PowerSGD's Q, adaptive decisions) resumes exactly;
    local state (residuals, DGC momentum) resumes with the chief's values. Loaded state
    that no variable takes (written by another version or configuration of the
    compressor, or under another `bucket_bytes`) restores nothing, and a warning names
    it (Keras weight files keep it and save it again); so does a loaded value of
    another shape (another PowerSGD rank, say), whose variable starts from its initial
    value. A tf_keras model loaded from the SavedModel of a tracked model (`model.save`)
    brings its state back: tracked again, it seeds `ops`' state.

    Args:
      model: a Keras 3 or tf_keras model.
      ops: the `CompressedAllReduce` its strategy synchronises gradients with.

    Raises:
      ValueError: if `ops` is not a `CompressedAllReduce`, or `model` already tracks
        other ops (or holds something else under `gradsync_state`).

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("topk")
      >>> with tf.distribute.MirroredStrategy(cross_device_ops=ops).scope():
      ...     model = make_model()
      >>> tf_gradsync.track_state(model, ops)
      >>> model.fit(x, y, callbacks=[tf.keras.callbacks.BackupAndRestore("/tmp/backup")])
    """
    if not isinstance(ops, CompressedAllReduce):
        raise ValueError(f"ops must be a tf_gradsync.CompressedAllReduce, got {ops!r}")
    current = getattr(model, ATTRIBUTE, None)
    if isinstance(current, _ModelState):
        if current.ops is ops:
            return
        raise ValueError(f"{model.name!r} already tracks the state of {current.ops!r}")
    if current is not None:
        # A model loaded from a SavedModel (tf_keras' `model.save`) holds the state it
        # was saved with as restored variables: they seed `ops`' state.
        ops._state.assign(_revived_values(model, current))  # pylint: disable=protected-access
    setattr(model, ATTRIBUTE, _ModelState(ops))


def _revived_values(model, revived) -> dict:
    """The state values held by `revived`, the `_ModelState` of a model loaded from a
    SavedModel."""
    variables = getattr(getattr(getattr(revived, "ops", None), "_state", None), "_variables", None)
    if not hasattr(variables, "items"):
        raise ValueError(f"{model.name!r} has an attribute {ATTRIBUTE!r} that is not "
                         f"tf_gradsync state: {revived!r}")
    return {key: var.numpy() for key, var in variables.items()}
