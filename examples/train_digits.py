"""Train a classifier on scikit-learn's digits with compressed gradient all-reduce.

Runs on N logical CPU devices of this host (4 by default) under MirroredStrategy. Keras's
progress bar shows, per step, the bytes each replica sent (`comm_bytes`), the
compression ratio and the relative compression error from a `CommunicationMonitor`; at
the end a summary gives the test accuracy and the bytes sent against what an
uncompressed all-reduce would have sent.

    python examples/train_digits.py                       # fp16 on 4 devices
    python examples/train_digits.py --compression=none
    python examples/train_digits.py --config=configs/fp16.yaml
    python examples/train_digits.py --model=cnn --compression=sign --optimizer=sgd
    python examples/train_digits.py --compression=dgc --optimizer=sgd --momentum=0
    python examples/train_digits.py --compression=topk:ratio=0.05
    python examples/train_digits.py --tensorboard_dir=/tmp/tb    # then: tensorboard --logdir /tmp/tb
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from absl import app, flags

# The data, models and optimizers; imported here for the other examples, which use
# them through this module.
from tf_gradsync.bench.digits import (  # noqa: F401
    MODELS, TRAIN_SIZE, batches, build_model, load_data, make_optimizer, steps_per_epoch,
    train)

FLAGS = flags.FLAGS


def define_flags():
    # Defined only when run as a program: other examples import this module.
    flags.DEFINE_string("compression", "fp16", "A compressor: a registered name, with its "
                        "settings as name:key=value[:key=value...] (topk:ratio=0.05).")
    flags.DEFINE_string("config", None, "YAML preset (overrides --compression).")
    flags.DEFINE_enum("model", "mlp", list(MODELS), "Architecture.")
    flags.DEFINE_integer("devices", 4, "Logical CPU devices (replicas).", lower_bound=1)
    flags.DEFINE_integer("epochs", 30, "Training epochs.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 64, "Global batch size.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "Optimizer.")
    flags.DEFINE_float("learning_rate", None, "Learning rate (default: adam 1e-3, sgd 0.05, "
                       "as the compressor adapts it: CompressedAllReduce.adapt_optimizer).")
    flags.DEFINE_float("momentum", 0.9, "SGD momentum, or Adam's beta_1 (0 for compressors "
                       "that apply their own, such as dgc).")
    flags.DEFINE_string("tensorboard_dir", None, "Write the monitor's scalars for TensorBoard.")
    flags.DEFINE_enum("verbose", "1", ["0", "1", "2"],
                      "Keras verbosity: 1 progress bar, 2 a line per epoch, 0 none.")
    flags.register_validator("learning_rate", lambda r: r is None or r > 0,
                             "--learning_rate must be > 0")
    flags.register_validator("config", _config_found,
                             "--config: no such file, nor a shipped preset (gs.presets())")
    check_batch_flags()


def _config_found(path: str | None) -> bool:
    if path is None or os.path.isfile(path):
        return True
    import tf_gradsync as gs
    return os.path.splitext(os.path.basename(path))[0] in gs.presets()


def check_batch_flags() -> None:
    """Registers the check of --batch_size against --devices: the replicas share a
    global batch equally, and a batch past the training set leaves no full step."""
    def ok(f):
        return f["batch_size"] % f["devices"] == 0 and f["batch_size"] <= TRAIN_SIZE
    flags.register_multi_flags_validator(
        ["batch_size", "devices"], ok,
        f"--batch_size must be a multiple of --devices (the replicas share it equally) and "
        f"at most {TRAIN_SIZE}, the training images")


def compressed_ops(spec: str | None = None, config: str | None = None, **ops_kwargs):
    """The `CompressedAllReduce` of a `--config` preset, or else of a `--compression` spec
    (`tf_gradsync.bench.ops_from_spec`: a name, settings as name:key=value); a bad one
    stops the example with a usage error naming the flag (`ops_kwargs`: further
    arguments of the ops)."""
    import tf_gradsync as gs
    from tf_gradsync.bench import ops_from_spec
    try:
        return gs.load_config(config) if config else ops_from_spec(spec, **ops_kwargs)
    except ValueError as e:
        flag = f"--config={config}" if config else f"--compression={spec}"
        raise app.UsageError(f"{flag}: {e}") from e


#: How train_digits' flags set the optimizer, for `check_optimizer`.
OPTIMIZER_FLAGS = ("here --optimizer, --momentum and --learning_rate set the optimizer "
                   "(--optimizer=sgd --momentum=0: SGD without momentum)")


def check_optimizer(ops, make, hint: str = OPTIMIZER_FLAGS) -> None:
    """Stops before training, with a usage error that ends with `hint`, when the
    compressor cannot train with the optimizer `make(keras)` builds (dgc under Adam)."""
    import warnings
    import tensorflow as tf
    from tf_gradsync.compression import OptimizerRefused
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # advice is given again when training
            ops.compressor.check_optimizer(make(tf.keras))
    except OptimizerRefused as e:
        raise app.UsageError(f"{e}; {hint}") from e


@contextlib.contextmanager
def quiet_stderr():
    """Silences native messages written straight to stderr (file descriptor 2).

    TensorFlow's CPU-only builds print CUDA probing lines ("Could not find cuda
    drivers") while it loads and finds its devices, before its log level applies.
    Python exceptions raised inside still propagate and print once stderr is back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with quiet_stderr():
        import tensorflow as tf
        import tf_gradsync as gs
        tf.get_logger().setLevel("ERROR")
        devices = gs.logical_cpus(FLAGS.devices)
        ops = compressed_ops(FLAGS.compression, FLAGS.config)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        tf.constant(0.0)    # devices found
    monitor = gs.callbacks.CommunicationMonitor(
        ops, batch_size=FLAGS.batch_size, tensorboard_dir=FLAGS.tensorboard_dir,
        log_keys=("comm_bytes", "compression_ratio", "comm_error"))

    def optimizer(keras):
        opt = make_optimizer(keras, FLAGS.optimizer, FLAGS.learning_rate, FLAGS.momentum)
        if FLAGS.learning_rate is None:
            # The default recipe as the compressor advises: under Adam, sparse payloads
            # train at a larger rate and without a first moment.
            opt = ops.adapt_optimizer(opt)
        return opt
    check_optimizer(ops, optimizer)
    print(f"{FLAGS.model} on {strategy.num_replicas_in_sync} replicas, {ops.compressor!r}")
    start = time.perf_counter()
    _, acc = train(strategy, tf.keras, FLAGS.epochs, FLAGS.batch_size, FLAGS.seed,
                   optimizer=optimizer, model=FLAGS.model, callbacks=[monitor],
                   verbose=int(FLAGS.verbose))
    seconds = time.perf_counter() - start
    s = ops.stats()
    print()
    print(f"test accuracy       {acc:.4f}  after {FLAGS.epochs} epochs ({seconds:.0f} s)")
    print(f"bytes per replica   {s['bytes_sent_per_step']:,.0f} per step, {s['bytes_sent']:,} "
          f"in all; uncompressed {s['bytes_dense']:,} ({s['compression_ratio']:.1f}x less)")
    print(f"compression error   {s['comm_error']:.3g} (||g - C(g)|| / ||g||, last step)")
    return 0


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
