"""Compressor throughput: compress + decompress of dense float32 input, one replica."""

from __future__ import annotations

import sys

import tensorflow as tf
from absl import flags

from tf_gradsync import compression, costmodel

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.")
FLAGS = flags.FLAGS
#: Figure (see figure.py): GB/s per compressor, one bar per bucket size.
PLOT = ("compressor", "gb_per_s", "GB/s of float32 input", "numel")


def measure(name, numel: int, repeats: int = 5) -> dict:
    """Median seconds per compress+decompress, GB/s of dense input, payload bytes, ratio
    (`costmodel.measure_throughput`; `name` a compressor's name or instance)."""
    compressor = compression.get(name)
    row = costmodel.measure_throughput(compressor, numel, repeats, data_path=False)
    sec, sent = row["seconds"], row["payload_bytes"]
    dense = numel * 4
    return {"compressor": compressor.name, "numel": numel, "seconds": sec,
            "gb_per_s": dense / sec / 1e9, "payload_bytes": sent, "ratio": dense / max(sent, 1)}


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
