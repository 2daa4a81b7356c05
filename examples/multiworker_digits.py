"""Multi-worker digits training with compressed gradient all-reduce.

Run it through the launcher, which starts the workers with a TF_CONFIG each:

    python -m tf_gradsync.launch --num_workers=2 -- examples/multiworker_digits.py --compression=fp16

Every worker prints its test accuracy and the bytes it sent. `--keras=tf_keras` trains
with Keras 2 (set TF_USE_LEGACY_KERAS=1), `--loop=custom` with a custom training loop.
`--out=DIR` saves each worker's final weights and stats (used by the tests).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("compression", "fp16", "Registered compressor name, or 'stock' for "
                    "TensorFlow's own MultiWorkerMirroredStrategy collectives.")
flags.DEFINE_string("compression_options", "{}", "JSON keyword arguments of the compressor.")
flags.DEFINE_enum("loop", "fit", ["fit", "custom"], "model.fit or a custom training loop.")
flags.DEFINE_integer("epochs", 20, "Training epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_float("timeout", 120.0, "Seconds a collective waits for a missing peer.")
flags.DEFINE_string("out", None, "Directory for per-worker weights and stats.")
flags.DEFINE_integer("die_at_step", -1, "Worker 1 kills itself at this step (tests).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    import tensorflow as tf
    import tf_gradsync as gs
    import train_digits
    tf.get_logger().setLevel("ERROR")

    ops = None
    if FLAGS.compression != "stock":
        ops = gs.CompressedAllReduce(
            gs.compression.get(FLAGS.compression, **json.loads(FLAGS.compression_options)),
            timeout_seconds=FLAGS.timeout)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=FLAGS.timeout)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops, communication_options=options)
    rank = strategy.cluster_resolver.task_id or 0
    keras = tf.keras
    x_train, x_test, y_train, y_test = train_digits.load_data(0)
    with strategy.scope():
        model = train_digits.build_model(keras, 0)

    if FLAGS.loop == "fit":
        callbacks = []
        if FLAGS.die_at_step >= 0 and rank == 1:
            callbacks.append(keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs: os._exit(3) if b == FLAGS.die_at_step else None))
        model.fit(x_train, y_train, epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
                  shuffle=False, verbose=0, callbacks=callbacks)
    else:
        custom_loop(strategy, model, x_train, y_train, FLAGS.epochs, FLAGS.batch_size)
    _, acc = model.evaluate(x_test, y_test, batch_size=FLAGS.batch_size, verbose=0)
    stats = ops.stats() if ops is not None else {}
    print(f"worker {rank}: test accuracy {acc:.4f}; stats {stats}")
    if FLAGS.out:
        os.makedirs(FLAGS.out, exist_ok=True)
        np.savez(os.path.join(FLAGS.out, f"weights_{rank}.npz"), *model.get_weights())
        with open(os.path.join(FLAGS.out, f"result_{rank}.json"), "w") as f:
            json.dump({"accuracy": acc, "stats": stats}, f)
    return 0


def custom_loop(strategy, model, x, y, epochs, batch_size):
    """Replica r trains on the r-th contiguous slice of every global batch, so any
    strategy with the same replica count sees the same global batches."""
    import tensorflow as tf
    per = batch_size // strategy.num_replicas_in_sync
    steps = len(x) // batch_size
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")
    with strategy.scope():
        opt = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(bx, by):
        def fn(bx, by):
            with tf.GradientTape() as tape:
                loss = loss_fn(by, model(bx, training=True)) / batch_size
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn, args=(bx, by))

    def batch(s):
        def fn(ctx):
            lo = s * batch_size + ctx.replica_id_in_sync_group * per
            return tf.constant(x[lo:lo + per]), tf.constant(y[lo:lo + per])
        return strategy.experimental_distribute_values_from_function(fn)

    for _ in range(epochs):
        for s in range(steps):
            step(*batch(s))


if __name__ == "__main__":
    sys.exit(app.run(main))
