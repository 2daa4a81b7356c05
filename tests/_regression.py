"""A small regression model and its distributed training step, shared by tests and
their worker scripts."""

import tensorflow as tf


def model_and_optimizer(strategy, inputs: int, outputs: int, hidden: int = 64, seed: int = 0,
                        momentum: float = 0.9):
    """A tanh MLP and SGD (with momentum by default), created under `strategy`'s scope."""
    with strategy.scope():
        tf.keras.utils.set_random_seed(seed)
        model = tf.keras.Sequential([tf.keras.Input((inputs,)),
                                     tf.keras.layers.Dense(hidden, "tanh"),
                                     tf.keras.layers.Dense(outputs)])
        opt = tf.keras.optimizers.SGD(0.05, momentum=momentum)
    return model, opt


def train_step(strategy, model, opt):
    """A tf.function running one mean-squared-error step on every replica."""
    @tf.function
    def step(bx, by):
        def fn(bx, by):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(bx) - by) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn, (bx, by))
    return step
