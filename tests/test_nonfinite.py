"""A NaN/Inf gradient on one replica propagates like a stock all-reduce, so Keras'
mixed-precision loss scaling skips that step, and no state stays poisoned."""


import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
import train_digits  # examples/train_digits.py
import _tf_keras  # tests/_tf_keras.py

BAD_BATCH = 2


@pytest.fixture(scope="module")
def data():
    x, _, y, _ = train_digits.load_data(0)
    x, y = x[:320].copy(), y[:320]
    x[64 * BAD_BATCH + 3, 5] = np.inf     # one sample in replica 0's shard of batch 2
    return x, y


def _fit(ops, data, devices):
    x, y = data
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=ops or tf.distribute.ReductionToOneDevice())
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = train_digits.build_model(tf.keras, seed=3)
            model.compile(tf.keras.optimizers.SGD(0.1),
                          tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
    snaps = []

    class Snap(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            snaps.append(([w.copy() for w in model.get_weights()],
                          float(model.optimizer.dynamic_scale.numpy())))

    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[Snap()])
    moved = [max(float(np.abs(a - b).max()) for a, b in zip(snaps[i][0], snaps[i - 1][0]))
             for i in range(1, len(snaps))]
    return moved, [s for _, s in snaps], model


@pytest.fixture(scope="module")
def stock(data):
    return _fit(None, data, [f"/cpu:{i}" for i in range(4)])


@pytest.mark.parametrize("name", [n for n in gs.compression.names() if n != "none"])
def test_nonfinite_gradient_skips_the_step_like_stock(name, data, stock, devices):
    stock_moved, stock_scales, _ = stock
    assert stock_moved[BAD_BATCH - 1] == 0 and min(np.delete(stock_moved, BAD_BATCH - 1)) > 0

    ops = gs.CompressedAllReduce(name)
    moved, scales, model = _fit(ops, data, devices)
    # The same step is skipped (the loss scaler saw a non-finite all-reduce result) and
    # the loss scale drops at the same point; every other step trains.
    assert moved[BAD_BATCH - 1] == 0, moved
    assert min(np.delete(moved, BAD_BATCH - 1)) > 0, moved
    assert scales == stock_scales
    assert all(np.isfinite(w).all() for w in model.get_weights())
    for key, value in ops._state.values().items():
        assert np.isfinite(value).all(), key


_TF_KERAS_SCRIPT = """
    import numpy as np
    import tensorflow as tf
    import tf_gradsync as gs
    import tf_keras as keras
    devices = gs.logical_cpus(2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 30)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    inf_on_second = x.copy()
    inf_on_second[40, 3] = np.inf            # the second replica's half of batch 0
    beyond_fp16 = x.copy()
    beyond_fp16[:64] *= 1e7                  # finite, but past fp16's range on the wire
    for name, data in [("topk", inf_on_second), ("int8", inf_on_second),
                       ("fp16", inf_on_second), ("fp16", beyond_fp16)]:
        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=gs.CompressedAllReduce(name))
        with strategy.scope():
            model = keras.Sequential([keras.Input((30,)), keras.layers.Dense(16),
                                      keras.layers.Dense(2)])
            optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.01))
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        before = [w.copy() for w in model.get_weights()]
        model.fit(data[:64], y[:64], batch_size=64, verbose=0, shuffle=False)
        skipped = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        model.fit(data[64:], y[64:], batch_size=64, verbose=0, shuffle=False)
        moved = not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        finite = all(np.isfinite(w).all() for w in model.get_weights())
        print("RESULT", name, skipped, moved, finite, float(optimizer.loss_scale))
"""


@pytest.mark.slow
def test_tf_keras_skips_what_only_another_replica_or_the_wire_makes_non_finite():
    """tf_keras decides from the reduced gradient: an Inf on the second replica only, or a
    finite gradient that the fp16 wire overflows, skips that step (the loss scale
    halves), and the next step trains. Keras 3 decides from the first replica's own
    gradient before the all-reduce (README)."""
    stdout = _tf_keras.run(_TF_KERAS_SCRIPT)
    rows = _tf_keras.lines(stdout)
    assert len(rows) == 4, stdout
    for name, skipped, moved, finite, scale in rows:
        assert (skipped, moved, finite) == ("True", "True", "True"), (name, rows)
        assert float(scale) < 32768, (name, rows)


@pytest.mark.parametrize("name", ["int8", "topk"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_stats_error_of_a_nonfinite_step_is_nan_not_zero(name, bad, devices):
    """A step whose gradient held a NaN read as a perfect 0.0 error (NaN > 0 is False)."""
    ops = gs.CompressedAllReduce(name)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    y = x.copy()
    y[7] = bad

    @tf.function
    def step(poison):
        def fn():
            ctx = tf.distribute.get_replica_context()
            bad_here = tf.logical_and(poison, tf.equal(ctx.replica_id_in_sync_group, 1))
            return ctx.all_reduce("SUM", tf.where(bad_here, tf.constant(y), tf.constant(x)))
        return strategy.run(fn)

    errors = []
    for poison in (False, True, False):
        step(tf.constant(poison))
        errors.append(ops.stats()["comm_error"])
    assert 0 < errors[0] < 1 and np.isnan(errors[1]) and errors[2] == pytest.approx(
        errors[0], rel=0.5)


def test_stats_error_of_a_finite_gradient_the_wire_overflows_is_inf(devices):
    """fp16 without its prescale casts 70000 past 65504: the gradient was finite, the
    compression's error is not, and shows as Inf (not NaN, which monitors leave out)."""
    ops = gs.CompressedAllReduce(gs.compression.get("fp16", prescale=False))
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.fill([64], 70000.0)))
    step()
    assert ops.stats()["comm_error"] == np.inf
