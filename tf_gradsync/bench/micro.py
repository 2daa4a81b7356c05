"""Compressor throughput: compress + decompress of dense float32 input, one replica."""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import tensorflow as tf
from absl import flags

from tf_gradsync import _tf_compat, compression
from tf_gradsync.compression import Context, driver

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.")
FLAGS = flags.FLAGS
#: Figure (see figure.py): GB/s per compressor, one bar per bucket size.
PLOT = ("compressor", "gb_per_s", "GB/s of float32 input", "numel")


def roundtrip_fn(compressor, layout: compression.Layout):
    """A tf.function running one compress+decompress of a bucket laid out as `layout`
    (one replica, every round through the protocol driver); it returns the result and
    the payload bytes sent."""
    state = {name: _tf_compat.plain_variable(lambda s=spec: s.initializer(s.shape, s.dtype),
                                             name=name)
             for name, spec in compressor.state_spec(layout).items()}
    # Far past any warm-up: what is timed is the compressor's steady state.
    step = tf.Variable(1 << 40, dtype=tf.int64)

    def exchange(messages):
        # One replica: each round's sum (or gather) is its own payload.
        received, _ = driver.local_exchange(messages)
        return received, compression.nbytes(messages[0].payload)

    @tf.function
    def run(x):
        ctx = Context(state=state, step=step.read_value(), seed=tf.stack([step, 7]),
                      layout=layout)
        outcome = driver.run(compressor, [x], [ctx], exchange)
        step.assign_add(1)
        return outcome.results[0], outcome.bytes
    return run


def matrix_shape(numel: int) -> tuple[int, int]:
    """The most nearly square [rows, cols] holding `numel` elements, as a weight matrix
    (PowerSGD compresses matrices; every other compressor only sees the element count)."""
    cols = math.isqrt(numel)
    while numel % cols:
        cols -= 1
    return numel // cols, cols


def measure(name: str, numel: int, repeats: int = 5) -> dict:
    """Median seconds per compress+decompress, GB/s of dense input, payload bytes, ratio."""
    compressor = compression.get(name)
    x = tf.random.stateless_normal([numel], (1, 2))
    run = roundtrip_fn(compressor, compression.Layout((matrix_shape(numel),)))
    _, sent = run(x)               # trace + warm up
    sent = int(sent)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x)[0].numpy()
        times.append(time.perf_counter() - start)
    sec = float(np.median(times))
    dense = numel * 4
    return {"compressor": name, "numel": numel, "seconds": sec, "gb_per_s": dense / sec / 1e9,
            "payload_bytes": sent, "ratio": dense / max(sent, 1)}


def run() -> tuple[list[dict], list[str]]:
    """The suite: every compressor (or --compressors) at every size, on one core."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = []
    for name in FLAGS.compressors or compression.names():
        for size in FLAGS.sizes:
            print(f"[bench] micro {name} {size}", file=sys.stderr, flush=True)
            rows.append(measure(name, int(size), FLAGS.repeats))
    return rows, ["compressor", "numel", "gb_per_s", "payload_bytes", "ratio"]
