"""Train the digits classifier with a `CommunicationMonitor` writing JSON lines.

Uses the data and model of `train_digits.py` and records bytes per step, compression ratio, step
time and loss for `python -m tf_gradsync.report`:

    python examples/monitor_digits.py --compression=none --jsonl=/tmp/none.jsonl
    python examples/monitor_digits.py --compression=fp16 --jsonl=/tmp/fp16.jsonl
    python -m tf_gradsync.report /tmp/none.jsonl /tmp/fp16.jsonl --out docs/report_digits.png
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits  # noqa: E402

FLAGS = flags.FLAGS


flags.DEFINE_string("compression", "fp16", "A compressor: a registered name, with its "
                    "settings as name:key=value[:key=value...] (topk:ratio=0.05).")
flags.DEFINE_string("jsonl", None, "JSON-lines file to write (default: <compression>.jsonl).")
flags.DEFINE_integer("epochs", 30, "Training epochs.", lower_bound=1)
flags.DEFINE_integer("devices", 4, "Logical CPU devices (replicas).", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Random seed.")
train_digits.check_batch_flags()


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_gradsync as gs
    from tf_gradsync.callbacks import CommunicationMonitor
    tf.get_logger().setLevel("ERROR")
    devices = gs.logical_cpus(FLAGS.devices)
    ops = train_digits.compressed_ops(FLAGS.compression)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    x_train, x_test, y_train, y_test = train_digits.load_data(FLAGS.seed)

    def optimizer(keras):    # Adam(1e-3) as the compressor adapts it
        return ops.adapt_optimizer(train_digits.make_optimizer(keras))
    train_digits.check_optimizer(ops, optimizer, "this example trains with Adam; "
                                 "train_digits.py takes --optimizer=sgd --momentum=0")
    with strategy.scope():
        model = train_digits.build_model(tf.keras, FLAGS.seed, optimizer)
    jsonl = FLAGS.jsonl or f"{FLAGS.compression}.jsonl"
    monitor = CommunicationMonitor(ops, jsonl_path=jsonl, batch_size=FLAGS.batch_size)
    history = model.fit(x_train, y_train, epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
                        shuffle=False, verbose=2, callbacks=[monitor])
    _, acc = model.evaluate(x_test, y_test, batch_size=FLAGS.batch_size, verbose=0)
    last = {k: v[-1] for k, v in history.history.items()}
    print(f"compressor:         {ops.compressor!r}")
    print(f"test accuracy:      {acc:.4f}")
    print(f"bytes/replica/step: {last['comm_bytes']:,.0f} "
          f"(uncompressed {last['comm_bytes_dense']:,.0f}; ratio {last['compression_ratio']:.2f}x)")
    print(f"step time p50/p90:  {last['step_time_p50_ms']:.2f} / {last['step_time_p90_ms']:.2f} ms "
          "(last epoch)")
    print(f"records:            {jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
