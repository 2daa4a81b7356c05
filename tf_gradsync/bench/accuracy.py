"""Accuracy and time-to-accuracy: scikit-learn's digits, trained under MirroredStrategy on
4 logical CPU devices with TensorFlow's cross-device ops and with each compressor.

Data, model and optimizer are those of `examples/train_digits.py` (the 17,226-parameter
MLP, Adam 1e-3, global batch 64, seed 0, no shuffling), so every mode starts from the
same weights and sees the same batches. "stock" is MirroredStrategy with its own
cross-device ops (on CPU devices, TensorFlow's CollectiveAllReduce). Test accuracy is measured after every epoch;
time-to-accuracy is the training wall time (test passes excluded, the first epoch's
tracing included) until it first reaches `--target_accuracy`.

`--compressors` takes registered names with optional arguments, `name:key=value:...`
(e.g. `powersgd:rank=16`); error feedback follows the `CompressedAllReduce` default.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Sequence

import tensorflow as tf
import yaml
from absl import flags

import tf_gradsync as gs

flags.DEFINE_integer("accuracy_epochs", 30, "accuracy: training epochs.")
flags.DEFINE_float("target_accuracy", 0.95, "accuracy: test accuracy for time-to-accuracy.")
FLAGS = flags.FLAGS

REPLICAS = 4
BATCH_SIZE = 64
SEED = 0
NOT_REACHED = "not reached"
COLUMNS = ["mode", "accuracy", "vs_stock_pts", "vs_none_pts", "epochs_to_target",
           "seconds_to_target", "bytes_per_step", "ratio", "train_s"]
PLOT = (("mode", "accuracy", "final test accuracy"),
        ("mode", "epochs_to_target", "epochs to target accuracy"),
        ("mode", "seconds_to_target", "seconds to target accuracy"))


def train_digits():
    """`examples/train_digits.py` of this source tree, which owns the data and model.

    Raises:
      ImportError: outside a source checkout (the examples are not installed).
    """
    if "train_digits" in sys.modules:
        return sys.modules["train_digits"]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "train_digits.py")
    if not os.path.exists(path):
        raise ImportError(f"the accuracy suite needs {path} (run it from a source checkout)")
    spec = importlib.util.spec_from_file_location("train_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["train_digits"] = module
    return module


def compressor_from_spec(spec: str) -> gs.compression.Compressor:
    """Builds a compressor from `name` or `name:key=value:...` (values parsed as YAML).

    Raises:
      ValueError: for an unknown name, an argument without `=`, or arguments the
        compressor rejects.

    Example:
      >>> compressor_from_spec("topk:ratio=0.1").name
      'topk'
    """
    name, *args = spec.split(":")
    kwargs = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ValueError(f"bad compressor argument {arg!r} in {spec!r}; "
                             "expected name:key=value[:key=value...]")
        kwargs[key] = yaml.safe_load(value)
    return gs.compression.get(name, **kwargs)


def time_to_target(accuracies: Sequence[float], seconds: Sequence[float],
                   target: float) -> tuple:
    """Epochs and seconds until accuracy first reaches `target`.

    Args:
      accuracies: test accuracy after each epoch.
      seconds: cumulative training seconds at the end of each epoch.
      target: the accuracy to reach.

    Returns:
      `(epochs, seconds)`, or `("not reached", "not reached")`.

    Example:
      >>> time_to_target([0.5, 0.96, 0.97], [2.0, 3.0, 4.0], 0.95)
      (2, 3.0)
    """
    for epoch, (acc, sec) in enumerate(zip(accuracies, seconds)):
        if acc >= target:
            return epoch + 1, sec
    return NOT_REACHED, NOT_REACHED


class _TrainClock(tf.keras.callbacks.Callback):
    """Cumulative training seconds at each epoch end, without the test passes."""

    def on_train_begin(self, logs=None):
        self.start, self.excluded, self.at_epoch = time.perf_counter(), 0.0, []

    def on_test_begin(self, logs=None):
        self.test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        self.excluded += time.perf_counter() - self.test_start

    def on_epoch_end(self, epoch, logs=None):
        # Validation runs before on_epoch_end, so its time is already excluded.
        self.at_epoch.append(time.perf_counter() - self.start - self.excluded)


def train_mode(mode: str, devices: Sequence[str], data, epochs: int, target: float) -> dict:
    """Trains digits once: `mode` is "stock" (MirroredStrategy's own ops) or a compressor spec.

    Returns:
      A row: `accuracy` (final test accuracy), `accuracies` (per epoch),
      `epochs_to_target`, `seconds_to_target`, `train_s`, and for compressors
      `bytes_per_step` (per replica, last gradient synchronisation) and `ratio` (what
      an uncompressed all-reduce would send over that).
    """
    digits = train_digits()
    ops = None if mode == "stock" else gs.CompressedAllReduce(compressor_from_spec(mode))
    strategy = tf.distribute.MirroredStrategy(list(devices), cross_device_ops=ops)
    x_train, x_test, y_train, y_test = data
    with strategy.scope():
        model = digits.build_model(tf.keras, SEED)
    clock = _TrainClock()
    history = model.fit(x_train, y_train, epochs=epochs, batch_size=BATCH_SIZE, shuffle=False,
                        validation_data=(x_test, y_test), callbacks=[clock], verbose=0)
    accs = [float(a) for a in history.history["val_accuracy"]]
    epochs_to, seconds_to = time_to_target(accs, clock.at_epoch, target)
    row = {"mode": mode, "accuracy": accs[-1], "accuracies": accs,
           "epochs_to_target": epochs_to, "seconds_to_target": seconds_to,
           "train_s": clock.at_epoch[-1], "bytes_per_step": None, "ratio": None}
    if ops is not None:
        s = ops.stats()
        row["bytes_per_step"] = s["last_bytes_sent"]
        row["ratio"] = s["last_bytes_dense"] / max(s["last_bytes_sent"], 1)
    return row


def compare(modes: Sequence[str], devices: Sequence[str], epochs: int,
            target: float) -> list[dict]:
    """Trains every mode on the same data and adds the deltas, in accuracy points.

    Returns:
      The rows of `train_mode`, plus `vs_stock_pts` and `vs_none_pts` (100 x accuracy
      difference; None when "stock" or "none" is not among `modes`).
    """
    data = train_digits().load_data(SEED)
    rows = []
    for mode in modes:
        print(f"[bench] accuracy {mode}", file=sys.stderr, flush=True)
        rows.append(train_mode(mode, devices, data, epochs, target))
    ref = {r["mode"]: r["accuracy"] for r in rows if r["mode"] in ("stock", "none")}
    for r in rows:
        for col, base in (("vs_stock_pts", "stock"), ("vs_none_pts", "none")):
            r[col] = 100 * (r["accuracy"] - ref[base]) if base in ref else None
    return rows


def run() -> tuple[list[dict], list[str]]:
    """The suite: stock, then --compressors (default: every registered compressor)."""
    devices = gs.logical_cpus(REPLICAS)
    modes = ["stock", *(FLAGS.compressors or gs.compression.names())]
    return compare(modes, devices, FLAGS.accuracy_epochs, FLAGS.target_accuracy), COLUMNS
