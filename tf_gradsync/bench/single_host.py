"""Step time on one host: MirroredStrategy over 4 logical CPU devices, with TensorFlow's
cross-device ops and with `CompressedAllReduce`, all measured in one process.

Modes:
  stock_r1d      tf.distribute.ReductionToOneDevice: the baseline of `vs_r1d`.
  stock_default  MirroredStrategy's own choice. For CPU devices TensorFlow 2.21 picks
                 its CollectiveAllReduce (CollectiveReduceV2 ops over the local
                 devices), so this differs from ReductionToOneDevice: `vs_default`.
  stock_hier     tf.distribute.HierarchicalCopyAllReduce.
  <compressor>   tf_gradsync.CompressedAllReduce(<compressor>), `--bucket_bytes` if given,
                 defaults for the rest; a spec as `none:bucket_bytes=4194304` sets
                 this mode's own (see `tf_gradsync.bench.ops_from_spec`).
tf.distribute.NcclAllReduce needs GPUs and is not run.

Every mode builds the same model (Dense layers on synthetic data) and a custom step in a
tf.function (`strategy.run` of forward, backward and `optimizer.apply_gradients`). The
modes are timed round-robin, `--steps_per_round` steps each per round, with the
starting mode rotated every round, so that load from elsewhere on the host lands on
all of them alike; each mode's time is the median over all its timed steps.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import flags

import tf_gradsync as gs
from tf_gradsync.bench import ops_from_spec

flags.DEFINE_list("stock_ops", ["r1d", "default", "hier"],
                  "single_host: TensorFlow cross-device ops to time (r1d = ReductionToOneDevice, "
                  "default = MirroredStrategy's choice, hier = HierarchicalCopyAllReduce).")
flags.DEFINE_integer("width", 1024, "single_host: inputs and units of each hidden Dense layer.",
                     lower_bound=1)
flags.DEFINE_integer("layers", 3, "single_host: hidden Dense layers (then a Dense(10) head).",
                     lower_bound=1)
flags.DEFINE_integer("global_batch", 64, "single_host: global batch size.", lower_bound=1)
flags.DEFINE_integer("rounds", 10, "single_host: round-robin rounds over the modes.", lower_bound=1)
flags.DEFINE_integer("steps_per_round", 10, "single_host: timed steps of each mode per round.",
                     lower_bound=1)
flags.DEFINE_integer("bucket_bytes", None, "single_host: bucket_bytes of ours (default: the "
                     "CompressedAllReduce default).")
FLAGS = flags.FLAGS

REPLICAS = 4
#: Stock mode -> factory of TensorFlow's cross-device ops (None: the strategy's choice).
STOCK = {
    "r1d": tf.distribute.ReductionToOneDevice,
    "default": lambda: None,
    "hier": tf.distribute.HierarchicalCopyAllReduce,
}
COLUMNS = ["mode", "params", "median_ms", "vs_r1d", "vs_default", "bytes_per_step", "ratio"]
PLOT = ("mode", "vs_r1d", "step time / stock ReductionToOneDevice")


def make_step(strategy: tf.distribute.Strategy, width: int, layers: int,
              global_batch: int) -> tuple[Callable[[], float], tf.keras.Model]:
    """Builds the model, optimizer, data and training step of one mode.

    Returns:
      A function running one step (and waiting for it), and the model.
    """
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential(
            [tf.keras.Input((width,))]
            + [tf.keras.layers.Dense(width, activation="relu") for _ in range(layers)]
            + [tf.keras.layers.Dense(10)])
        opt = tf.keras.optimizers.SGD(1e-3)
    per_replica = global_batch // strategy.num_replicas_in_sync

    def batch(ctx):
        seed = (ctx.replica_id_in_sync_group, 1)
        return (tf.random.stateless_normal([per_replica, width], seed),
                tf.random.stateless_uniform([per_replica], seed, maxval=10, dtype=tf.int32))

    x, y = strategy.experimental_distribute_values_from_function(batch)

    @tf.function
    def step(x, y):
        def fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
                loss = loss / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(fn, args=(x, y))

    def run_once() -> float:
        return float(strategy.experimental_local_results(step(x, y))[0].numpy())
    return run_once, model


def measure(modes: Sequence[str], devices: Sequence[str], width: int, layers: int,
            global_batch: int, rounds: int, steps_per_round: int,
            bucket_bytes: int | None = None) -> list[dict]:
    """Times every mode round-robin in this process.

    Args:
      modes: `stock_<name>` for a key of `STOCK`, or a compressor spec (`ops_from_spec`).
      devices: the strategy's devices.
      width, layers: the model (see the flags).
      global_batch: global batch size (divisible by the number of devices).
      rounds, steps_per_round: timed steps per mode are their product.
      bucket_bytes: bucket size of ours; None: the `CompressedAllReduce` default.

    Returns:
      One row per mode with the columns of `COLUMNS`: median step time in ms, its ratio
      to `stock_r1d` and `stock_default` (None when that mode was not run), and for
      ours the bytes each replica sent in the last step and the compression ratio.

    Raises:
      ValueError: for an unknown stock mode or compressor, or a batch that does not
        split evenly over the devices.
    """
    if global_batch % len(devices):
        raise ValueError(f"global_batch {global_batch} is not divisible by {len(devices)} devices")
    runners, ops_of, params = {}, {}, {}
    for mode in modes:
        if mode.startswith("stock_"):
            name = mode[len("stock_"):]
            if name not in STOCK:
                raise ValueError(f"unknown stock mode {mode!r}; valid: "
                                 f"{', '.join('stock_' + k for k in STOCK)}")
            ops = STOCK[name]()
        else:
            kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            ops = ops_of[mode] = ops_from_spec(mode, **kwargs)
        strategy = tf.distribute.MirroredStrategy(list(devices), cross_device_ops=ops)
        print(f"[bench] single_host build {mode}", file=sys.stderr, flush=True)
        runners[mode], model = make_step(strategy, width, layers, global_batch)
        params[mode] = model.count_params()
        for _ in range(2):   # trace, then one untimed step so allocations settle
            runners[mode]()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        k = r % len(modes)
        for mode in [*modes[k:], *modes[:k]]:
            for _ in range(steps_per_round):
                start = time.perf_counter()
                runners[mode]()
                times[mode].append(time.perf_counter() - start)
        print(f"[bench] single_host round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    median = {m: float(np.median(t)) for m, t in times.items()}
    rows = []
    for mode in modes:
        row = {"mode": mode, "params": params[mode], "median_ms": 1e3 * median[mode],
               "vs_r1d": None, "vs_default": None, "bytes_per_step": None, "ratio": None}
        for col, base in (("vs_r1d", "stock_r1d"), ("vs_default", "stock_default")):
            if base in median:
                row[col] = median[mode] / median[base]
        if mode in ops_of:
            s = ops_of[mode].stats()
            row["bytes_per_step"] = s["last_bytes_sent"]
            row["ratio"] = s["last_bytes_dense"] / max(s["last_bytes_sent"], 1)
        rows.append(row)
    return rows


def check() -> None:
    """Refuses bad flag values before anything is measured."""
    bad = [s for s in FLAGS.stock_ops if s not in STOCK]
    if bad:
        raise ValueError(f"--stock_ops has {', '.join(bad)}; valid: {', '.join(STOCK)}")
    if FLAGS.global_batch % REPLICAS:
        raise ValueError(f"--global_batch={FLAGS.global_batch} does not split over the "
                         f"{REPLICAS} replicas; give a multiple of {REPLICAS}")


def run() -> tuple[list[dict], list[str]]:
    """The suite: --stock_ops, then --compressors (default none, fp16, topk, powersgd)."""
    devices = gs.logical_cpus(REPLICAS)
    modes = [f"stock_{s}" for s in FLAGS.stock_ops]
    modes += FLAGS.compressors or ["none", "fp16", "topk", "powersgd"]
    rows = measure(modes, devices, FLAGS.width, FLAGS.layers, FLAGS.global_batch,
                   FLAGS.rounds, FLAGS.steps_per_round, FLAGS.bucket_bytes)
    return rows, COLUMNS
