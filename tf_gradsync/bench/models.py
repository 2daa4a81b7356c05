"""Models the step-time suites train on synthetic data: a dense layer of a given size,
four of them (`mlp`), ResNet-50 and a small Transformer language model.

`resnet50` follows tf_cnn_benchmarks' convention: `keras.applications.ResNet50` with
random weights, synthetic images and labels generated once, throughput in images per
second. `transformer` is a decoder-only language model (token and position
embeddings, pre-norm blocks of causal self-attention and an MLP, a dense output
projection); its token embedding's gradient is an IndexedSlices (the sparse path),
throughput in tokens per second.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

#: Model names for `--model`.
NAMES = ("dense", "mlp", "resnet50", "transformer")
#: Square Dense layers of the `mlp` model.
MLP_LAYERS = 4


@dataclasses.dataclass
class Workload:
    """A model with its loss and one synthetic batch.

    Attributes:
      model: the Keras model (built under the strategy's scope).
      loss: `(model, x, y) -> scalar loss` for one replica's batch.
      batch: `(x, y)`, one replica's synthetic batch.
      items: items per replica batch (images, tokens or examples).
      unit: what an item is.
    """

    model: object
    loss: Callable
    batch: tuple
    items: int
    unit: str

    def gradients(self):
        """One replica's loss and gradients on its batch (inside `strategy.run`)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        with tf.GradientTape() as tape:
            loss = self.loss(self.model, *self.batch)
        return loss, tape.gradient(loss, self.model.trainable_variables)

    def train_step(self, strategy, optimizer):
        """A `tf.function` running one training step on every replica; it returns the
        loss summed over replicas."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        # Slots made up front, in the strategy's scope: made while the step traces,
        # under TensorFlow's own MirroredStrategy ops, they fed a placeholder that
        # nothing fills.
        if not getattr(optimizer, "built", False):
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)

        @tf.function
        def step():
            def fn():
                loss, grads = self.gradients()
                optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
                return loss
            return strategy.reduce("SUM", strategy.run(fn), axis=None)
        return step

    def compute_step(self, strategy):
        """A `tf.function` running forward and backward on every replica, without
        synchronising the gradients; it returns one number that depends on each of them
        (so that waiting for it waits for all, copying none)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        @tf.function
        def step():
            def fn():
                _, grads = self.gradients()
                return tf.add_n([tf.cast(tf.reshape(getattr(g, "values", g), [-1])[0],
                                         tf.float32) for g in grads])
            return strategy.experimental_local_results(strategy.run(fn))
        return step


def build(name: str, batch: int, params: int = 25_000_000, image_size: int = 224,
          seq_len: int = 128, vocab: int = 32_000) -> Workload:
    """Builds a workload; call it inside `strategy.scope()`.

    Args:
      name: one of `NAMES`.
      batch: examples per replica.
      params: weights of the `dense` model (a square Dense layer) or of the `mlp` one
        (`MLP_LAYERS` square Dense layers with ReLU between them).
      image_size: `resnet50` input height and width.
      seq_len: `transformer` tokens per example.
      vocab: `transformer` vocabulary.

    Raises:
      ValueError: for an unknown name.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras = tf.keras
    rng = np.random.default_rng(0)
    if name in ("dense", "mlp"):
        layers = MLP_LAYERS if name == "mlp" else 1
        width = int(np.sqrt(params / layers))
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
            + [keras.layers.Dense(width)])
        x = tf.constant(rng.standard_normal((batch, width)), tf.float32)
        return Workload(model, lambda m, x, y: tf.reduce_mean(m(x) ** 2), (x, None), batch,
                        "examples")
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                            classes=1000)
        x = tf.constant(rng.uniform(size=(batch, image_size, image_size, 3)), tf.float32)
        y = tf.constant(rng.integers(0, 1000, batch), tf.int32)
        ce = keras.losses.SparseCategoricalCrossentropy()
        return Workload(model, lambda m, x, y: ce(y, m(x, training=True)), (x, y), batch,
                        "images")
    if name == "transformer":
        model = _transformer(keras, vocab, seq_len)
        tokens = rng.integers(0, vocab, (batch, seq_len + 1))
        x = tf.constant(tokens[:, :-1], tf.int32)
        y = tf.constant(tokens[:, 1:], tf.int32)
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return Workload(model, lambda m, x, y: ce(y, m(x, training=True)), (x, y),
                        batch * seq_len, "tokens")
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(NAMES)}")


def _transformer(keras, vocab: int, seq_len: int, width: int = 256, heads: int = 4,
                 layers: int = 2):
    """A decoder-only language model: 2 blocks of width 256 (about 17M parameters, 8.2M
    of them in the token embedding and 8.2M in the output projection)."""
    L = keras.layers
    tokens = keras.Input((seq_len,), dtype="int32")
    x = L.Embedding(vocab, width)(tokens)
    positions = L.Embedding(seq_len, width)(keras.ops.arange(seq_len)[None, :])
    x = x + positions
    for _ in range(layers):
        h = L.LayerNormalization()(x)
        h = L.MultiHeadAttention(heads, width // heads)(h, h, use_causal_mask=True)
        x = x + h
        h = L.LayerNormalization()(x)
        h = L.Dense(4 * width, activation="gelu")(h)
        x = x + L.Dense(width)(h)
    logits = L.Dense(vocab)(L.LayerNormalization()(x))
    return keras.Model(tokens, logits)
