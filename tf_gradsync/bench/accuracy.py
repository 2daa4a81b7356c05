"""The convergence matrix: architectures x optimizers x compressors, at library defaults.

Each cell trains scikit-learn's digits under MirroredStrategy on 4 logical CPU devices
with one model of `digits` (`mlp`: 17,226 parameters; `cnn`: three
convolutions and a dense head, 58,314; `resnet`: a small residual network with batch
normalisation on the digits upsampled to 16x16, 19,994), one optimizer recipe and one
mode: "stock" (MirroredStrategy's own cross-device ops), or a compressor at its
library defaults (error feedback as `CompressedAllReduce` decides). Global batch 64,
no shuffling, one train/test split: with one seed every mode starts from the same
weights and sees the same batches. `--accuracy_seeds` trains every cell once per seed
(initial weights and the random draws of training) and reports the mean: on 360 test
images one image is 0.28 points. Test accuracy is measured after every epoch;
time-to-accuracy is the training wall time (test passes excluded, the first epoch's
tracing included) until it first reaches `--target_accuracy`. `comm_error` is the mean over the steps of the relative
compression error the ops report.

Recipes (learning rates where uncompressed training works on all three models):
  adam  Adam, learning rate 1e-3 (beta_1 0.9, Keras's default)
  sgdm  SGD, learning rate 0.05, momentum 0.9
  sgd   SGD, learning rate 0.2, no momentum
each as the compressor adapts it (`CompressedAllReduce.adapt_optimizer`: sparse
payloads train under Adam at sqrt(K) times the rate, and where entries wait long
without momentum: Adam with beta_1 0, SGD with momentum 0 at 10 times the rate; the
row's `note` says so).

A compressor that applies momentum itself (dgc) refuses an optimizer with momentum
before the first step; its `sgdm` cell runs the recipe with the momentum moved into
the compressor (SGD with momentum 0: what `adapt_optimizer` gives, and what the cell
falls back to with `--noadapt_optimizer`) and says so in `note`; Adam is refused.

`--optimizers` takes recipes with optional overrides, `recipe:lr=X:momentum=Y` (e.g.
`sgdm:lr=0.025`, `sgd:lr=0.5`, `adam:momentum=0` for Adam's beta_1), for sensitivity
studies around the matrix's recipes.

`--compressors` takes registered names with optional arguments, `name:key=value:...`
(e.g. `powersgd:rank=16`; `error_feedback=false` turns the default error feedback
off), and "stock".
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import flags

import tf_gradsync as gs
from tf_gradsync.bench import digits, ops_from_spec

flags.DEFINE_integer("accuracy_epochs", 10, "accuracy: training epochs.", lower_bound=1)
flags.DEFINE_float("target_accuracy", 0.95, "accuracy: test accuracy for time-to-accuracy.")
flags.DEFINE_list("models", ["mlp", "cnn", "resnet"], "accuracy: architectures.")
flags.DEFINE_list("optimizers", ["adam", "sgdm", "sgd"], "accuracy: optimizer recipes.")
flags.DEFINE_bool("adapt_optimizer", True, "accuracy: train with each recipe's optimizer as "
                  "the compressor adapts it (CompressedAllReduce.adapt_optimizer); "
                  "--noadapt_optimizer: as the recipe gives it.")
flags.DEFINE_list("accuracy_seeds", ["0"], "accuracy: initialisation seeds; each cell is "
                  "trained once per seed and reported as the mean (per seed in the JSON).")
FLAGS = flags.FLAGS

REPLICAS = 4
BATCH_SIZE = 64
SEED = 0
NOT_REACHED = "not reached"
#: Recipe -> (optimizer, learning rate, momentum: SGD's, or Adam's beta_1).
RECIPES = {"adam": ("adam", 1e-3, 0.9), "sgdm": ("sgd", 0.05, 0.9), "sgd": ("sgd", 0.2, 0.0)}
COLUMNS = ["model", "optimizer", "mode", "accuracy", "vs_none_pts", "vs_stock_pts",
           "epochs_to_target", "seconds_to_target", "ratio", "comm_error", "note"]
PLOT = ("mode", "vs_none_pts", "test accuracy - none's (points)", "setting")


def recipe_of(spec: str) -> tuple[str, float, float]:
    """`(optimizer, learning rate, momentum)` of a recipe spec: a key of `RECIPES`, with
    optional `:lr=X` and `:momentum=Y` overrides.

    Raises:
      ValueError: for an unknown recipe or key, or a value that is not a number >= 0.
    """
    base, *args = spec.split(":")
    if base not in RECIPES:
        raise ValueError(f"unknown optimizer recipe {base!r} in {spec!r}; valid: {', '.join(RECIPES)}")
    name, lr, momentum = RECIPES[base]
    for arg in args:
        key, _, value = arg.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if key not in ("lr", "momentum") or not number >= 0:
            raise ValueError(f"bad recipe argument {arg!r} in {spec!r}; expected lr=X or "
                             "momentum=Y with a number >= 0")
        if key == "lr":
            lr = number
        else:
            momentum = number
    return name, lr, momentum


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


class _Clock(tf.keras.callbacks.Callback):
    """Cumulative training seconds and test accuracy at each epoch end (the test pass
    outside the timed span), and the compression error of every step.

    The test pass runs on `mirror`, a copy of the model outside the strategy that
    takes the trained weights: one forward call on the test set, without a
    distributed evaluation per epoch."""

    def __init__(self, ops, mirror, x_test, y_test, every_epoch: bool, errors: bool = True):
        super().__init__()
        # Reading the statistics after each batch waits for the step to finish, which
        # costs up to a quarter of a small model's training time: only when asked.
        self.ops = ops if errors else None
        self.mirror, self.every_epoch = mirror, every_epoch
        self.x_test, self.y_test = x_test, y_test

    def on_train_begin(self, logs=None):
        self.start, self.excluded = time.perf_counter(), 0.0
        self.at_epoch, self.accuracies, self.errors = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        if self.ops is not None:
            self.errors.append(self.ops.stats()["comm_error"])

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        self.at_epoch.append(now - self.start - self.excluded)
        if self.every_epoch or epoch + 1 == self.params["epochs"]:
            self.accuracies.append(self.test_accuracy())
        self.excluded += time.perf_counter() - now

    def test_accuracy(self) -> float:
        self.mirror.set_weights(self.model.get_weights())
        logits = self.mirror(self.x_test, training=False)
        predicted = np.argmax(np.asarray(logits), axis=1)
        return float(np.mean(predicted == self.y_test))


def train_cell(model: str, recipe: str, mode: str, devices: Sequence[str], data,
               epochs: int, target: float, validate_every_epoch: bool = True,
               track_error: bool = True, adapt: bool = True, seed: int = SEED) -> dict:
    """Trains one cell of the matrix.

    Args:
      model: an architecture of `digits.MODELS`.
      recipe: a key of `RECIPES`, optionally with overrides (`recipe_of`).
      mode: "stock" or a compressor spec.
      devices: the replicas' devices.
      data: `(x_train, x_test, y_train, y_test)`.
      epochs: training epochs.
      target: accuracy for time-to-accuracy.
      validate_every_epoch: test after every epoch (for epochs and seconds to the
        target); False: only after the last.
      track_error: read the compression error after every step (for `comm_error`).
      adapt: build the optimizer through the ops' `adapt_optimizer` (False: the
        recipe's optimizer as it is).
      seed: initial weights and the random draws of training.

    Returns:
      A row: `accuracy` (final test accuracy), `accuracies` (per epoch),
      `epochs_to_target`, `seconds_to_target`, `train_s`, `note`, and for compressors
      `bytes_per_step` (per replica, last step), `ratio` (what an uncompressed
      all-reduce would send over that) and `comm_error` (mean over steps).
    """
    name, lr, momentum = recipe_of(recipe)
    note = ""
    for attempt in range(2):
        ops = None if mode == "stock" else ops_from_spec(mode)
        # The recipe's optimizer as the library advises for this compressor
        # (`adapt_optimizer`: under Adam, sparse payloads train at a larger rate and
        # without a first moment).
        adapt_fn = ops.adapt_optimizer if ops is not None and adapt else (lambda o: o)
        strategy = tf.distribute.MirroredStrategy(list(devices), cross_device_ops=ops)
        x_train, x_test, y_train, y_test = data
        try:
            # Adapting refuses what the compressor cannot train with, as fit would.
            with strategy.scope():
                net = digits.build_model(
                    tf.keras, seed,
                    lambda k, m=momentum: adapt_fn(digits.make_optimizer(k, name, lr, m)),
                    model)
            changed = _changes(net.optimizer,
                               digits.make_optimizer(tf.keras, name, lr, momentum))
            mirror = digits.build_model(tf.keras, seed, None, model)
            clock = _Clock(ops, mirror, x_test, y_test, validate_every_epoch, track_error)
            with warnings.catch_warnings():
                net.fit(digits.batches(x_train, y_train, BATCH_SIZE), epochs=epochs,
                        steps_per_epoch=digits.steps_per_epoch(len(x_train), BATCH_SIZE),
                        shuffle=False, callbacks=[clock], verbose=0)
            break
        except gs.compression.OptimizerRefused as e:
            # A compressor that applies momentum itself refuses an optimizer with its
            # own: SGD's momentum moves into the compressor; other optimizers (Adam's
            # first moment) cannot give theirs up, and the cell says so.
            if attempt:
                raise
            if name != "sgd" or not momentum:
                return _refused(model, recipe, mode, str(e))
            momentum, note = 0.0, "optimizer momentum 0 (the compressor applies momentum)"
    if changed:
        note = changed
    accs = clock.accuracies
    if validate_every_epoch:
        epochs_to, seconds_to = time_to_target(accs, clock.at_epoch, target)
    else:
        epochs_to = seconds_to = None
    row = {"model": model, "optimizer": recipe, "setting": f"{model}/{recipe}", "mode": mode,
           "seed": seed, "accuracy": accs[-1], "accuracies": accs, "epochs_to_target": epochs_to,
           "seconds_to_target": seconds_to, "train_s": clock.at_epoch[-1],
           "at_epoch": clock.at_epoch, "note": note,
           "bytes_per_step": None, "ratio": None, "comm_error": None}
    if ops is not None:
        s = ops.stats()
        row["bytes_per_step"] = s["last_bytes_sent"]
        row["ratio"] = s["last_bytes_dense"] / max(s["last_bytes_sent"], 1)
        row["comm_error"] = float(np.mean(clock.errors)) if clock.errors else None
    return row


def _changes(adapted, original) -> str:
    """What `adapt_optimizer` changed, for a row's note ("" when nothing)."""
    a, o = adapted.get_config(), original.get_config()
    parts = []
    if a["learning_rate"] != o["learning_rate"]:
        parts.append(f"learning rate x{a['learning_rate'] / o['learning_rate']:.3g}")
    for key in ("beta_1", "momentum"):
        if a.get(key) != o.get(key):
            parts.append(f"{key} {a.get(key):g}")
    return ", ".join(parts) + " (adapt_optimizer)" if parts else ""


def _refused(model: str, recipe: str, mode: str, reason: str) -> dict:
    """The row of a cell whose compressor refused the recipe's optimizer."""
    return {"model": model, "optimizer": recipe, "setting": f"{model}/{recipe}", "mode": mode,
            "accuracy": None, "accuracies": [], "epochs_to_target": None,
            "seconds_to_target": None, "train_s": None, "bytes_per_step": None, "ratio": None,
            "comm_error": None, "note": "refused: " + reason.split(":")[0].split(". ")[0]}


def mean_row(rows: Sequence[dict], target: float) -> dict:
    """One row from a cell's rows for several seeds: accuracies, seconds, bytes and
    error averaged; epochs and seconds to the target from the mean curve; each seed's
    final accuracy in `seed_accuracies` and their standard deviation in `accuracy_std`.

    Example:
      >>> r = mean_row([{"seed": 0, "accuracy": 0.9, "accuracies": [0.8, 0.9],
      ...                "train_s": 2.0, "at_epoch": [1.0, 2.0]},
      ...               {"seed": 1, "accuracy": 1.0, "accuracies": [0.9, 1.0],
      ...                "train_s": 4.0, "at_epoch": [2.0, 4.0]}], 0.95)
      >>> r["accuracy"], r["epochs_to_target"], r["seconds_to_target"], r["seeds"]
      (0.95, 2, 3.0, [0, 1])
    """
    if len(rows) == 1 or rows[0]["accuracy"] is None:
        return rows[0]
    row = dict(rows[0])
    curves = np.mean([r["accuracies"] for r in rows], axis=0)
    seconds = np.mean([r["at_epoch"] for r in rows], axis=0)
    row["accuracies"] = [float(a) for a in curves]
    row["accuracy"] = row["accuracies"][-1]
    row["seed_accuracies"] = [r["accuracy"] for r in rows]
    row["accuracy_std"] = float(np.std(row["seed_accuracies"]))
    row["seeds"] = [r["seed"] for r in rows]
    row.pop("seed", None)
    row["at_epoch"] = [float(t) for t in seconds]
    row["train_s"] = float(seconds[-1])
    if len(curves) == len(seconds):
        row["epochs_to_target"], row["seconds_to_target"] = time_to_target(
            row["accuracies"], row["at_epoch"], target)
    for key in ("bytes_per_step", "ratio", "comm_error"):
        if row.get(key) is not None:
            row[key] = float(np.mean([r[key] for r in rows]))
    return row


def compare(modes: Sequence[str], devices: Sequence[str], epochs: int, target: float,
            models: Sequence[str] = ("mlp",), recipes: Sequence[str] = ("adam",),
            adapt: bool = True, seeds: Sequence[int] = (SEED,)) -> list[dict]:
    """Trains every mode in every (model, recipe) setting, once per seed; adds deltas in
    accuracy points.

    Returns:
      The rows of `train_cell` (for several seeds their `mean_row`), plus `vs_stock_pts`
      and `vs_none_pts` (100 x accuracy difference with "stock" and "none" of the same
      setting; None when absent).

    Raises:
      ValueError: for an unknown model or recipe.
    """
    check_cells(models, recipes)
    data = digits.load_data(SEED)
    rows = []
    for model in models:
        for recipe in recipes:
            cell = []
            for mode in modes:
                runs = []
                for seed in seeds:
                    print(f"[bench] accuracy {model} {recipe} {mode} seed {seed}",
                          file=sys.stderr, flush=True)
                    runs.append(train_cell(model, recipe, mode, devices, data, epochs, target,
                                           adapt=adapt, seed=seed))
                    # Each run as it ends: a long matrix keeps what it has measured.
                    print("[bench] row " + json.dumps(runs[-1]), file=sys.stderr, flush=True)
                cell.append(mean_row(runs, target))
            ref = {r["mode"]: r["accuracy"] for r in cell if r["mode"] in ("stock", "none")}
            for r in cell:
                for col, base in (("vs_stock_pts", "stock"), ("vs_none_pts", "none")):
                    r[col] = (100 * (r["accuracy"] - ref[base])
                              if base in ref and r["accuracy"] is not None else None)
            rows += cell
    return rows


def matrix_table(rows: Sequence[dict]) -> str:
    """The matrix as markdown: a row per mode, a column per (model, optimizer) setting;
    each cell the final accuracy's difference from `none` in points and the epochs to
    the target (none's row: its accuracy).

    Example:
      >>> print(matrix_table([{"setting": "cnn/sgdm", "mode": "none", "accuracy": 0.98,
      ...                      "vs_none_pts": 0.0, "epochs_to_target": 4}]))
      | mode | cnn/sgdm |
      |---|---|
      | none | 0.980 (4) |
    """
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cells = {(r["mode"], r["setting"]): r for r in rows}

    def cell(r):
        if r is None:
            return ""
        if r["accuracy"] is None:
            return "refused"
        epochs = r["epochs_to_target"]
        epochs = "-" if epochs in (None, NOT_REACHED) else str(epochs)
        if r["mode"] == "none" or r.get("vs_none_pts") is None:
            return f"{r['accuracy']:.3f} ({epochs})"
        return f"{r['vs_none_pts']:+.1f} ({epochs})"
    lines = ["| mode | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for m in modes:
        lines.append(f"| {m} | " + " | ".join(cell(cells.get((m, s))) for s in settings) + " |")
    return "\n".join(lines)


def check_cells(models: Sequence[str], recipes: Sequence[str]) -> None:
    """Raises ValueError for an unknown model or recipe, or a recipe's bad override."""
    unknown = [m for m in models if m not in digits.MODELS]
    unknown += [r for r in recipes if r.split(":")[0] not in RECIPES]
    if unknown:
        raise ValueError(f"unknown models or optimizers {unknown}; valid models: "
                         f"{', '.join(digits.MODELS)}; optimizers: {', '.join(RECIPES)}")
    for r in recipes:
        recipe_of(r)


def _seeds() -> list[int]:
    try:
        return [int(s) for s in FLAGS.accuracy_seeds]
    except ValueError:
        raise ValueError(f"--accuracy_seeds takes integers; got "
                         f"{','.join(FLAGS.accuracy_seeds)}") from None


def check() -> None:
    """Refuses bad flag values before anything is trained."""
    check_cells(FLAGS.models, FLAGS.optimizers)
    _seeds()
    if not 0 < FLAGS.target_accuracy <= 1:
        raise ValueError(f"--target_accuracy is a test accuracy in (0, 1], got "
                         f"{FLAGS.target_accuracy}")


def run() -> tuple[list[dict], list[str]]:
    """The suite: none, then --compressors (default: every other registered compressor)."""
    devices = gs.logical_cpus(REPLICAS)
    modes = FLAGS.compressors or ["none", *(n for n in gs.compression.names() if n != "none")]
    rows = compare(modes, devices, FLAGS.accuracy_epochs, FLAGS.target_accuracy,
                   FLAGS.models, FLAGS.optimizers, FLAGS.adapt_optimizer, _seeds())
    print(matrix_table(rows), file=sys.stderr, flush=True)
    return rows, COLUMNS
