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


#: Images in the training split of `load_data`.
TRAIN_SIZE = 1437


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


def load_data(seed: int = 0):
    """Digits (1,797 8x8 images) scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y)


def make_optimizer(keras, name: str = "adam", learning_rate: float | None = None,
                   momentum: float = 0.9):
    """Adam (learning rate 1e-3, `momentum` as its beta_1) or SGD (0.05, with `momentum`)."""
    if name == "adam":
        return keras.optimizers.Adam(1e-3 if learning_rate is None else learning_rate,
                                     beta_1=momentum)
    if name == "sgd":
        return keras.optimizers.SGD(0.05 if learning_rate is None else learning_rate,
                                    momentum=momentum)
    raise ValueError(f"unknown optimizer {name!r}; valid: adam, sgd")


#: Architectures `build_model` knows.
MODELS = ("mlp", "cnn", "resnet")


def _mlp(keras):
    """17,226 parameters: 64-128-64-10 with ReLU."""
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def _cnn(keras):
    """58,314 parameters: three 3x3 convolutions (32, 64, 64 channels, two max-pools)
    and a dense head, on the digits as 8x8x1 images."""
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Reshape((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


def _resnet(keras):
    """A small residual network with batch normalisation (19,994 parameters): the
    digits upsampled to 16x16, a 16-channel stem, a residual block at 16 channels and
    a strided one at 32 (1x1 projection shortcut), global average pooling. Batch
    normalisation momentum is 0.9, PyTorch's default: with Keras's 0.99 the moving
    statistics lag a short training and the model tests at chance."""
    layers = keras.layers

    def conv_bn(x, channels, stride=1, relu=True, kernel=3):
        x = layers.Conv2D(channels, kernel, strides=stride, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization(momentum=0.9)(x)
        return layers.ReLU()(x) if relu else x

    def block(x, channels, stride):
        shortcut = x if stride == 1 and x.shape[-1] == channels \
            else conv_bn(x, channels, stride, relu=False, kernel=1)
        y = conv_bn(conv_bn(x, channels, stride), channels, relu=False)
        return layers.ReLU()(layers.Add()([y, shortcut]))

    inputs = keras.Input((64,))
    x = layers.UpSampling2D(2)(layers.Reshape((8, 8, 1))(inputs))
    x = conv_bn(x, 16)
    x = block(block(x, 16, 1), 32, 2)
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs)


def build_model(keras, seed: int = 0, optimizer=None, model: str = "mlp"):
    """A small classifier of the digits, compiled.

    Args:
      keras: the Keras module (`tf.keras` or `tf_keras`).
      seed: initialisation seed.
      optimizer: a callable `keras -> optimizer`; None: Adam(1e-3).
      model: "mlp" (17,226 parameters), "cnn" (58,314) or "resnet" (19,994, with
        batch normalisation).
    """
    builders = {"mlp": _mlp, "cnn": _cnn, "resnet": _resnet}
    if model not in builders:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    keras.utils.set_random_seed(seed)
    model = builders[model](keras)
    model.compile(optimizer=(optimizer or make_optimizer)(keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def batches(x, y, batch_size: int):
    """`(x, y)` in order, batched (the last batch partial), repeated without end.

    Fit it with `steps_per_epoch=steps_per_epoch(len(x), batch_size)`: one distributed
    iterator then serves every epoch, where arrays handed to `fit` get a new one per
    epoch, whose set-up and teardown cost about as much as a small model's epoch. The
    batches are the same. tf.data's autotuning is off: an iterator's teardown waits out
    its autotuning thread's current sleep, which grows with the iterator's age (up to
    15 s seen at the end of a 10-epoch fit), and there is nothing to tune here.
    """
    import tensorflow as tf
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat().with_options(
        options)


def steps_per_epoch(examples: int, batch_size: int) -> int:
    """Batches in one pass over `examples` (the last one partial)."""
    return -(-examples // batch_size)


def train(strategy, keras, epochs: int, batch_size: int, seed: int = 0, data=None,
          optimizer=None, model: str = "mlp", callbacks=(), verbose: int = 0):
    """Builds and fits the model under `strategy`; returns (model, test accuracy).

    `optimizer`: a callable `keras -> optimizer` (see `make_optimizer`); None: Adam.
    `model`: an architecture of `MODELS`."""
    x_train, x_test, y_train, y_test = data if data is not None else load_data(seed)
    with strategy.scope():
        model = build_model(keras, seed, optimizer, model)
    model.fit(batches(x_train, y_train, batch_size), epochs=epochs,
              steps_per_epoch=steps_per_epoch(len(x_train), batch_size), shuffle=False,
              verbose=verbose, callbacks=list(callbacks))
    _, acc = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    return model, float(acc)


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
