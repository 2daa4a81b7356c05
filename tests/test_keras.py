"""End-to-end training through CompressedAllReduce: Keras 3, tf_keras, custom loops."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
import train_digits  # examples/train_digits.py
import _tf_keras  # tests/_tf_keras.py

EPOCHS = 12


@pytest.fixture(scope="module")
def data():
    return train_digits.load_data(0)


@pytest.fixture(scope="module")
def stock_accuracy(data):
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    return train_digits.train(strategy, tf.keras, EPOCHS, 64, data=data)[1]


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none"])   # fp16 fits: the multi-worker tests
def test_keras3_fit_matches_stock_mirrored(devices, data, stock_accuracy, compression):
    ops = gs.CompressedAllReduce(compression)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    _, acc = train_digits.train(strategy, tf.keras, EPOCHS, 64, data=data)
    steps = EPOCHS * int(np.ceil(len(data[0]) / 64))
    stats = ops.stats()
    assert stats["steps"] == steps, "every training step synchronised through our ops"
    assert stats["compression_ratio"] == pytest.approx(1.0 if compression == "none" else 2.0)
    assert acc >= 0.95 and abs(acc - stock_accuracy) <= 0.01, (acc, stock_accuracy)


@pytest.mark.parametrize("compression,tol", [("none", 1e-5), ("fp16", 3e-3)])
def test_custom_training_loop_matches_reduction_to_one_device(devices, compression, tol):
    def run(cross_device_ops):
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
        with strategy.scope():
            tf.keras.utils.set_random_seed(1)
            model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(32, "tanh"),
                                         tf.keras.layers.Dense(3)])
            opt = tf.keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 6)).astype(np.float32)
        y = rng.normal(size=(64, 3)).astype(np.float32)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(3))

        @tf.function
        def step(batch):
            def fn(bx, by):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum((model(bx) - by) ** 2) / 16.0
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(fn, args=batch)

        for batch in dataset:
            step(batch)
        # Every replica holds the same weights.
        for v in model.trainable_variables:
            vals = [t.numpy() for t in strategy.experimental_local_results(v)]
            for other in vals[1:]:
                np.testing.assert_array_equal(vals[0], other)
        return [v.numpy() for v in model.trainable_variables]

    want = run(tf.distribute.ReductionToOneDevice())
    got = run(gs.CompressedAllReduce(compression, bucket_bytes=512))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("compression,tol", [("none", 1e-5), ("fp16", 3e-3)])
def test_gradient_accumulation_sends_once_per_update(devices, compression, tol):
    # README's recipe: micro-batches add their gradients into per-replica variables and
    # the optimizer reduces the sums every K-th; against one step on the K batches at once.
    k, micro = 4, 8
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    y = rng.normal(size=(128, 3)).astype(np.float32)

    def run(cross_device_ops, k, global_batch):
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
        with strategy.scope():
            tf.keras.utils.set_random_seed(1)
            model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(32, "tanh"),
                                         tf.keras.layers.Dense(3)])
            opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
            sums = [tf.Variable(tf.zeros_like(v), trainable=False,
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.SUM)
                    for v in model.trainable_variables]
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))

        @tf.function
        def accumulate(batch):
            def fn(bx, by):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum((model(bx) - by) ** 2) / (global_batch * k)
                for s, g in zip(sums, tape.gradient(loss, model.trainable_variables)):
                    s.assign_add(g)
            strategy.run(fn, args=batch)

        @tf.function
        def apply():
            def fn():
                opt.apply_gradients(zip([s.read_value() for s in sums],
                                        model.trainable_variables))
                for s in sums:
                    s.assign(tf.zeros_like(s))
            strategy.run(fn)

        for i, batch in enumerate(dataset):
            accumulate(batch)
            if (i + 1) % k == 0:
                apply()
        return [v.numpy() for v in model.trainable_variables]

    ops = gs.CompressedAllReduce(compression, bucket_bytes=512)
    got = run(ops, k, micro)
    want = run(tf.distribute.ReductionToOneDevice(), 1, k * micro)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    stats = ops.stats()
    assert stats["steps"] == len(x) // (k * micro)
    assert stats["last_bytes_sent"] > 0
    ratio = 1 if compression == "none" else 2
    assert stats["last_bytes_dense"] == ratio * stats["last_bytes_sent"]


@pytest.mark.slow
def test_tf_keras_fit_in_subprocess():
    script = """
        import os, sys
        import tensorflow as tf
        import tf_gradsync as gs
        import tf_keras
        import train_digits
        devices = gs.logical_cpus(4)
        ops = gs.CompressedAllReduce("fp16")
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras"), tf.keras
        _, acc = train_digits.train(strategy, tf_keras, 10, 64)
        s = ops.stats()
        print("RESULT", acc, s["steps"], s["compression_ratio"])
    """
    line = _tf_keras.lines(_tf_keras.run(script))[-1]
    acc, steps, ratio = float(line[0]), int(line[1]), float(line[2])
    assert acc >= 0.93
    assert steps == 10 * 23
    assert ratio == pytest.approx(2.0)


def _fit_dgc(keras, devices, momentum, steps=2):
    ops = gs.CompressedAllReduce("dgc")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    x, _, y, _ = train_digits.load_data(0)
    optimizer = lambda k: train_digits.make_optimizer(k, "sgd", 0.05, momentum)  # noqa: E731
    with strategy.scope():
        model = train_digits.build_model(keras, 0, optimizer)
    weights = [w.copy() for w in model.get_weights()]
    try:
        model.fit(x[:64 * steps], y[:64 * steps], batch_size=64, epochs=1, verbose=0)
    finally:
        unchanged = all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    return ops, unchanged


def test_dgc_with_optimizer_momentum_fails_before_the_first_step(devices):
    with pytest.raises(ValueError, match=r"dgc applies momentum 0.9 itself.*SGD applies "
                                         r"momentum=0.9.*SGD\(momentum=0.0\)"):
        _fit_dgc(tf.keras, devices, 0.9)
    # Nothing was applied: the error comes while the step is traced.
    ops, unchanged = _fit_dgc(tf.keras, devices, 0.0)
    assert ops.stats()["steps"] == 2 and not unchanged


def test_dgc_refuses_the_momentum_inside_mixed_precision_loss_scaling(devices):
    """Under mixed_float16, Keras 3 wraps the optimizer in a LossScaleOptimizer; DGC's
    check reads the SGD inside it."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match=r"dgc applies momentum 0.9 itself.*SGD applies "
                                             r"momentum=0.9"):
            _fit_dgc(tf.keras, devices, 0.9)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def test_dgc_with_optimizer_momentum_fails_under_tf_keras():
    script = """
        import numpy as np
        import tensorflow as tf
        import tf_gradsync as gs
        import tf_keras
        import train_digits
        devices = gs.logical_cpus(2)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=gs.CompressedAllReduce("dgc"))
        x, _, y, _ = train_digits.load_data(0)
        opt = lambda k: train_digits.make_optimizer(k, "sgd", 0.05, 0.9)
        with strategy.scope():
            model = train_digits.build_model(tf_keras, 0, opt)
        try:
            model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
        except ValueError as e:
            print("RAISED", str(e).replace(chr(10), " "))
    """
    stdout = _tf_keras.run(script)
    assert "RAISED" in stdout and "dgc applies momentum 0.9 itself" in stdout, stdout[-2000:]


@pytest.mark.parametrize("name,bound", [("adam", 1.0), ("sgd", 2.5)])
def test_terngrad_clips_by_the_optimizer_that_applies_the_step(devices, name, bound):
    """TernGrad's bound is settled from the optimizer met while the step is traced."""
    ops = gs.CompressedAllReduce("terngrad")
    assert ops.compressor.bound == 2.5
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    x, _, y, _ = train_digits.load_data(0)
    optimizer = lambda k: train_digits.make_optimizer(k, name, 1e-3, 0.9)  # noqa: E731
    with strategy.scope():
        model = train_digits.build_model(tf.keras, 0, optimizer)
    model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
    assert ops.stats()["steps"] == 1
    assert ops.compressor.bound == bound


@pytest.mark.slow
def test_custom_loop_example_trains_and_keeps_replicas_in_step(devices):
    import custom_loop_digits
    # int8: a lossy compressor (comm_error > 0) that trains the CNN. Six epochs: under
    # SGD with momentum 0.9 the loss still jumps around epochs 2-4, with or without
    # compression (uncompressed: 0.919 after 4 epochs, 0.972 after 6; int8 0.897, 0.975).
    ops = gs.CompressedAllReduce("int8")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    accuracy, epochs = custom_loop_digits.train(strategy, ops, "cnn", 6, 64)
    steps = 6 * (1437 // 64)
    stats = ops.stats()
    assert stats["steps"] == steps, "every step's gradients went through the ops"
    assert len(epochs) == 6 and epochs[-1]["compression_ratio"] == pytest.approx(
        stats["last_bytes_dense"] / stats["last_bytes_sent"])
    assert 0 < epochs[-1]["comm_error"] < 1
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert accuracy >= 0.94, accuracy


SYNC_BN = """
import sys
import numpy as np
import tf_gradsync as gs
devices = gs.logical_cpus(4)
import tensorflow as tf
ops = gs.CompressedAllReduce(sys.argv[1])
strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
rng = np.random.default_rng(0)
x = (rng.normal(size=(32, 6)) * np.arange(1, 7) + np.arange(6)).astype("float32")
with strategy.scope():
    bn = tf.keras.layers.BatchNormalization(synchronized=True, momentum=0.0)
    model = tf.keras.Sequential([tf.keras.Input((6,)), bn, tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
model.fit(x, x[:, :1], batch_size=32, epochs=1, shuffle=False, verbose=0)
print("RESULT", ops.stats()["steps"], *np.asarray(bn.moving_mean), *np.asarray(bn.moving_variance))
"""


@pytest.mark.parametrize("keras_version", ["keras3", "tf_keras"])
def test_synchronized_batch_norm_moments_are_exact_and_no_step(keras_version):
    """A synchronized batch normalization sums its moments (and, backwards, their
    gradients) over the replicas with the replica context's all-reduce, as gradients
    are summed: they go exact, and count no step. Sign compression sent each moment as
    +-its mean magnitude, top-k zeros, and one `fit` step counted six."""
    out = _tf_keras.run(SYNC_BN, "sign", legacy=keras_version == "tf_keras", timeout=300)
    (row,) = _tf_keras.lines(out)
    x = (np.random.default_rng(0).normal(size=(32, 6)) * np.arange(1, 7)
         + np.arange(6)).astype(np.float32)
    assert int(row[0]) == 1
    np.testing.assert_allclose(np.array(row[1:7], float), x.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(row[7:], float), x.var(0), rtol=1e-4)


SEQUENCES = """
import sys
import numpy as np
import tf_gradsync as gs
devices = gs.logical_cpus(2)
import tensorflow as tf

def generate():
    rng = np.random.default_rng(0)
    for steps in (3, 4, 5, 6):
        yield (rng.standard_normal((8, steps, 8)).astype("float32"),
               rng.standard_normal((8, steps, 4)).astype("float32"))

for name in ("reference", sys.argv[1]):
    ops = (tf.distribute.ReductionToOneDevice() if name == "reference"
           else gs.CompressedAllReduce(name))
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((None, 8)),
                                     tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(4)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(tf.data.Dataset.from_generator(generate, output_signature=(
        tf.TensorSpec((None, None, 8)), tf.TensorSpec((None, None, 4)))), verbose=0)
    stats = ops.stats() if name != "reference" else {"steps": 0, "compression_ratio": 0}
    print("RESULT", stats["steps"], stats["compression_ratio"],
          *np.concatenate([w.ravel() for w in model.get_weights()]))
"""


@pytest.mark.parametrize("keras_version", ["keras3", "tf_keras"])
def test_fit_on_sequences_of_varying_lengths_compresses_every_kernel(keras_version):
    """`fit` traces with relaxed shapes: over sequences of varying lengths a Dense
    kernel's gradient is [None, n]. It takes its variable's shape and is bucketed and
    compressed like the rest (it was reduced exactly beside them: fp16 sent 1.05x
    fewer bytes, not 2x), and the call that meets the end of the generator's data
    counts no step."""
    out = _tf_keras.run(SEQUENCES, "fp16", legacy=keras_version == "tf_keras", timeout=300)
    reference, got = _tf_keras.lines(out)
    assert int(got[0]) == 4 and float(got[1]) == 2.0
    np.testing.assert_allclose(np.array(got[2:], float), np.array(reference[2:], float),
                               atol=2e-3)


EMBEDDING = """
import sys
import numpy as np
import tf_gradsync as gs
from tf_gradsync.bench import ops_from_spec
devices = gs.logical_cpus(2)
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.integers(0, 50, size=(64, 7)).astype("int32")
y = rng.normal(size=(64, 1)).astype("float32")
for name in ("reference", sys.argv[1], sys.argv[1] + ":sparse_as_dense=true"):
    ops = (tf.distribute.ReductionToOneDevice() if name == "reference"
           else ops_from_spec(name))
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        tf.keras.utils.set_random_seed(1)
        model = tf.keras.Sequential([tf.keras.Input((7,), dtype="int32"),
                                     tf.keras.layers.Embedding(50, 8),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    stats = (ops.stats() if name != "reference" else
             {"steps": 0, "compression_ratio": 0, "bytes_dense": 0})
    print("RESULT", stats["steps"], stats["compression_ratio"], stats["bytes_dense"],
          *np.concatenate([w.ravel() for w in model.get_weights()]))
"""


@pytest.mark.parametrize("keras_version", ["keras3", "tf_keras"])
def test_sparse_as_dense_compresses_embedding_gradients(keras_version):
    """`sparse_as_dense=True` densifies an Embedding's gradient on each replica and
    buckets it with the others: under fp16 every byte travels in 16 bits (the
    gathered rows' int32 indices kept the ratio below 2), the whole table counts as
    dense, and training follows TensorFlow's own reduction."""
    out = _tf_keras.run(EMBEDDING, "fp16", legacy=keras_version == "tf_keras", timeout=300)
    reference, gathered, dense = _tf_keras.lines(out)
    params = 50 * 8 + 7 * 8 + 1
    steps = 2 * 64 // 16
    assert int(dense[0]) == int(gathered[0]) == steps
    assert float(gathered[1]) < 2.0 and float(dense[1]) == 2.0
    # A ring over 2 replicas sends each one's whole bucket once.
    assert int(dense[2]) == steps * 4 * params
    for got in (gathered, dense):
        np.testing.assert_allclose(np.array(got[3:], float), np.array(reference[3:], float),
                                   atol=2e-3)


def test_fit_says_when_a_restore_or_a_callback_replaced_the_adapted_rate(devices, tmp_path):
    """Restoring a checkpoint of an uncompressed run into an adapted optimizer writes its
    rate (the first moment stays off), as does LearningRateScheduler with the
    uncompressed rates: the first step says so."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.normal(size=(64, 3)).astype(np.float32)

    def build(ops, optimizer):
        strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(3)])
            model.compile(optimizer(ops), "mse")
        return model

    def adapted(ops):
        return ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3))

    plain = build(gs.CompressedAllReduce("none"), adapted)     # nothing to adapt
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    resumed = build(gs.CompressedAllReduce("topk"), adapted)
    with resumed.distribute_strategy.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(str(tmp_path / "plain.weights.h5"))
    with pytest.warns(gs.compression.OptimizerAdvice, match=r"to learning rate 0.004642 .* but "
                                                            r"trains at its own, 0.001 "
                                                            r"\(beta_1=0.0 kept"):
        resumed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    scheduled = build(gs.CompressedAllReduce("topk"), adapted)
    with pytest.warns(gs.compression.OptimizerAdvice, match="but trains at its own, 0.001"):
        scheduled.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            tf.keras.callbacks.LearningRateScheduler(lambda epoch: 1e-3 * 0.9 ** epoch)])
    # Untouched, or under a callback relative to the rate it is given: as meant.
    for callbacks in ([], [tf.keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.9)]):
        untouched = build(gs.CompressedAllReduce("topk"), adapted)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gs.compression.OptimizerAdvice)
            untouched.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
