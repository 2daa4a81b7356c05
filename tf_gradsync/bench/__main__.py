"""python -m tf_gradsync.bench <suite> [flags]

Suites:
  micro        compress+decompress throughput of every compressor (GB/s of float32
               input, one intra-op thread), payload bytes and ratio.
  multiworker  median step time of a ~25M-parameter model on N local workers:
               stock MultiWorkerMirroredStrategy and ours, side by side, as ratios.

Results print as a markdown table; --json writes them to a file.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

flags.DEFINE_list("sizes", ["1000000", "25000000"], "micro: bucket sizes (elements).")
flags.DEFINE_list("compressors", None, "micro/multiworker: names (default: all / none,fp16).")
flags.DEFINE_integer("workers", 2, "multiworker: number of local workers.")
flags.DEFINE_integer("params", 25_000_000, "multiworker: model parameters.")
flags.DEFINE_integer("steps", 10, "multiworker: timed steps per run.")
flags.DEFINE_integer("repeats", 5, "micro: timed repetitions.")
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
FLAGS = flags.FLAGS


def table(rows, cols) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv):
    if len(argv) != 2 or argv[1] not in ("micro", "multiworker"):
        raise app.UsageError("usage: python -m tf_gradsync.bench {micro,multiworker} [flags]")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    suite = argv[1]
    if suite == "micro":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from tf_gradsync import compression
        from tf_gradsync.bench import micro
        rows = []
        for name in FLAGS.compressors or compression.names():
            for size in FLAGS.sizes:
                print(f"[bench] micro {name} {size}", file=sys.stderr, flush=True)
                rows.append(micro.measure(name, int(size), FLAGS.repeats))
        print(table(rows, ["compressor", "numel", "gb_per_s", "payload_bytes", "ratio"]))
    else:
        from tf_gradsync.bench import multiworker
        modes = ["stock", *(FLAGS.compressors or ["none", "fp16"])]
        rows = multiworker.run(modes, FLAGS.workers, FLAGS.params, FLAGS.steps, 16)
        base = rows[0]["median_s"]
        for r in rows:
            r["vs_stock"] = r["median_s"] / base
        print(table(rows, ["mode", "params", "median_s", "vs_stock", "bytes_per_step"]))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    app.run(main)
