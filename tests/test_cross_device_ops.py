"""CompressedAllReduce against TensorFlow's ReductionToOneDevice, on 4 logical CPUs."""

import logging
import warnings

import numpy as np
import pytest
import tensorflow as tf

import _tf_keras  # tests/_tf_keras.py
import tf_gradsync as gs
from tf_gradsync.pipeline import SCOPE

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
SHAPES = [(3, 5), (7,), (), (1, 1, 2), (33, 2), (0, 4)]
TOL = {tf.float16: 2e-2, tf.bfloat16: 5e-2, tf.float32: 1e-5, tf.float64: 1e-12}


def per_replica(strategy, shape, dtype, seed):
    def fn(ctx):
        rng = np.random.default_rng(seed * 10 + ctx.replica_id_in_sync_group)
        with tf.device(strategy.extended.worker_devices[ctx.replica_id_in_sync_group]):
            return tf.identity(tf.cast(rng.normal(size=shape), dtype))
    return strategy.experimental_distribute_values_from_function(fn)


def results(value):
    return [np.asarray(tf.cast(v, tf.float64)) for v in
            (value.values if isinstance(value, tf.distribute.DistributedValues) else [value])]


def assert_close(got, want, dtype, scale=1.0):
    rel = TOL[dtype]
    for g, w in zip(results(got), results(want)):
        np.testing.assert_allclose(g, w, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "collective", "auto"])
@pytest.mark.parametrize("reduce_op", [SUM, MEAN])
@pytest.mark.parametrize("bucket_bytes", [16, 1 << 20])
def test_none_matches_reduction_to_one_device(devices, algorithm, reduce_op, bucket_bytes):
    ops = gs.CompressedAllReduce("none", algorithm=algorithm, bucket_bytes=bucket_bytes)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    dtypes = [tf.float32, tf.float64, tf.float16, tf.bfloat16]
    values = [per_replica(strategy, s, dtypes[i % 4], i) for i, s in enumerate(SHAPES * 2)]
    got = ops.batch_reduce(reduce_op, [(v, v) for v in values])
    want = tf.distribute.ReductionToOneDevice().batch_reduce(reduce_op, [(v, v) for v in values])
    for g, w, v in zip(got, want, values):
        dtype = v.values[0].dtype
        assert all(x.dtype == dtype for x in g.values), "results keep their dtype"
        assert [x.device for x in g.values] == [x.device for x in v.values]
        assert_close(g, w, dtype, scale=4)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "collective"])
def test_half_precision_within_dtype_tolerance(devices, compression, algorithm):
    ops = gs.CompressedAllReduce(compression, algorithm=algorithm, bucket_bytes=256)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    values = [per_replica(strategy, s, tf.float32, i) for i, s in enumerate(SHAPES)]
    for op in (SUM, MEAN):
        got = ops.batch_reduce(op, [(v, v) for v in values])
        want = tf.distribute.ReductionToOneDevice().batch_reduce(op, [(v, v) for v in values])
        wire = tf.float16 if compression == "fp16" else tf.bfloat16
        for g, w in zip(got, want):
            assert all(x.dtype == tf.float32 for x in g.values)
            assert_close(g, w, wire, scale=4)


def test_fp16_sums_do_not_overflow(devices):
    # 4 x 40000 = 160000 overflows float16 (max 65504) unless scaled before the cast.
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    v = strategy.experimental_distribute_values_from_function(lambda ctx: tf.fill([8], 40000.0))
    (got,) = ops.batch_reduce(SUM, [(v, v)])
    for x in got.values:
        np.testing.assert_allclose(x.numpy(), 160000.0, rtol=1e-3)


def test_indexed_slices_are_gathered_not_densified(devices):
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    def fn(ctx):
        r = ctx.replica_id_in_sync_group
        return tf.IndexedSlices(tf.fill([2, 3], float(r + 1)), tf.constant([r, 5]), tf.constant([10, 3]))
    v = strategy.experimental_distribute_values_from_function(fn)
    for op in (SUM, MEAN):
        (got,) = ops.batch_reduce(op, [(v, v)])
        (want,) = tf.distribute.ReductionToOneDevice().batch_reduce(op, [(v, v)])
        for g in got.values:
            assert isinstance(g, tf.IndexedSlices) and g.values.shape[0] == 8
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                       tf.convert_to_tensor(want.values[0]).numpy(), rtol=1e-6)


def test_destinations_that_differ_from_sources(devices):
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    v = per_replica(strategy, (6, 3), tf.float32, 7)
    want = tf.distribute.ReductionToOneDevice().reduce(SUM, v, devices[0])
    for dest in (devices[0], devices[3], "/cpu:2"):
        (got,) = ops.batch_reduce(SUM, [(v, dest)])
        assert not isinstance(got, tf.distribute.DistributedValues)
        assert tf.DeviceSpec.from_string(got.device).device_index == int(dest[-1])
        assert_close(got, want, tf.float16, scale=4)
    # Several destinations, one outside the sources.
    with tf.device(devices[1]):
        var_devices = tf.distribute.MirroredStrategy([devices[1], devices[3]])
    with var_devices.scope():
        var = tf.Variable(tf.zeros([6, 3]))
    (got,) = ops.batch_reduce(MEAN, [(v, var)])
    assert [tf.DeviceSpec.from_string(x.device).device_index for x in got.values] == [1, 3]
    for x in got.values:
        np.testing.assert_allclose(x.numpy(), want.numpy() / 2, rtol=2e-2, atol=2e-2)


def test_one_device_strategy(devices):
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices[:1], cross_device_ops=ops)
    v = per_replica(strategy, (4,), tf.float32, 3)
    (same,) = ops.batch_reduce(SUM, [(v, v)])
    np.testing.assert_array_equal(results(same)[0], results(v)[0])
    (moved,) = ops.batch_reduce(MEAN, [(v, devices[2])])
    assert moved.device.endswith("CPU:2")
    np.testing.assert_allclose(results(moved)[0], results(v)[0], rtol=1e-3)

    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            SUM, tf.constant([1.0, 2.0])))
    np.testing.assert_array_equal(step().numpy(), [1.0, 2.0])


def test_single_value_reductions_are_exact(devices):
    # Metrics and strategy.reduce are not gradients: never compressed.
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    v = per_replica(strategy, (5,), tf.float32, 11)
    want = tf.distribute.ReductionToOneDevice().reduce(SUM, v, v)
    got = ops.reduce(SUM, v, v)
    for g, w in zip(results(got), results(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    total = strategy.reduce(SUM, v, axis=None)
    np.testing.assert_allclose(total.numpy(), results(want)[0], rtol=1e-6)
    ints = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group], tf.int64))
    np.testing.assert_array_equal(results(ops.reduce(SUM, ints, ints))[0], [6])


def test_gather_and_broadcast(devices):
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([1, 2], float(ctx.replica_id_in_sync_group)))
    got = strategy.gather(v, axis=0)
    np.testing.assert_array_equal(got.numpy(), [[0, 0], [1, 1], [2, 2], [3, 3]])
    b = ops.broadcast(tf.constant([1.5, 2.5]), v)
    assert len(b.values) == 4 and all(np.allclose(x.numpy(), [1.5, 2.5]) for x in b.values)


@pytest.mark.parametrize("name", ["topk", "sign", "dgc"])
def test_two_reductions_of_one_shape_in_a_step_keep_their_own_state(devices, name):
    """Twin models of one shape reduced in one step (a GAN, twin critics, an ensemble):
    the second, whose gradient is zero, stays zero. With one state for both (keyed by
    shape alone), it received the first one's residual or momentum."""
    ops = gs.CompressedAllReduce(name)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step(seed):
        def fn():
            ctx = tf.distribute.get_replica_context()
            g = tf.random.stateless_normal([64, 50], [seed, ctx.replica_id_in_sync_group])
            first = ctx.all_reduce(SUM, [g, g[0]])
            second = ctx.all_reduce(SUM, [tf.zeros_like(g), tf.zeros_like(g[0])])
            return first, second
        return strategy.run(fn)

    for seed in range(3):
        first, second = step(tf.constant(seed))
        assert results(first[0])[0].any()
        for t in second:
            for r in results(t):
                assert not r.any(), (seed, name)
    assert ops.stats()["steps"] == 6


@pytest.mark.parametrize("name", ["topk", "sign"])
def test_models_of_one_shape_in_their_own_functions_keep_their_own_state(devices, name):
    """Models of one shape trained one after another on the same ops (folds of a
    cross-validation, a sweep), each in its own traced step: the optimizer applying the
    gradients owns its state. A model whose gradient is zero stays where it is, though
    another one left a residual before it; a model trained after the others are gone
    takes over their state, reset, instead of adding its own."""
    ops = gs.CompressedAllReduce(name)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    def trainer(scale):
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((50,)), tf.keras.layers.Dense(64)])
            optimizer = tf.keras.optimizers.SGD(0.1)

        @tf.function
        def step(seed):
            def fn():
                ctx = tf.distribute.get_replica_context()
                x = tf.random.stateless_normal([8, 50], [seed, ctx.replica_id_in_sync_group])
                with tf.GradientTape() as tape:
                    loss = scale * tf.reduce_sum(model(x) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(fn)
        return model, step

    def train(model, step, steps=3):
        before = [v.numpy() for v in model.trainable_variables]
        for seed in range(steps):
            step(tf.constant(seed))
        return max(float(np.abs(v.numpy() - b).max())
                   for v, b in zip(model.trainable_variables, before))

    a, step_a = trainer(1.0)
    assert train(a, step_a) > 0
    b, step_b = trainer(0.0)
    assert train(b, step_b) == 0.0          # nothing of a's residual
    size = len(ops._state)                   # pylint: disable=protected-access
    del a, step_a, b, step_b
    c, step_c = trainer(0.0)
    assert train(c, step_c) == 0.0
    assert len(ops._state) == size           # pylint: disable=protected-access
    assert train(c, step_c) == 0.0           # retraced or not, c keeps its slot


@pytest.mark.parametrize("name, kwargs", [("topk", {}), ("sign", {}),
                                          ("powersgd", {"start_iter": 0})])
def test_heads_of_one_shape_trained_in_turn_by_one_optimizer_keep_their_own_state(
        devices, name, kwargs):
    """One optimizer training heads of one shape in turn (tasks taking turns), each
    head's step in a trace of its own (one function retraced by a Python argument) or a
    function of its own: a head whose gradient is zero stays where it is. With the
    state keyed by the optimizer alone, it took the other head's residual."""
    ops = gs.CompressedAllReduce(gs.compression.get(name, **kwargs))
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        heads = [tf.keras.layers.Dense(64) for _ in range(3)]
        for head in heads:
            head.build((None, 50))
        optimizer = tf.keras.optimizers.SGD(0.1)
        optimizer.build([v for head in heads for v in head.trainable_variables])

    def train(head, scale, seed):
        def fn():
            ctx = tf.distribute.get_replica_context()
            x = tf.random.stateless_normal([8, 50], [seed, ctx.replica_id_in_sync_group])
            with tf.GradientTape() as tape:
                loss = scale * tf.reduce_mean(head(x) ** 2)
            variables = head.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        strategy.run(fn)

    retraced = tf.function(lambda task, seed: train(heads[task], float(task == 0), seed))
    own = tf.function(lambda seed: train(heads[2], 0.0, seed))
    before = [[v.numpy() for v in head.trainable_variables] for head in heads]
    for seed in range(3):
        retraced(0, tf.constant(seed))
        retraced(1, tf.constant(seed))
        own(tf.constant(seed))
    moved = [max(float(np.abs(v.numpy() - b).max()) for v, b in zip(head.trainable_variables, old))
             for head, old in zip(heads, before)]
    assert moved[0] > 0 and moved[1:] == [0.0, 0.0], moved


def test_heads_trained_in_turn_keep_their_own_state_under_tf_keras():
    """tf_keras hands the pairs to a helper under its optimizer's frames (and its
    legacy optimizers keep them in theirs): heads of one shape trained in turn by one
    optimizer keep their own state there too."""
    script = """
        import numpy as np, tensorflow as tf
        import tf_gradsync as gs
        devices = gs.logical_cpus(2)
        for make in (tf.keras.optimizers.SGD, tf.keras.optimizers.legacy.SGD):
            strategy = tf.distribute.MirroredStrategy(
                devices, cross_device_ops=gs.CompressedAllReduce("topk"))
            with strategy.scope():
                heads = [tf.keras.layers.Dense(64) for _ in range(2)]
                for head in heads:
                    head.build((None, 50))
                optimizer = make(0.1)
                if make is tf.keras.optimizers.SGD:     # told every head it will train
                    optimizer.build([v for head in heads for v in head.trainable_variables])

            @tf.function
            def step(task, seed):
                def fn():
                    ctx = tf.distribute.get_replica_context()
                    x = tf.random.stateless_normal([8, 50], [seed, ctx.replica_id_in_sync_group])
                    with tf.GradientTape() as tape:
                        loss = float(task == 0) * tf.reduce_mean(heads[task](x) ** 2)
                    variables = heads[task].trainable_variables
                    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
                strategy.run(fn)
            before = [v.numpy() for v in heads[1].trainable_variables]
            for seed in range(3):
                step(0, tf.constant(seed))
                step(1, tf.constant(seed))
            moved = max(float(np.abs(v.numpy() - b).max())
                        for v, b in zip(heads[1].trainable_variables, before))
            print("RESULT", make.__module__.split(".")[-2], moved)
    """
    rows = _tf_keras.lines(_tf_keras.run(script, timeout=300))
    assert [float(moved) for _, moved in rows] == [0.0, 0.0], rows


def test_a_restored_model_after_a_dropped_one_keeps_the_restored_state(devices, tmp_path):
    """A model built after another was dropped, then restored from a checkpoint (its
    optimizer has taken steps), takes over the dropped one's slot with the state the
    restore wrote; only a fresh optimizer starts it afresh."""
    ops = gs.CompressedAllReduce("topk")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    def build():
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((50,)), tf.keras.layers.Dense(64)])
            optimizer = tf.keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

        @tf.function
        def step():
            def fn():
                x = tf.random.stateless_normal(
                    [8, 50], [0, tf.distribute.get_replica_context().replica_id_in_sync_group])
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(model(x) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(fn)
        return model, optimizer, step

    def residuals():
        return {k: v for k, v in ops._state.values().items()   # pylint: disable=protected-access
                if "residual" in k}

    model, optimizer, step = build()
    for _ in range(3):
        step()
    path = tf.train.Checkpoint(model=model, optimizer=optimizer, gradsync=ops).write(
        str(tmp_path / "ckpt"))
    saved = residuals()
    assert saved and any(v.any() for v in saved.values())
    step()                                   # the state moves on past the checkpoint
    del model, optimizer, step
    model, optimizer, step = build()
    tf.train.Checkpoint(model=model, optimizer=optimizer, gradsync=ops).restore(path)
    step.get_concrete_function()             # traced: the slot taken over, not run
    restored = residuals()
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        np.testing.assert_array_equal(restored[key], value)


def test_the_guard_reports_the_buckets_of_every_reduction(devices):
    """Twin reductions of one shape have buckets of their own, and the guard's count in
    `stats()` holds both."""
    ops = gs.CompressedAllReduce("topk", guard=True)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            return [ctx.all_reduce(SUM, [tf.ones([40, 30])]) for _ in range(2)]
        return strategy.run(fn)

    step()
    assert ops.stats()["guarded_buckets"] == 2


def test_dgc_warns_once_when_no_optimizer_can_be_checked(devices):
    """Gradients all-reduced by hand, before an apply_gradients that does not aggregate:
    DGC cannot refuse an optimizer's momentum it does not see, so it says so, once."""
    ops = gs.CompressedAllReduce("dgc")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    step = tf.function(lambda: strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce(SUM, [tf.ones([40, 30])])))
    with pytest.warns(UserWarning, match="dgc applies momentum 0.9 itself.*SGD"):
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf.function(lambda: strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce(SUM, [tf.ones([4, 3])])))()


@pytest.mark.parametrize("name,warned", [("topk", True), ("fp16", False)])
def test_hand_reductions_of_one_shape_in_two_functions_are_named(devices, caplog, name,
                                                                 warned):
    """Without an optimizer to tell them apart, two functions' hand-reduced tensors of one
    shape share the state of their reductions: said once where there is state (a GAN's
    halves, each in its own step, would feed each other's residuals), not for a retrace
    or a scalar."""
    ops = gs.CompressedAllReduce(name)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    def reduce_by_hand(shape, dtype):
        def fn():
            x = tf.ones(shape, dtype)
            return tf.distribute.get_replica_context().all_reduce(SUM, [x, tf.reduce_sum(x)])
        return strategy.run(fn)

    @tf.function
    def discriminator_step(shape, retrace=0):
        del retrace
        return reduce_by_hand(shape, tf.float32)

    @tf.function
    def generator_step(shape):
        return reduce_by_hand(shape, tf.float32)

    with caplog.at_level(logging.WARNING):
        discriminator_step((40, 30))
        discriminator_step((40, 30), retrace=1)      # the same plan traced again
        generator_step((1,))                         # another plan
        assert "all-reduced by hand" not in caplog.text
        generator_step((40, 30))
        generator_step((40, 30))
    said = caplog.text.count("in functions 'discriminator_step' and 'generator_step'")
    assert said == (1 if warned else 0), caplog.text


def test_what_tensorflows_collectives_reduce_across_workers_is_counted(devices):
    """Values left to TensorFlow's collectives across workers count as they travel, per
    replica: a dense one as its ring all-reduce sends it, 2(T-1)/T of it from each of
    the T replicas (12: 4 local on each of 3 workers); an embedding gradient's indices
    and values reach the T-1 others, and count a step."""
    # pylint: disable=protected-access
    ops = gs.CompressedAllReduce("fp16")
    ops._pipeline.num_workers = 3
    from tf_gradsync import _tf_compat
    dense = _tf_compat.per_replica([tf.ones([30]) for _ in devices])
    slices = _tf_compat.per_replica([tf.IndexedSlices(tf.ones([2, 3], tf.float16),
                                                      tf.constant([0, 4]), tf.constant([10, 3]))
                                     for _ in devices])
    ops._record_collectives([dense], [dense], part_of_step=False)
    stats = ops.stats()
    assert stats["bytes_sent"] == stats["bytes_dense"] == 2 * 11 * 120 // 12
    assert stats["steps"] == 0
    ops.reset_stats()
    plain = _tf_compat.per_replica([tf.IndexedSlices(tf.cast(t.values, tf.float32), t.indices,
                                                     t.dense_shape) for t in slices.values])
    ops._record_collectives([slices], [plain], part_of_step=False)
    stats = ops.stats()
    assert stats["steps"] == 1
    assert stats["bytes_sent"] == 11 * (6 * 2 + 2 * 4)
    assert stats["bytes_dense"] == 11 * (6 * 4 + 2 * 4)


def test_dgc_says_once_that_embedding_gradients_get_none_of_its_momentum(devices):
    """Embedding gradients (IndexedSlices) go around the compressor: under DGC, whose
    adapted optimizer has no momentum, they would train without any, silently."""
    def step(ops):
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        return tf.function(lambda: strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce(
                SUM, [tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 4]),
                                       tf.constant([10, 3])), tf.ones([40, 30])])))
    dgc = step(gs.CompressedAllReduce("dgc"))
    with pytest.warns(UserWarning, match=r"embedding gradients \(IndexedSlices\).*get none.*"
                                         r"use topk"):
        dgc()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dgc()                                # once
        step(gs.CompressedAllReduce("topk", error_feedback=True))()
    # Densified, the table's gradient goes through dgc with the others.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(gs.CompressedAllReduce("dgc", sparse_as_dense=True))()
    assert not [w for w in seen if "IndexedSlices" in str(w.message)]
    ops = gs.CompressedAllReduce("none", sparse_as_dense=True)
    table, _ = step(ops)()
    expected = np.zeros([10, 3])
    expected[[0, 4]] = len(devices)
    for t in results(table):
        assert not isinstance(t, tf.IndexedSlices)
        np.testing.assert_array_equal(t, expected)
    assert ops.stats()["last_bytes_dense"] == 4 * (10 * 3 + 40 * 30) * 2 * (len(devices) - 1) \
        // len(devices)
    # Slices of no known dense shape cannot be densified: they are gathered as they are.
    from tf_gradsync import _tf_compat
    from tf_gradsync.cross_device_ops import _densified
    shapeless = _tf_compat.per_replica([tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 4]))
                                        for _ in devices])
    assert _densified(shapeless) is shapeless


def test_a_scalar_reduced_by_hand_is_exact_and_counts_no_step(devices):
    """The loss all-reduced besides the gradients (a habit from Horovod): exact, and not
    a step, so it neither moves `warmup_steps` on nor replaces the last step's stats."""
    ops = gs.CompressedAllReduce("topk", warmup_steps=2)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            grads = ctx.all_reduce(SUM, [tf.fill([40, 30], r)])
            loss = ctx.all_reduce(SUM, 0.1 * r + 1.0 / 3)
            return grads, loss
        return strategy.run(fn)

    for _ in range(2):
        grads, loss = step()
        for t in results(loss):
            np.testing.assert_allclose(t, 0.6 + 4 / 3, rtol=1e-6)
        # Still within the warm-up: the gradients too are exact.
        np.testing.assert_allclose(results(grads[0])[0], 6.0)
    stats = ops.stats()
    assert stats["steps"] == 2 and stats["last_bytes_dense"] > 1000


def test_sums_inside_a_layer_and_their_gradients_are_exact(devices):
    """A layer that sums activations over the replicas (as a synchronized batch norm
    does) and the gradient of that sum (an all-reduce inside the tape's gradient):
    exact under sign compression, and no step."""
    ops = gs.CompressedAllReduce("sign")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    class Summed(tf.keras.layers.Layer):
        def call(self, x):
            return tf.distribute.get_replica_context().all_reduce(SUM, x)

    layer = Summed()
    rows = np.random.default_rng(3).normal(size=(2, 4, 50)).astype(np.float32)

    @tf.function
    def step():
        def fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            x, w = tf.gather(rows[0], r), tf.gather(rows[1], r)
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(w * y)
            return y, tape.gradient(loss, x)
        return strategy.run(fn)

    y, dx = step()
    for t in results(y):
        np.testing.assert_allclose(t, rows[0].sum(0), rtol=1e-5, atol=1e-5)
    for t in results(dx):
        np.testing.assert_allclose(t, rows[1].sum(0), rtol=1e-5, atol=1e-5)
    assert ops.stats()["steps"] == 0


def test_a_layer_running_on_another_thread_leaves_gradients_compressed(devices):
    """Only the threads of the reduction tell what it sums: a layer busy on another
    thread (a dataset's worker, another model) does not make gradients exact."""
    import threading
    ops = gs.CompressedAllReduce("sign")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    entered, release = threading.Event(), threading.Event()

    class Waiting(tf.keras.layers.Layer):
        def call(self, x):
            entered.set()
            release.wait(60)
            return x

    busy = threading.Thread(target=lambda: Waiting()(tf.ones([2])))
    busy.start()
    try:
        assert entered.wait(60)

        @tf.function
        def step():
            def fn():
                r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                            tf.float32)
                return tf.distribute.get_replica_context().all_reduce(
                    SUM, [tf.range(40.0) * (r + 1.0)])
            return strategy.run(fn)
        (got,) = step()
    finally:
        release.set()
        busy.join()
    assert ops.stats()["steps"] == 1
    assert not np.allclose(results(got)[0], np.arange(40.0) * 10)     # sign-compressed


def test_repeated_calls_and_retracing_in_tf_function(devices):
    ops = gs.CompressedAllReduce("none", bucket_bytes=64)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step(x):
        def fn(x):
            ctx = tf.distribute.get_replica_context()
            r = tf.cast(ctx.replica_id_in_sync_group + 1, x.dtype)
            a = ctx.all_reduce(SUM, [x * r, 2 * x * r])
            b = ctx.all_reduce(MEAN, a[0] * r)
            return a[1], b
        return strategy.run(fn, args=(x,))

    for shape in [(3,), (3,), (5, 2), (40,)]:
        x = tf.ones(shape)
        a1, b = step(x)
        for t in strategy.experimental_local_results(a1):
            np.testing.assert_allclose(t.numpy(), 20.0, rtol=1e-6)
        for t in strategy.experimental_local_results(b):
            np.testing.assert_allclose(t.numpy(), 25.0, rtol=1e-6)
    assert step.experimental_get_tracing_count() == 3
    assert ops.stats()["steps"] == 8


@pytest.mark.parametrize("compression,ratio", [("none", 1.0), ("fp16", 2.0), ("bf16", 2.0)])
def test_stats_count_payload_bytes(devices, compression, ratio):
    ops = gs.CompressedAllReduce(compression, bucket_bytes=1 << 20, algorithm="ring")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    values = [per_replica(strategy, (1000,), tf.float32, 0), per_replica(strategy, (24,), tf.float32, 1)]
    ops.batch_reduce(SUM, [(v, v) for v in values])
    ops.batch_reduce(SUM, [(v, v) for v in values])
    s = ops.stats()
    dense = 2 * 3 * 1024 * 4 // 4         # ring: 2(N-1)/N of a 1024-float bucket per replica
    assert s["steps"] == 2
    assert s["last_bytes_dense"] == dense and s["bytes_dense"] == 2 * dense
    assert s["last_bytes_sent"] == dense / ratio
    assert s["compression_ratio"] == pytest.approx(ratio)
    ops.reset_stats()
    assert ops.stats()["bytes_sent"] == 0


def test_reset_stats_leaves_the_compressors_schedules_running(devices):
    """Zeroing the counters (bytes per epoch) does not restart a warm-up: a dense
    warm-up of 3 steps runs once, and the steps reported count from the reset."""
    ops = gs.CompressedAllReduce("topk", warmup_steps=3)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    value = per_replica(strategy, (64, 64), tf.float32, 0)
    sent = []
    for i in range(8):
        if i == 5:
            ops.reset_stats()
            assert ops.stats()["steps"] == 0 and ops.stats()["bytes_sent"] == 0
        ops.batch_reduce(SUM, [(value, value)])
        sent.append(ops.stats()["last_bytes_sent"])
    assert sent[0] == sent[1] == sent[2] > 4 * sent[3]          # dense, then top-k
    assert sent[3:] == [sent[3]] * 5                             # no second warm-up
    assert ops.stats()["steps"] == 3
    assert ops.stats()["bytes_sent"] == 3 * sent[3]
    ops.start_at_step(100)
    assert ops.stats()["steps"] == 100
    ops.reset_stats()
    # A counter restored from before the reset (an older checkpoint) counts whole.
    ops._state.assign({"stats_steps": 40})  # pylint: disable=protected-access
    assert ops.stats()["steps"] == 40


def _crossing_edges(graph):
    """(tensor, src device, dst device) for edges into our ops that change device."""
    def dev(d):
        return tf.DeviceSpec.from_string(d).to_string() if d else ""
    edges = []
    for op in graph.get_operations():
        if f"{SCOPE}/" not in op.name and not op.name.startswith(SCOPE):
            continue
        for t in op.inputs:
            a, b = dev(t.op.device), dev(op.device)
            if a and b and a != b:
                edges.append((t, a, b))
            if op.type in ("CollectiveReduceV2", "CollectiveGatherV2") and t is op.inputs[0]:
                edges.append((t, b, "collective"))
    return edges


def _traced_train_step(strategy, widths):
    """The graph of one SGD step of Dense layers of `widths` on 8 inputs."""
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,))]
                                    + [tf.keras.layers.Dense(w) for w in widths])
        opt = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(x):
        def fn(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn, args=(x,))

    return train_step.get_concrete_function(tf.TensorSpec([2, 8])).graph


@pytest.mark.parametrize("algorithm", ["ring", "tree", "collective"])
def test_traced_graph_sends_float16_payloads(devices, algorithm):
    ops = gs.CompressedAllReduce("fp16", algorithm=algorithm, bucket_bytes=4096)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    graph = _traced_train_step(strategy, [16, 4])
    edges = _crossing_edges(graph)
    assert edges, "the gradient all-reduce must move data between devices"
    floats = [t for t, _, _ in edges if t.dtype.is_floating]
    assert floats and all(t.dtype == tf.float16 for t in floats), \
        {t.dtype.name for t in floats}
    # Every float32 gradient element crosses only as half of its bytes.
    others = [t for t, _, _ in edges if not t.dtype.is_floating]
    assert all(t.shape.num_elements() is not None and t.shape.num_elements() <= 2 for t in others)


def _ancestors(ops):
    seen, todo = set(), list(ops)
    while todo:
        op = todo.pop()
        for src in [t.op for t in op.inputs] + list(op.control_inputs):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def test_a_bucket_waits_only_for_its_own_gradients(devices):
    """Buckets hold the last layers first and have no edges between them, so the
    exchange of the last layer's bucket does not wait for the first layer's gradient:
    it can run while backpropagation goes on (BENCHMARKS.md, timeline)."""
    ops = gs.CompressedAllReduce("none", bucket_bytes=1)     # one tensor per bucket
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    graph = _traced_train_step(strategy, [16, 16, 4])
    scope = {b: [op for op in graph.get_operations() if f"gradsync/bucket_{b}/" in op.name]
             for b in range(6)}
    assert all(scope.values()), {b: len(v) for b, v in scope.items()}
    # The backward ops each bucket's exchange waits for.
    waits = {b: {op for op in _ancestors(v) if op.name.startswith("gradient_tape/")}
             for b, v in scope.items()}
    # Planned in reverse: bucket 0 is the last layer's bias, bucket 5 the first kernel
    # (and its gradient a MatMul on both replicas) that bucket 0 does not wait for.
    later = waits[5] - waits[0]
    assert sum(op.type == "MatMul" for op in later) >= 2, sorted(op.name for op in later)
    assert len(waits[0]) < len(waits[5])


@pytest.mark.parametrize("kwargs,match", [
    (dict(algorithm="butterfly"), "unknown algorithm 'butterfly'; valid algorithms: auto, collective, ring, tree"),
    (dict(bucket_bytes=0), "bucket_bytes must be a positive integer, got 0"),
    (dict(bucket_bytes=-5), "got -5"),
    (dict(compression="zip"), "unknown compressor 'zip'; valid names: .*fp16"),
    (dict(compression=gs.compression.TopK), r"pass an instance, TopK\(\.\.\.\), or a "),
    (dict(timeout_seconds=-1), "timeout_seconds"),
    (dict(error_feedback="yes"), "error_feedback"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gs.CompressedAllReduce(**kwargs)


def test_non_floating_compressor_input():
    c = gs.compression.get("fp16")
    with pytest.raises(ValueError, match="needs floating input.*got int32"):
        c.check_input(tf.constant([1, 2, 3]))
    with pytest.raises(ValueError, match="unknown arguments"):
        gs.compression.get("fp16", ratio=0.1)


@pytest.mark.parametrize("name", ["int8", "sign", "topk"])
def test_collective_gathers_narrow_payloads_bit_for_bit(devices, name):
    # CollectiveGatherV2 has no 8-bit kernels: payloads travel packed into int32 words.
    got = []
    for algorithm in ("collective", "ring"):
        ops = gs.CompressedAllReduce(name, algorithm=algorithm, timeout_seconds=60)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

        def fn():
            ctx = tf.distribute.get_replica_context()
            seed = tf.stack([ctx.replica_id_in_sync_group, 1])
            return ctx.all_reduce(SUM, tf.random.stateless_normal([1001], seed))
        out = tf.function(lambda: strategy.run(fn))()
        got.append((strategy.experimental_local_results(out)[0].numpy(),
                    ops.stats()["last_bytes_sent"]))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    # The same bytes, but for the padding of each payload tensor to whole words (under
    # 4 bytes per tensor, at most three, per copy sent).
    n = len(devices)
    assert got[1][1] <= got[0][1] < got[1][1] + 4 * 3 * n * (n - 1)


@pytest.mark.parametrize("name", ["topk", "randomk", "adaptive", "fp16"])
def test_bucket_of_zero_size_tensors_is_not_exchanged(name, devices):
    ops = gs.CompressedAllReduce(name, bucket_bytes=16)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def run():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", [tf.zeros([0, 3]), tf.ones([4])]))

    empty, ones = run()
    for t in strategy.experimental_local_results(empty):
        assert t.shape == (0, 3)
    assert np.isfinite(strategy.experimental_local_results(ones)[0].numpy()).all()


def test_an_integer_mean_of_zero_size_tensors_is_a_float_as_tensorflows(devices):
    """A bucket of zero-size tensors skips the exchange but not the reduction's dtype:
    an integer mean comes back float64, as TensorFlow's own ops give it."""
    ops = gs.CompressedAllReduce("none", bucket_bytes=4)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, shape=shape: tf.ones(shape, tf.int64)) for shape in ([0], [3])]
    got = ops.batch_reduce(MEAN, [(v, v) for v in values])
    want = tf.distribute.ReductionToOneDevice().batch_reduce(MEAN, [(v, v) for v in values])
    assert [g.values[0].dtype for g in got] == [w.values[0].dtype for w in want] \
        == [tf.float64, tf.float64]


@pytest.mark.parametrize("name", ["fp16", "topk"])
def test_eager_collective_after_a_graph_collective(name, devices):
    # Eager calls build their collectives into one function with inputs placed first;
    # they must not wait on a graph-mode collective launched earlier in the process.
    ops = gs.CompressedAllReduce(gs.compression.get(name), algorithm="collective",
                                 error_feedback=False, timeout_seconds=60)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def graph_step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.ones([8])))

    assert strategy.experimental_local_results(graph_step())[0].numpy()[0] == 4.0
    value = strategy.run(lambda: tf.range(8, dtype=tf.float32) * tf.cast(
        tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
    (reduced,) = ops.batch_reduce("SUM", [(value, value)])
    want = np.arange(8, dtype=np.float32) * 10    # 1 + 2 + 3 + 4
    if name == "topk":             # keeps the largest entry of 8 (ratio 1%: k = 1)
        want = np.where(np.arange(8) == 7, want, 0)
    for got in strategy.experimental_local_results(reduced):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-3)


# ------------------------------------------------------------ TensorFlow's contract
@pytest.mark.parametrize("compression", ["none", "topk"])
def test_all_reduce_of_unknown_static_shape_in_tf_function(devices, compression):
    """A `None` batch dimension cannot be bucketed: the value is summed exactly."""
    ops = gs.CompressedAllReduce(compression)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x):
        def fn(x):
            ctx = tf.distribute.get_replica_context()
            r = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            return ctx.all_reduce(MEAN, x * r), ctx.all_reduce(SUM, tf.reduce_sum(x * r, 0))
        return strategy.run(fn, args=(x,))
    dynamic, static = step(tf.ones([5, 3]))
    for v in strategy.experimental_local_results(dynamic):
        np.testing.assert_allclose(v.numpy(), np.full([5, 3], 2.5))
    for v in strategy.experimental_local_results(static):
        # Known shape: bucketed and compressed (top-k keeps 1 of 3 entries per replica).
        want = [50.0] * 3 if compression == "none" else [50.0, 0.0, 0.0]
        np.testing.assert_allclose(v.numpy(), want)


@pytest.mark.parametrize("dtype", [tf.int64, tf.int32, tf.int8])
def test_integer_mean_divides_as_tensorflow_does(devices, dtype):
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group + 1, 7], dtype))
    want = tf.distribute.ReductionToOneDevice().batch_reduce(MEAN, [(v, v)])[0]
    for reduce in (lambda: ops.batch_reduce(MEAN, [(v, v)])[0], lambda: ops.reduce(MEAN, v, v)):
        got = reduce()
        for g, w in zip(got.values, want.values):
            assert g.dtype == w.dtype          # float64 for int32/int64, float32 for int8
            np.testing.assert_array_equal(g.numpy(), w.numpy())
            np.testing.assert_array_equal(g.numpy(), [1.5, 7.0])


def test_batch_reduce_of_values_on_different_device_sets(devices):
    ops = gs.CompressedAllReduce("none")
    pairs, want = [], []
    for group in (devices[:2], devices[2:], devices[1:]):
        strategy = tf.distribute.MirroredStrategy(group)
        v = per_replica(strategy, (4,), tf.float32, len(pairs))
        pairs.append((v, v))
        want.append(tf.distribute.ReductionToOneDevice().reduce(SUM, v, v))
    got = ops.batch_reduce(SUM, pairs)
    for g, w, (v, _) in zip(got, want, pairs):
        assert [x.device for x in g.values] == [x.device for x in v.values]
        assert_close(g, w, tf.float32)


@pytest.mark.parametrize("compression", ["none", "fp16", "topk", "sign"])
def test_stats_report_the_compression_error_of_what_was_sent(devices, compression):
    """comm_error = ||x - C(x)|| / ||x|| over buckets and replicas, x what each replica
    compressed; checked against numpy models of the first step (zero residuals)."""
    ops = gs.CompressedAllReduce(compression, bucket_bytes=1024)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    shapes = [(40, 10), (10,), (300,)]
    values = [per_replica(strategy, s, tf.float32, i) for i, s in enumerate(shapes)]
    assert ops.stats()["comm_error"] == 0.0
    ops.batch_reduce(SUM, [(v, v) for v in values])
    err = norm = 0.0
    for v in values:
        for x in results(v):
            x = x.ravel()
            if compression == "none":
                c = x
            elif compression == "fp16":     # prescaled by 1/N, rounded to float16
                x = x / 4
                c = x.astype(np.float16).astype(np.float64)
            elif compression == "topk":     # per tensor, k = ceil(1%)
                c = np.zeros_like(x)
                keep = np.argsort(-np.abs(x), kind="stable")[:max(1, int(np.ceil(0.01 * x.size)))]
                c[keep] = x[keep]
            else:                           # blocks of 16, rms scale in bfloat16
                c = np.concatenate([np.where(b >= 0, 1, -1) * float(tf.cast(
                    np.sqrt(np.mean(b ** 2)), tf.bfloat16)) for b in np.split(
                        x, range(16, x.size, 16))])
            err += np.sum((x - c) ** 2)
            norm += np.sum(x ** 2)
    got = ops.stats()["comm_error"]
    assert got == pytest.approx(np.sqrt(err / norm), rel=1e-4, abs=1e-7)
    assert (got == 0) == (compression == "none")


def _embedding_gradient(strategy):
    """A PerReplica IndexedSlices: 3 rows of a [10, 4] table per replica, one row each
    replica's own, two shared."""
    def fn(ctx):
        r = ctx.replica_id_in_sync_group
        with tf.device(strategy.extended.worker_devices[r]):
            return tf.IndexedSlices(tf.fill([3, 4], 1.0 + r / 3), tf.constant([r, 5, 9]),
                                    tf.constant([10, 4]))
    return strategy.experimental_distribute_values_from_function(fn)


@pytest.mark.parametrize("compression,wire", [("fp16", tf.float16), ("bf16", tf.bfloat16),
                                              ("topk", tf.float32)])
def test_indexed_slices_values_travel_in_the_wire_dtype(devices, compression, wire):
    """Embedding gradients stay sparse; fp16/bf16 send their values in 16 bits (every
    replica, its own part included, so all hold the same result)."""
    ops = gs.CompressedAllReduce(compression)
    v = _embedding_gradient(tf.distribute.MirroredStrategy(devices, cross_device_ops=ops))
    (got,) = ops.batch_reduce(SUM, [(v, v)])
    want = tf.convert_to_tensor(
        tf.distribute.ReductionToOneDevice().batch_reduce(SUM, [(v, v)])[0].values[0]).numpy()
    first = tf.convert_to_tensor(got.values[0]).numpy()
    for g in got.values:
        assert isinstance(g, tf.IndexedSlices) and g.values.dtype == tf.float32
        np.testing.assert_array_equal(tf.convert_to_tensor(g).numpy(), first)
    np.testing.assert_allclose(first, want, rtol=2 ** -7)
    # 4 destinations x 3 other replicas x (12 values + 3 int32 indices), per replica.
    s = ops.stats()
    assert s["bytes_sent"] == 3 * (12 * wire.size + 3 * 4)
    assert s["bytes_dense"] == 3 * (12 * 4 + 3 * 4)
    # Embedding gradients alone are a step: the per-step counters read it.
    assert (s["steps"], s["last_bytes_sent"], s["bytes_sent_per_step"]) == (
        1, s["bytes_sent"], s["bytes_sent"])


class _RecordingOps(tf.distribute.ReductionToOneDevice):
    """Stands in for the multi-worker strategy's own collectives: records the dtypes of
    the IndexedSlices values handed to it, then reduces them exactly."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        for value, _ in value_destination_pairs:
            self.dtypes += [s.values.dtype for s in value.values]
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


@pytest.mark.parametrize("compression,wire", [("fp16", tf.float16), ("bf16", tf.bfloat16),
                                              ("topk", tf.float32), ("none", tf.float32)])
def test_indexed_slices_across_workers_travel_in_the_wire_dtype(devices, compression, wire):
    """Across workers IndexedSlices go through TensorFlow's collectives (the strategy's
    exact ops); under fp16/bf16 their values enter them in 16 bits and come back in
    the gradient's dtype."""
    ops = gs.CompressedAllReduce(compression)
    exact = _RecordingOps()
    ops.join_cluster(1, exact)
    v = _embedding_gradient(tf.distribute.MirroredStrategy(devices, cross_device_ops=ops))
    for op in (SUM, MEAN):
        exact.dtypes.clear()
        (got,) = ops.batch_reduce(op, [(v, v)])
        want = tf.convert_to_tensor(
            tf.distribute.ReductionToOneDevice().batch_reduce(op, [(v, v)])[0].values[0])
        assert exact.dtypes == [wire] * len(devices)
        for g in got.values:
            assert isinstance(g, tf.IndexedSlices) and g.values.dtype == tf.float32
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want.numpy(),
                                       rtol=0 if wire == tf.float32 else 2 ** -7)


@pytest.mark.parametrize("name,algorithm", [("none", "ring"), ("fp16", "collective"),
                                            ("topk", "ring")])
def test_gradients_handed_to_another_function_reduce_on_the_strategys_devices(
        devices, name, algorithm):
    """Gradients computed in one traced function and applied in another (manual
    gradient accumulation) arrive there as placeholders without devices: they are
    placed on the strategy's devices, in replica order, and reduce as TensorFlow's own
    ops reduce them."""
    ops = gs.CompressedAllReduce(name, algorithm=algorithm, timeout_seconds=60)
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    with strategy.scope():
        w = tf.Variable(tf.zeros([4]))
        optimizer = tf.keras.optimizers.SGD(1.0)
        optimizer.build([w])

    @tf.function
    def compute():
        return strategy.run(lambda: tf.constant([1.0, 2.0, 4.0, 8.0]) * tf.cast(
            tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))

    @tf.function
    def apply(grads):
        strategy.run(lambda g: optimizer.apply_gradients([(g, w)]), args=(grads,))

    apply(compute())
    want = -3.0 * np.array([1.0, 2.0, 4.0, 8.0])       # replicas 1 and 2 summed
    if name == "topk":                                   # 1% of 4 entries: the largest
        want = np.where(np.arange(4) == 3, want, 0.0)
    for v in strategy.experimental_local_results(w):
        np.testing.assert_allclose(v.numpy(), want)
    assert ops.stats()["steps"] == 1


def test_values_without_devices_are_refused_rather_than_left_waiting(devices):
    """Per-replica values handed to a tf.function as arguments arrive as placeholders
    without devices; every replica's collective would land on one unnamed device and
    wait for the others forever. Outside a strategy of as many devices, the reduction
    refuses them, naming the devices."""
    ops = gs.CompressedAllReduce("fp16", algorithm="collective", timeout_seconds=30)
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    value = per_replica(strategy, (4,), tf.float32, 0)
    step = tf.function(lambda v: ops.batch_reduce(SUM, [(v, v)]))
    with pytest.raises(ValueError, match=r"must carry its device, got devices \('', ''\)"):
        step(value)
    # Captured, the same values keep their devices and reduce.
    (got,) = tf.function(lambda: ops.batch_reduce(SUM, [(value, value)]))()
    assert_close(got, tf.distribute.ReductionToOneDevice().batch_reduce(SUM, [(value, value)])[0],
                 tf.float16, scale=4.0)


@pytest.mark.parametrize("name", ["sign", "topk", "int8", "qsgd", "adaptive"])
def test_a_reduction_run_eagerly_matches_its_function(devices, name, monkeypatch):
    """A step run eagerly (to debug it) reduces as its `tf.function` does, without
    tracing and compiling the codecs anew at every call (TensorFlow's retracing
    warning each step, seconds per call)."""
    from tf_gradsync.compression import xla

    class Traces:       # counts what `xla.call` traces (its depth set above 0)
        count = 0

        @property
        def depth(self):
            return self.__dict__.get("d", 0)

        @depth.setter
        def depth(self, value):
            Traces.count += value > self.depth
            self.__dict__["d"] = value

    def reduce(eager):
        ops = gs.CompressedAllReduce(name, algorithm="ring")
        strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)

        def step():
            def fn():
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                # Large enough a bucket to compile (`xla.MIN_COMPILED_NUMEL`).
                return tf.random.stateless_normal([300, 220], (r, 7))
            per_replica = strategy.run(fn)
            return strategy.extended.batch_reduce_to(SUM, [(per_replica, per_replica)])
        run = step if eager else tf.function(step)
        return [results(run()[0])[0] for _ in range(3)]
    monkeypatch.setattr(xla, "_tracing", Traces())
    eager = reduce(True)
    assert Traces.count == 0
    compiled = reduce(False)
    assert Traces.count > 0       # the function compiles its codecs, once
    # Sign's scales are bfloat16: block norms that XLA and TensorFlow round differently
    # in float32 can land a scale one bfloat16 step (2^-8 of it) apart.
    rtol = 2.0 ** -7 if name == "sign" else 1e-5
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(a).max())
