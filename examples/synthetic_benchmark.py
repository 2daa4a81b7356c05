"""Throughput of ResNet-50 (images/s) or a small Transformer language model (tokens/s) on
synthetic data, with compressed gradient all-reduce or TensorFlow's own.

On one host, over logical CPU devices (MirroredStrategy):

    python examples/synthetic_benchmark.py --model=resnet50 --image_size=112 --compression=fp16
    python examples/synthetic_benchmark.py --model=transformer --compression=stock

On several workers (a TF_CONFIG per worker, e.g. from the launcher):

    python -m tf_gradsync.launch --num_workers=2 -- examples/synthetic_benchmark.py \\
        --model=transformer --compression=topk

The same workloads run side by side with stock TensorFlow, on links of a chosen rate,
in `python -m tf_gradsync.bench cluster --model=resnet50|transformer` (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_enum("model", "resnet50", ["resnet50", "transformer"], "Workload.")
    flags.DEFINE_string("compression", "fp16", "A compressor spec (name:key=value...), or "
                        "'stock' for TensorFlow's own cross-device ops.")
    flags.DEFINE_integer("devices", 2, "Logical CPU devices when there is no TF_CONFIG.",
                         lower_bound=1)
    flags.DEFINE_integer("batch", 8, "Examples per replica and step.", lower_bound=1)
    flags.DEFINE_integer("image_size", 224, "ResNet-50 input size.", lower_bound=32)
    flags.DEFINE_integer("steps", 10, "Timed steps (after one untimed step).", lower_bound=1)


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_digits import quiet_stderr
    with quiet_stderr():
        import numpy as np
        import tensorflow as tf
        import tf_gradsync as gs
        from tf_gradsync.bench import models, ops_from_spec
        ops = None if FLAGS.compression == "stock" else ops_from_spec(FLAGS.compression)
        if os.environ.get("TF_CONFIG"):
            strategy = (tf.distribute.MultiWorkerMirroredStrategy() if ops is None
                        else gs.MultiWorkerMirroredStrategy(cross_device_ops=ops))
        else:
            strategy = tf.distribute.MirroredStrategy(gs.logical_cpus(FLAGS.devices),
                                                      cross_device_ops=ops)
        with strategy.scope():
            work = models.build(FLAGS.model, FLAGS.batch, image_size=FLAGS.image_size)
            opt = tf.keras.optimizers.SGD(0.01, momentum=0.9)
            if ops is not None:     # as the compressor trains best (sparse: no momentum)
                opt = ops.adapt_optimizer(opt)
    step = work.train_step(strategy, opt)
    step().numpy()     # traces
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    replicas = strategy.num_replicas_in_sync
    print(f"{FLAGS.model}, {FLAGS.compression}, {replicas} replicas: {median:.3f} s/step, "
          f"{work.items * replicas / median:,.1f} {work.unit}/s")
    if ops is not None:
        s = ops.stats()
        print(f"bytes per replica and step {s['last_bytes_sent']:,} "
              f"(uncompressed {s['last_bytes_dense']:,}); compression error {s['comm_error']:.3g}")
    return 0


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
