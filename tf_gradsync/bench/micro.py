"""Compressor throughput: compress + decompress of dense float32 input, one replica, one
core, against a plain copy of the same bucket timed in the same run (`copy`, and each
row's `of_copy`: machines differ in memory speed, the ratio less). By default glibc
keeps the buffers it frees (`keep_freed_buffers`, as in the workers of the
multi-process suites), so that each call reuses memory instead of faulting in fresh
pages; `--nomicro_keep_buffers` times malloc's defaults."""

from __future__ import annotations

import sys

import tensorflow as tf
from absl import flags

from tf_gradsync import compression, costmodel
from tf_gradsync.bench import keep_freed_buffers, split_spec

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.", lower_bound=1)
flags.DEFINE_list("micro_jit_compile", ["true"], "micro: compile the codecs with XLA where "
                  "they declare it (true), or not (false); both side by side: true,false.")
flags.DEFINE_boolean("micro_data_path", False, "micro: time a bucket's whole data path as "
                     "the cost model prices it (prescale, error feedback, two replicas' sum, "
                     "the compression error) instead of the codec alone.")
flags.DEFINE_boolean("micro_keep_buffers", True, "micro: glibc keeps freed buffers for "
                     "reuse (keep_freed_buffers) instead of returning large ones to the kernel.")
flags.register_validator("sizes", lambda v: all(s.isdigit() and int(s) > 0 for s in v),
                         "micro: --sizes must be element counts >= 1 (e.g. 1000000,25000000)")
FLAGS = flags.FLAGS
#: Figure (see figure.py): GB/s per compressor, one bar per bucket size.
PLOT = ("compressor", "gb_per_s", "GB/s of float32 input", "numel")


def measure(name, numel: int, repeats: int = 5, jit_compile: bool = True,
            data_path: bool = False) -> dict:
    """Median seconds per compress+decompress (or per call of the whole data path), GB/s
    of dense input, payload bytes, ratio (`costmodel.measure_throughput`; `name` a
    compressor's name or instance)."""
    compressor = compressor_of(name)
    row = costmodel.measure_throughput(compressor, numel, repeats, data_path=data_path,
                                       jit_compile=jit_compile)
    sec, sent = row["seconds"], row["payload_bytes"]
    dense = numel * 4
    # Labelled as given: rows of one compressor at several settings stay apart.
    return {"compressor": name if isinstance(name, str) else compressor.name, "numel": numel,
            "jit_compile": jit_compile, "data_path": data_path, "seconds": sec, "ms": sec * 1e3,
            "gb_per_s": dense / sec / 1e9, "payload_bytes": sent, "ratio": dense / max(sent, 1)}


def compressor_of(spec) -> compression.Compressor:
    """The compressor a --compressors entry names (`name:key=value:...`, its own
    settings only: micro times it alone), or an instance as it is.

    Raises:
      ValueError: for an unknown name or setting, or a setting of the ops.
    """
    if isinstance(spec, compression.Compressor):
        return spec
    name, kwargs, ops = split_spec(spec)
    if ops:
        raise ValueError(f"micro times the compressor alone; {', '.join(ops)} in {spec!r} "
                         "set the ops (micro_data_path times a bucket's data path as they "
                         "run it)")
    return compression.get(name, **kwargs)


def check() -> None:
    """Refuses bad flag values before anything is measured."""
    for text in FLAGS.micro_jit_compile:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--micro_jit_compile takes true and/or false, got {text!r}")
    for spec in FLAGS.compressors or ():
        compressor_of(spec)


def copy_seconds(numel: int, repeats: int = 5) -> float:
    """Median seconds of one copy of `numel` float32 (read once, written once)."""
    x = tf.random.stateless_normal([numel], (1, 2))
    copy = tf.function(lambda x: tf.raw_ops.DeepCopy(x=x))
    return costmodel.median_seconds(lambda: copy(x), repeats)[0]


def run() -> tuple[list[dict], list[str]]:
    """The suite: every compressor (or --compressors) at every size, on one core."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    allocation = "kept" if FLAGS.micro_keep_buffers and keep_freed_buffers() else "default"
    rows = []
    check()
    modes = [text.lower() == "true" for text in FLAGS.micro_jit_compile]
    copy_gb_per_s = {}
    for size in map(int, FLAGS.sizes):
        sec = copy_seconds(size, FLAGS.repeats)
        copy_gb_per_s[size] = size * 4 / sec / 1e9
        rows.append({"compressor": "copy", "numel": size, "allocation": allocation,
                     "ms": sec * 1e3, "gb_per_s": copy_gb_per_s[size], "of_copy": 1.0})
    for name in FLAGS.compressors or compression.names():
        for size in map(int, FLAGS.sizes):
            for jit in modes:
                print(f"[bench] micro {name} {size} jit_compile={jit}", file=sys.stderr,
                      flush=True)
                row = measure(name, size, FLAGS.repeats, jit, FLAGS.micro_data_path)
                rows.append(dict(row, allocation=allocation,
                                 of_copy=row["gb_per_s"] / copy_gb_per_s[size]))
    return rows, ["compressor", "numel", "jit_compile", "data_path", "allocation", "ms",
                  "gb_per_s", "of_copy", "payload_bytes", "ratio"]
