r"""Multi-worker digits training with compressed gradient all-reduce.

Run it through the launcher, which starts the workers with a TF_CONFIG each:

    python -m tf_gradsync.launch --num_workers=2 -- examples/multiworker_digits.py --compression=fp16

Every worker prints its test accuracy and the bytes it sent. Set TF_USE_LEGACY_KERAS=1
to train with Keras 2 (tf_keras); `--loop=custom` trains with a custom training loop.
`--out=DIR` saves each worker's final weights and stats (used by the tests).

Fault tolerance: with `--backup_dir=DIR` the Keras `BackupAndRestore` callback saves the
training state every epoch (or every `--backup_freq` steps), and a job restarted by the
launcher resumes from it:

    python -m tf_gradsync.launch --num_workers=2 --restarts=1 -- \
        examples/multiworker_digits.py --compression=fp16 --backup_dir=/tmp/digits_backup \
        --die_at_step=30

`--die_at_step=N` makes worker 1 exit abruptly after its N-th training step (counted
from 0 across epochs) in the first attempt only, to show the restart.

On a cluster: `examples/k8s/tfjob.yaml` runs it as a Kubeflow TFJob (the operator sets
TF_CONFIG), and `examples/slurm/digits.sbatch` under Slurm (`--cluster=slurm`: the
cluster comes from Slurm's variables).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys

from absl import app, flags

flags.DEFINE_string("compression", "fp16", "Registered compressor name, or 'stock' for "
                    "TensorFlow's own MultiWorkerMirroredStrategy collectives.")
flags.DEFINE_string("compression_options", "{}", "JSON keyword arguments of the compressor.")
flags.DEFINE_enum("loop", "fit", ["fit", "custom"], "model.fit or a custom training loop.")
flags.DEFINE_integer("epochs", 20, "Training epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_enum("exchange", "auto", ["auto", "gather", "two_phase"],
                  "How payloads that cannot be summed travel.")
flags.DEFINE_float("timeout", 120.0, "Seconds a collective waits for a missing peer.")
flags.DEFINE_string("out", None, "Directory for per-worker weights and stats.")
flags.DEFINE_integer("die_at_step", -1, "Worker 1 exits with code 3 after this training step "
                     "(counted across epochs; --loop=fit, first attempt only).")
flags.DEFINE_string("backup_dir", None, "Directory for Keras BackupAndRestore (--loop=fit): "
                    "a restarted job resumes from it.")
flags.DEFINE_string("backup_freq", "epoch", "When to back up: 'epoch' or every N steps.")
flags.DEFINE_enum("cluster", "tf_config", ["tf_config", "slurm"],
                  "Where the cluster comes from: the TF_CONFIG variable (the launcher, "
                  "Kubeflow's TFJob) or Slurm's variables (SlurmClusterResolver, under srun).")
flags.DEFINE_integer("port_base", 8888, "--cluster=slurm: the first port of the tasks of a node.")
FLAGS = flags.FLAGS


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


flags.register_validator("compression_options", _json_object,
                         "--compression_options must be a JSON object of the compressor's "
                         "keyword arguments, keys in double quotes: '{\"ratio\": 0.1}'")


def _backup_freq(value: str):
    """'epoch' or a positive step count, as BackupAndRestore's `save_freq` wants it."""
    if value == "epoch":
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise app.UsageError(f"--backup_freq must be 'epoch' or a positive integer, got {value!r}")


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    backup_freq = _backup_freq(FLAGS.backup_freq)
    if FLAGS.backup_dir and FLAGS.loop != "fit":
        raise app.UsageError("--backup_dir needs --loop=fit (BackupAndRestore is a Keras callback)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    import tensorflow as tf
    import tf_gradsync as gs
    import train_digits
    from tf_gradsync.launch import ATTEMPT_ENV
    tf.get_logger().setLevel("ERROR")

    ops = None
    if FLAGS.compression != "stock":
        try:
            ops = gs.CompressedAllReduce(
                gs.compression.get(FLAGS.compression, **json.loads(FLAGS.compression_options)),
                timeout_seconds=FLAGS.timeout, exchange=FLAGS.exchange)
        except ValueError as e:
            raise app.UsageError(f"--compression={FLAGS.compression} "
                                 f"--compression_options={FLAGS.compression_options}: {e}") from e

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=FLAGS.timeout)
    resolver = None
    if FLAGS.cluster == "slurm":
        # Hosts, ranks and ports from Slurm's variables (SLURM_PROCID, the step's node
        # list and tasks per node); each task of a node gets port_base + its local index.
        gpus = len(tf.config.list_physical_devices("GPU"))
        # The resolver pairs each task of a node with GPU slots and cannot count zero
        # GPUs; on CPU-only nodes every task gets an empty slot (nothing made visible).
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=FLAGS.port_base, gpus_per_node=gpus or 1 << 16,
            gpus_per_task=None if gpus else 1, auto_set_gpu=gpus > 0)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops, cluster_resolver=resolver,
                                              communication_options=options)
    rank = strategy.worker_index     # a chief, if the cluster has one, is 0

    def optimizer(k):    # Adam(1e-3) as the compressor adapts it
        opt = train_digits.make_optimizer(k)
        return opt if ops is None else ops.adapt_optimizer(opt)
    if ops is not None and FLAGS.loop == "fit":
        # After the strategy: TensorFlow's collectives are set up before any op runs.
        train_digits.check_optimizer(ops, optimizer, "this example's model.fit trains with "
                                     "Adam; --loop=custom trains with SGD without momentum")
    keras = tf.keras
    x_train, x_test, y_train, y_test = train_digits.load_data(0)

    with strategy.scope():
        model = train_digits.build_model(keras, 0, optimizer)
    if ops is not None:
        gs.track_state(model, ops)   # backups carry the compression state too

    if FLAGS.loop == "fit":
        callbacks = []
        if FLAGS.backup_dir:
            callbacks.append(backup_callback(keras, FLAGS.backup_dir, backup_freq, rank))
        first_attempt = os.environ.get(ATTEMPT_ENV, "0") == "0"
        if FLAGS.die_at_step >= 0 and rank == 1 and first_attempt:
            steps = itertools.count()

            def die(batch, logs):
                # os._exit: no cleanup, no goodbye to the peers, like a crashed host.
                if next(steps) == FLAGS.die_at_step:
                    print(f"worker {rank}: exiting at step {FLAGS.die_at_step}", flush=True)
                    os._exit(3)
            callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=die))
        history = model.fit(x_train, y_train, epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
                            shuffle=False, verbose=0, callbacks=callbacks)
        epochs_run = list(history.epoch)   # after a restore: only the epochs left
    else:
        custom_loop(strategy, model, x_train, y_train, FLAGS.epochs, FLAGS.batch_size)
        epochs_run = list(range(FLAGS.epochs))
    _, acc = model.evaluate(x_test, y_test, batch_size=FLAGS.batch_size, verbose=0)
    stats = ops.stats() if ops is not None else {}
    print(f"worker {rank}: test accuracy {acc:.4f}; stats {stats}")
    if FLAGS.out:
        os.makedirs(FLAGS.out, exist_ok=True)
        np.savez(os.path.join(FLAGS.out, f"weights_{rank}.npz"), *model.get_weights())
        with open(os.path.join(FLAGS.out, f"result_{rank}.json"), "w") as f:
            json.dump({"accuracy": acc, "stats": stats, "epochs_run": epochs_run}, f)
    return 0


def backup_callback(keras, backup_dir: str, save_freq, rank: int):
    """`BackupAndRestore` for one worker of a multi-worker job.

    tf_keras' callback coordinates the workers itself. Keras 3's knows nothing of them:
    here each worker backs up into its own sub-directory (no two processes write one
    file), and before training every other worker replaces its copy with the chief's
    (index 0), so all resume from the same epoch with the same weights even when one
    worker died just before a backup that the others completed. Nothing is written
    during the copy: the chief backs up only after training steps, which wait for every
    worker. `double_checkpoint` keeps the previous backup in case the newest one was cut
    short by the failure.
    """
    if not getattr(keras, "__version__", "2").startswith("3"):    # tf_keras has none
        return keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)
    own = os.path.join(backup_dir, f"worker_{rank}")
    if rank != 0:
        shutil.rmtree(own, ignore_errors=True)
        chief = os.path.join(backup_dir, "worker_0")
        if os.path.isdir(chief):
            shutil.copytree(chief, own)
    return keras.callbacks.BackupAndRestore(own, save_freq=save_freq, double_checkpoint=True)


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
