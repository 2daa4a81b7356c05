"""A custom training loop with compressed gradient all-reduce, the pattern that works.

GradientTape, `strategy.run` and `optimizer.apply_gradients` all run inside the
replica function: `apply_gradients` is where each replica's gradients are all-reduced
(through `CompressedAllReduce`), so it must see the replica context. Calling it outside
`strategy.run` on per-replica gradients fails, or on tensors already reduced by hand
sends nothing through the cross-device ops at all. `StepMonitor` records bytes, the
compression ratio and error, and step time around every step.

    python examples/custom_loop_digits.py                        # topk on 4 devices
    python examples/custom_loop_digits.py --compression=powersgd --epochs=20
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    # Defined only when run as a program: tests import this module.
    flags.DEFINE_string("compression", "topk", "A compressor: a registered name, with its "
                        "settings as name:key=value[:key=value...] (topk:ratio=0.05).")
    flags.DEFINE_enum("model", "cnn", list(train_digits.MODELS), "Architecture.")
    flags.DEFINE_integer("epochs", 10, "Training epochs.", lower_bound=1)
    flags.DEFINE_integer("devices", 4, "Logical CPU devices (replicas).", lower_bound=1)
    flags.DEFINE_integer("batch_size", 64, "Global batch size.", lower_bound=1)
    flags.DEFINE_string("jsonl", None, "JSON-lines file for StepMonitor, or none.")
    train_digits.check_batch_flags()


def train(strategy, ops, model_name: str, epochs: int, batch_size: int, jsonl=None,
          seed: int = 0):
    """Trains with a custom loop; returns (test accuracy, the StepMonitor's epoch records).

    Args:
      strategy: a MirroredStrategy whose cross-device ops are `ops`.
      ops: the `tf_gradsync.CompressedAllReduce`.
      model_name: an architecture of `train_digits.MODELS`.
      epochs: passes over the training set.
      batch_size: global batch size (divisible by the replica count).
      jsonl: where the monitor writes JSON lines, or None.
      seed: initialisation and data seed.
    """
    import tensorflow as tf
    from tf_gradsync.callbacks import StepMonitor

    x_train, x_test, y_train, y_test = train_digits.load_data(seed)
    with strategy.scope():
        # SGD with momentum 0.9 as the compressor adapts it (top-k: without momentum, at
        # ten times the rate).
        model = train_digits.build_model(
            tf.keras, seed,
            lambda k: ops.adapt_optimizer(train_digits.make_optimizer(k, "sgd", 0.05, 0.9)),
            model_name)
        optimizer = model.optimizer
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none")
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(
        batch_size, drop_remainder=True)
    dist = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_step(batch):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = loss_fn(y, model(x, training=True))
                # Scale by the global batch: the all-reduce sums the replicas' gradients.
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            # Inside the replica function: this is where gradients are all-reduced.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        losses = strategy.run(replica_fn, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    monitor = StepMonitor(ops, jsonl_path=jsonl)
    epoch_records = []
    for _ in range(epochs):
        for batch in dist:
            with monitor.step(batch_size=batch_size) as rec:
                rec["loss"] = train_step(batch).numpy()
        epoch_records.append(monitor.end_epoch())
    monitor.close()
    logits = model(x_test, training=False)
    accuracy = float(tf.reduce_mean(tf.cast(
        tf.argmax(logits, 1, output_type=tf.int32) == y_test, tf.float32)))
    return accuracy, epoch_records


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tf_gradsync as gs
    tf.get_logger().setLevel("ERROR")
    devices = gs.logical_cpus(FLAGS.devices)
    ops = train_digits.compressed_ops(FLAGS.compression)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    accuracy, epochs = train(strategy, ops, FLAGS.model, FLAGS.epochs, FLAGS.batch_size,
                             FLAGS.jsonl)
    for i, r in enumerate(epochs):
        print(f"epoch {i + 1:3d}  loss {r['loss']:.4f}  bytes/step {r['comm_bytes']:,.0f}  "
              f"ratio {r['compression_ratio']:.1f}x  error {r['comm_error']:.3f}  "
              f"step {r['step_time_ms']:.1f} ms")
    print(f"compressor: {ops.compressor!r}")
    print(f"test accuracy: {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
