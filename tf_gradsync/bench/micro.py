"""Compressor throughput: compress + decompress of dense float32 input, one replica."""

from __future__ import annotations

import sys

import tensorflow as tf
from absl import flags

from tf_gradsync import compression, costmodel

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.")
flags.DEFINE_list("micro_jit_compile", ["true"], "micro: compile the codecs with XLA where "
                  "they declare it (true), or not (false); both side by side: true,false.")
FLAGS = flags.FLAGS
#: Figure (see figure.py): GB/s per compressor, one bar per bucket size.
PLOT = ("compressor", "gb_per_s", "GB/s of float32 input", "numel")


def measure(name, numel: int, repeats: int = 5, jit_compile: bool = True) -> dict:
    """Median seconds per compress+decompress, GB/s of dense input, payload bytes, ratio
    (`costmodel.measure_throughput`; `name` a compressor's name or instance)."""
    compressor = compression.get(name)
    row = costmodel.measure_throughput(compressor, numel, repeats, data_path=False,
                                       jit_compile=jit_compile)
    sec, sent = row["seconds"], row["payload_bytes"]
    dense = numel * 4
    return {"compressor": compressor.name, "numel": numel, "jit_compile": jit_compile,
            "seconds": sec, "gb_per_s": dense / sec / 1e9, "payload_bytes": sent,
            "ratio": dense / max(sent, 1)}


def run() -> tuple[list[dict], list[str]]:
    """The suite: every compressor (or --compressors) at every size, on one core."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = []
    modes = []
    for text in FLAGS.micro_jit_compile:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--micro_jit_compile takes true and/or false, got {text!r}")
        modes.append(text.lower() == "true")
    for name in FLAGS.compressors or compression.names():
        for size in FLAGS.sizes:
            for jit in modes:
                print(f"[bench] micro {name} {size} jit_compile={jit}", file=sys.stderr,
                      flush=True)
                rows.append(measure(name, int(size), FLAGS.repeats, jit))
    return rows, ["compressor", "numel", "jit_compile", "gb_per_s", "payload_bytes", "ratio"]
