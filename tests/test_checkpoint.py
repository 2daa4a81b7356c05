"""Compression state survives checkpoints: an interrupted and resumed run reproduces
the uninterrupted one (tf.train.Checkpoint, model.save_weights, BackupAndRestore)."""

import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import _regression  # tests/_regression.py
import _worker  # tests/_worker.py
import _tf_keras  # tests/_tf_keras.py
import tf_gradsync as gs
import train_digits  # examples/train_digits.py

BATCH = 64
# Compressors whose results depend on state or on the step counter, with settings that
# keep state busy on this small model.
# (qsgd's per-step seed is randomk's; top-k's error-feedback residual is adaptive's, and
# dgc's u and v are per-bucket vectors like it, which the multi-worker resume also
# restores in two phases.)
STATEFUL = {
    "randomk": {"ratio": 0.25},     # per-step shared seed (step counter)
    "powersgd": {"rank": 2},        # warm-start Q and residual
    "adaptive": {},                 # residual, and decisions from the reduced sum: counters, a level
}


@pytest.fixture(scope="module")
def data():
    x_train, x_test, y_train, y_test = train_digits.load_data(0)
    return x_train[:384], y_train[:384]


def _strategy(name, devices):
    ops = gs.CompressedAllReduce(gs.compression.get(name, **STATEFUL.get(name, {})))
    return ops, tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)


def _model(strategy, ops):
    with strategy.scope():
        model = train_digits.build_model(tf.keras, seed=3)
    gs.track_state(model, ops)
    return model


def _batches(x, y):
    return train_digits.batches(x, y, BATCH)


def _state_values(ops):
    return {k: v for k, v in ops._state.values().items() if not k.startswith("stats_bytes")}


class _Interrupt(tf.keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"interrupted after epoch {epoch}")


def _assert_same(a_model, a_ops, b_model, b_ops):
    for wa, wb in zip(a_model.get_weights(), b_model.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-6)
    sa, sb = _state_values(a_ops), _state_values(b_ops)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_backup_and_restore_resumes_exactly(name, data, devices, tmp_path):
    x, y = data
    epochs = 3
    # One repeated pipeline per fit (its epochs are passes over the data, as with arrays).
    steps_per_epoch = train_digits.steps_per_epoch(len(x), BATCH)

    ops, strategy = _strategy(name, devices)
    model = _model(strategy, ops)
    model.fit(_batches(x, y), steps_per_epoch=steps_per_epoch, epochs=epochs, shuffle=False,
              verbose=0)

    backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    ops1, strategy1 = _strategy(name, devices)
    first = _model(strategy1, ops1)
    with pytest.raises(KeyboardInterrupt):
        first.fit(_batches(x, y), steps_per_epoch=steps_per_epoch, epochs=epochs, shuffle=False,
                  verbose=0, callbacks=[backup, _Interrupt(1)])
    assert ops1.stats()["steps"] == 2 * int(np.ceil(len(x) / BATCH))   # stopped after 2 epochs

    ops2, strategy2 = _strategy(name, devices)
    resumed = _model(strategy2, ops2)
    resumed.fit(_batches(x, y), steps_per_epoch=steps_per_epoch, epochs=epochs, shuffle=False,
                verbose=0,
                callbacks=[tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    steps = epochs * int(np.ceil(len(x) / BATCH))
    assert ops.stats()["steps"] == ops2.stats()["steps"] == steps
    _assert_same(model, ops, resumed, ops2)


def test_save_weights_carries_state(data, devices, tmp_path):
    x, y = data
    ops, strategy = _strategy("topk", devices)
    model = _model(strategy, ops)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)

    ops2, strategy2 = _strategy("topk", devices)
    restored = _model(strategy2, ops2)
    with strategy2.scope():
        restored.optimizer.build(restored.trainable_variables)   # Keras loads built optimizers only
    restored.load_weights(path)      # before the first step: the state does not exist yet
    assert len(ops2._state) == 0
    # One more epoch on each continues identically: residuals and step counter came back.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same(model, ops, restored, ops2)
    # Loading into ops whose variables exist assigns them in place.
    restored.load_weights(path)
    assert _state_values(ops2)["stats_steps"] == int(np.ceil(len(x) / BATCH))


def test_a_keras_file_loaded_brings_its_state_back_through_load_weights(data, devices,
                                                                        tmp_path):
    """`load_model` reads only what the rebuilt model has; tracked, then loaded again with
    `load_weights` from the same file, the model resumes as the saved one continues."""
    x, y = data
    ops, strategy = _strategy("topk", devices)
    model = _model(strategy, ops)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)

    ops2, strategy2 = _strategy("topk", devices)
    with strategy2.scope():
        loaded = tf.keras.models.load_model(path)
    gs.track_state(loaded, ops2)
    loaded.load_weights(path)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same(model, ops, loaded, ops2)


def test_an_optimizer_resuming_without_its_compression_state_is_warned_of(devices, tmp_path,
                                                                          caplog):
    """A checkpoint restored into new objects while those that trained live on (a
    notebook's history holds them): the new optimizer's compression state starts from
    initial values, and what the restore wrote stays with the old one. Or model and
    optimizer restored without the ops. Both were silent; a resume into the same objects,
    or with the ops' state, is not warned of."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    y = rng.normal(size=(64, 4)).astype(np.float32)

    def setup(ops):
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        model, opt = _regression.model_and_optimizer(strategy, 12, 4, hidden=16, seed=5)
        step = _regression.train_step(strategy, model, opt)
        return model, opt, lambda: step(*next(iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32)))))

    def warned(run):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run()
        return caplog.text

    ops = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.25))
    model, opt, step = setup(ops)
    assert "tf_gradsync: an optimizer" not in warned(step) + warned(step)
    path = tf.train.Checkpoint(model=model, optimizer=opt, gradsync=ops).write(
        str(tmp_path / "ckpt"))
    # Into the same objects: their slot holds what the restore wrote.
    tf.train.Checkpoint(model=model, optimizer=opt, gradsync=ops).restore(path)
    assert "tf_gradsync: an optimizer" not in warned(step)

    model2, opt2, step2 = setup(ops)
    tf.train.Checkpoint(model=model2, optimizer=opt2, gradsync=ops).restore(path)
    assert "has taken 2 steps (restored from a checkpoint?) reduces tensors whose " \
           "compression state belongs to another optimizer of this process" in warned(step2)

    ops3 = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.25))
    model3, opt3, step3 = setup(ops3)
    tf.train.Checkpoint(model=model3, optimizer=opt3).restore(path)
    assert "no compression state was restored for its tensors" in warned(step3)

    ops4 = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.25))
    model4, opt4, step4 = setup(ops4)
    tf.train.Checkpoint(model=model4, optimizer=opt4, gradsync=ops4).restore(path)
    assert "tf_gradsync: an optimizer" not in warned(step4)
    # A compressor that keeps no state (QSGD: unbiased, no error feedback, none at the
    # owners of two phases either) has nothing to resume.
    ops5 = gs.CompressedAllReduce("qsgd", exchange="two_phase")
    model5, opt5, step5 = setup(ops5)
    tf.train.Checkpoint(model=model5, optimizer=opt5).restore(path)
    assert "tf_gradsync: an optimizer" not in warned(step5)
    del model, opt, step

    # Two models of one shape with optimizers of their own (an ensemble), resumed in the
    # saved run's order: each takes the state restored for it.
    ops5 = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.25))
    (ma, oa, sa), (mb, ob, sb) = setup(ops5), setup(ops5)
    sa(), sb()
    saved = tf.train.Checkpoint(a=ma, oa=oa, b=mb, ob=ob, gradsync=ops5).write(
        str(tmp_path / "pair"))
    ops6 = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.25))
    (ma, oa, sa), (mb, ob, sb) = setup(ops6), setup(ops6)
    tf.train.Checkpoint(a=ma, oa=oa, b=mb, ob=ob, gradsync=ops6).restore(saved)
    text = warned(sa) + warned(sb)
    assert "tf_gradsync: an optimizer" not in text
    # The first model's step resumed; the second's state waits for its own step, which
    # takes it: no warning that the first starts over.
    assert "loaded state values are of another compressor" not in text


def test_tf_train_checkpoint_custom_loop_resumes_exactly(devices, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 12)).astype(np.float32)
    y = rng.normal(size=(256, 4)).astype(np.float32)

    def setup():
        ops = gs.CompressedAllReduce(gs.compression.get("powersgd", rank=2))
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        model, opt = _regression.model_and_optimizer(strategy, 12, 4, hidden=48, seed=5)
        step = _regression.train_step(strategy, model, opt)

        def run(steps):
            ds = strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat().take(steps))
            for bx, by in ds:
                step(bx, by)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt, gradsync=ops)
        return ops, model, run, ckpt

    ops, model, run, _ = setup()
    run(8)
    run(8)

    ops1, _, run1, ckpt1 = setup()
    run1(8)
    path = ckpt1.save(str(tmp_path / "ckpt"))

    ops2, model2, run2, ckpt2 = setup()
    ckpt2.restore(path).assert_existing_objects_matched()
    run2(8)
    _assert_same(model, ops, model2, ops2)
    assert any(k.endswith("_q") or "_q" in k for k in _state_values(ops2)), _state_values(ops2).keys()


@pytest.mark.slow
def test_tf_keras_checkpoint_carries_state(tmp_path):
    script = f"""
        import os, sys
        import numpy as np
        import tensorflow as tf
        import tf_gradsync as gs
        import train_digits
        import tf_keras
        assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras")
        gs.logical_cpus(2)
        x, _, y, _ = train_digits.load_data(0)
        x, y = x[:256], y[:256]

        def setup():
            ops = gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.05))
            strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
            with strategy.scope():
                model = train_digits.build_model(tf.keras, seed=3)
            gs.track_state(model, ops)
            return ops, model

        ops, model = setup()
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        ops1, first = setup()
        first.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        first.save_weights({str(tmp_path / "w")!r})
        ops2, resumed = setup()
        resumed.load_weights({str(tmp_path / "w")!r})
        resumed.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), resumed.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert ops2.stats()["steps"] == ops.stats()["steps"] == 8
        print("OK", len(ops2._state))
    """
    stdout = _tf_keras.run(script, timeout=300)
    assert _tf_keras.lines(stdout, "OK"), stdout[-2000:]


def test_tf_keras_tracked_state_is_none_of_the_models_weights():
    """Under tf_keras the tracked state stays out of a functional model's weights: they
    keep their count after training (`set_weights` of another model's still fits), and
    a recompile under the strategy (a fine-tuning phase) does not find variables made
    outside it."""
    script = """
        import numpy as np, tensorflow as tf
        import tf_gradsync as gs
        gs.logical_cpus(2)
        ops = gs.CompressedAllReduce("topk")
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
        with strategy.scope():
            ids = tf.keras.Input((4,))
            model = tf.keras.Model(ids, tf.keras.layers.Dense(2)(ids))
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        gs.track_state(model, ops)
        x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
        model.fit(x, y, batch_size=4, verbose=0)
        with strategy.scope():
            model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        print("RESULT", len(model.get_weights()), len(ops._state) > 0)
    """
    (row,) = _tf_keras.lines(_tf_keras.run(script, timeout=300))
    assert row == ["2", "True"], row


def test_tf_keras_savedmodel_brings_its_state_back(tmp_path):
    """tf_keras saves a tracked model's state into its SavedModel; the loaded model holds
    it as restored variables, and tracking it again seeds the new ops with them."""
    script = f"""
        import numpy as np
        import tensorflow as tf
        import tf_gradsync as gs
        devices = gs.logical_cpus(2)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 8)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32)

        def setup():
            ops = gs.CompressedAllReduce("topk")
            return ops, tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

        ops, strategy = setup()
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        gs.track_state(model, ops)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        model.save({str(tmp_path / "saved")!r})
        ops2, strategy2 = setup()
        with strategy2.scope():
            loaded = tf.keras.models.load_model({str(tmp_path / "saved")!r})
        gs.track_state(loaded, ops2)
        saved, now = ops._state.values(), ops2._state.values()
        assert sorted(saved) == sorted(now)
        for k in saved:
            np.testing.assert_array_equal(saved[k], now[k], err_msg=k)
        loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
        print("OK", ops2.stats()["steps"], sum("residual" in k for k in saved))
    """
    (row,) = _tf_keras.lines(_tf_keras.run(script, timeout=300), "OK")
    assert row == ["4", "2"]


def test_loaded_state_that_no_variable_takes_is_kept_and_named(data, devices, caplog):
    # State saved by another version of a compressor (a field renamed) restores what
    # still matches; what matches nothing is kept, and a warning names it once the
    # plan's variables exist, or at once when loaded after.
    x, y = data
    ops, strategy = _strategy("topk", devices)
    model = _model(strategy, ops)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    saved = _state_values(ops)
    key = next(k for k in saved if k.startswith(ops.compressor.name + "_"))
    stale, later = key + "_v1", key + "_v2"

    ops2, strategy2 = _strategy("topk", devices)
    model2 = _model(strategy2, ops2)
    ops2._state.assign({**saved, stale: saved[key] + 1})
    with caplog.at_level(logging.WARNING):
        model2.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert f"1 loaded state values match no variable and are not restored ({stale})" \
        in caplog.text
    np.testing.assert_array_equal(ops2._state.values()[stale], saved[key] + 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ops2._state.assign({key: saved[key], later: saved[key]})
    assert f"({later})" in caplog.text and stale not in caplog.text
    np.testing.assert_array_equal(ops2._state.values()[key], saved[key])


@pytest.mark.parametrize("via", ["keras", "checkpoint"])
def test_state_of_another_plan_or_configuration_is_named_not_fatal(data, devices, caplog,
                                                                    tmp_path, via):
    """Resuming with another bucket_bytes (other keys) names the loaded state that the
    new plan does not take; another PowerSGD rank (same keys, other shapes) trains on
    from fresh state with a warning instead of failing at the first step. Alike through
    Keras 3's weight files (values handed to the state) and `tf.train.Checkpoint`
    (values TensorFlow holds until their variables exist)."""
    x, y = data
    ops = gs.CompressedAllReduce(gs.compression.get("powersgd", rank=2))
    model = _model(tf.distribute.MirroredStrategy(devices, cross_device_ops=ops), ops)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    saved = _state_values(ops)
    path = tf.train.Checkpoint(gradsync=ops).save(str(tmp_path / "ckpt"))

    def load(into):
        if via == "keras":
            into._state.assign(saved)
        else:
            tf.train.Checkpoint(gradsync=into).restore(path)
    keys = sorted(k for k in saved if k.startswith("powersgd_"))

    other_plan = gs.CompressedAllReduce(gs.compression.get("powersgd", rank=2),
                                        bucket_bytes=1 << 12)
    model2 = _model(tf.distribute.MirroredStrategy(devices, cross_device_ops=other_plan),
                    other_plan)
    load(other_plan)
    model2.optimizer.iterations.assign(3)       # as restored with the model
    with caplog.at_level(logging.WARNING):
        model2.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert (f"{len(keys)} loaded state values are of another compressor or bucket plan than "
            f"the step just built ({keys[0]}") in caplog.text
    # The ops were checkpointed: no advice to do so, but why nothing resumes.
    assert "the compression state restored is not for its tensors" in caplog.text
    assert "Checkpoint the ops with the model" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):      # named once, not at every trace
        model2.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert "another compressor or bucket plan" not in caplog.text

    other_rank = gs.CompressedAllReduce(gs.compression.get("powersgd", rank=1))
    model3 = _model(tf.distribute.MirroredStrategy(devices, cross_device_ops=other_rank),
                    other_rank)
    load(other_rank)
    with caplog.at_level(logging.WARNING):
        model3.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert "is of another configuration of the compressor" in caplog.text
    now = other_rank._state.values()
    q = next(k for k in keys if saved[k].shape != now[k].shape)
    assert f"the loaded value for {q} has shape {tuple(saved[q].shape)}" in caplog.text
    assert other_rank.stats()["steps"] == ops.stats()["steps"] + 1    # the counters resume
    assert all(np.isfinite(w).all() for w in model3.get_weights())


def test_track_state_rejects_bad_input(devices):
    ops = gs.CompressedAllReduce("topk")
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="CompressedAllReduce"):
        gs.track_state(model, "topk")
    gs.track_state(model, ops)
    gs.track_state(model, ops)   # idempotent
    with pytest.raises(ValueError, match="already tracks"):
        gs.track_state(model, gs.CompressedAllReduce("fp16"))


@pytest.mark.slow
def test_multiworker_resume_from_each_workers_checkpoint_is_exact(tmp_path):
    # Each worker checkpoints its own model, optimizer and compression state (residuals
    # differ per worker; under two phases each also owns a chunk's server residual);
    # resuming continues exactly like the uninterrupted job.
    args = ["--compression=topk", '--options={"ratio": 0.05}', "--exchange=two_phase"]
    (tmp_path / "full").mkdir()
    (tmp_path / "first").mkdir()
    (tmp_path / "resumed").mkdir()
    full = _worker.launch(tmp_path / "full", *args, "--steps=20")
    _worker.launch(tmp_path / "first", *args, "--steps=10",
                   f"--save={tmp_path}/ckpt_{{rank}}")
    resumed = _worker.launch(tmp_path / "resumed", *args, "--steps=10", "--first_step=10",
                             f"--restore={tmp_path}/ckpt_{{rank}}/ckpt")
    for r in range(2):
        assert resumed[r]["fingerprints"] == full[r]["fingerprints"][10:]
        assert resumed[r]["stats"]["steps"] == full[r]["stats"]["steps"] == 20
    assert resumed[0]["fingerprints"] == resumed[1]["fingerprints"]


def test_an_untracked_model_saves_without_the_state(data, devices, tmp_path):
    """What README advises before saving a model to serve: `del model.gradsync_state`
    leaves the residuals (the weights' size per replica) out of its files, and training
    goes on through the ops."""
    x, y = data
    ops = gs.CompressedAllReduce("topk")
    model = _model(tf.distribute.MirroredStrategy(devices, cross_device_ops=ops), ops)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    tracked, plain = str(tmp_path / "tracked.keras"), str(tmp_path / "plain.keras")
    model.save(tracked)
    del model.gradsync_state
    model.save(plain)
    weights = sum(w.numpy().nbytes for w in model.trainable_weights)
    assert os.path.getsize(tracked) - os.path.getsize(plain) >= len(devices) * weights
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert ops.stats()["steps"] == 2
