"""The digits recipes of the accuracy suite and the examples: scikit-learn's digits
(1,797 8x8 images, shipped with the package, no download), three small classifiers
(an MLP, a CNN, and a residual network with batch normalisation) and the optimizers
they are trained with.

They live in the package so that `python -m tf_gradsync.bench accuracy` runs where the
package is installed (`pip install "tf_gradsync[bench]"` brings scikit-learn), not only
in a source checkout; `examples/train_digits.py` trains them from the command line.
"""

from __future__ import annotations

#: Images in the training split of `load_data`.
TRAIN_SIZE = 1437


def load_data(seed: int = 0):
    """Digits (1,797 8x8 images) scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError(f"the digits need scikit-learn ({e}); install it with "
                          "pip install scikit-learn, or tf_gradsync[bench]") from e
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
