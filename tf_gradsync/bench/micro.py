"""Compressor throughput: compress + decompress of dense float32 input, one replica."""

from __future__ import annotations

import sys
import time

import numpy as np
import tensorflow as tf
from absl import flags

from tf_gradsync import _tf_compat, compression
from tf_gradsync.compression import Context, RoundCompressor

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.")
FLAGS = flags.FLAGS
#: Figure (see figure.py): GB/s per compressor, one bar per bucket size.
PLOT = ("compressor", "gb_per_s", "GB/s of float32 input", "numel")


def roundtrip_fn(compressor, numel: int):
    """A tf.function running one compress+decompress of an `numel` bucket, and its state."""
    state = {name: _tf_compat.plain_variable(lambda s=spec: s.initializer(s.shape, s.dtype),
                                             name=name)
             for name, spec in compressor.state_spec(numel, tf.float32).items()}
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def run(x):
        ctx = Context(state=state, step=step.read_value(), seed=tf.stack([step, 7]))
        if isinstance(compressor, RoundCompressor):
            payload, carry = compressor.first_round(x, ctx)
            sent = list(payload)
            while True:   # one replica: each round's sum is its own payload
                nxt, carry = compressor.next_round(payload, carry, ctx)
                if nxt is None:
                    break
                payload = nxt
                sent += list(payload)
            y = compressor.finish(payload, carry, ctx)
        else:
            payload, meta = compressor.compress(x, ctx)
            sent = list(payload)
            y = compressor.decompress(payload, meta)
        step.assign_add(1)
        return y, compression.nbytes(sent)
    return run


def measure(name: str, numel: int, repeats: int = 5) -> dict:
    """Median seconds per compress+decompress, GB/s of dense input, payload bytes, ratio."""
    compressor = compression.get(name)
    x = tf.random.stateless_normal([numel], (1, 2))
    run = roundtrip_fn(compressor, numel)
    y, sent = run(x)               # trace + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        y, sent = run(x)
        y.numpy()
        times.append(time.perf_counter() - start)
    sec = float(np.median(times))
    dense = numel * 4
    return {"compressor": name, "numel": numel, "seconds": sec, "gb_per_s": dense / sec / 1e9,
            "payload_bytes": int(sent), "ratio": dense / max(int(sent), 1)}


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
