"""Autotune: measurements in, the cost model's fastest choice out, installed and identical
on every worker."""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import autotuning, costmodel
from tf_gradsync.algorithms.cost import Link, exchange_seconds
from tf_gradsync.config import DEFAULT_BUCKET_BYTES

BIG = [((2000, 2000), tf.float32), ((2000,), tf.float32)]


def test_classes_are_nested_and_drawn_from_the_compressors():
    lossless = autotuning.candidates("lossless")
    balanced = autotuning.candidates("balanced")
    aggressive = autotuning.candidates("aggressive")
    assert sorted(lossless) == ["bf16", "fp16", "none"]
    assert set(lossless) < set(balanced) < set(aggressive) == set(gs.compression.names())
    assert {"int8", "powersgd", "sign"} <= set(balanced)
    assert not {"topk", "threshold", "dgc"} & set(balanced)
    with pytest.raises(ValueError, match="unknown accuracy class 'fast'; valid: lossless, "
                                         "balanced, aggressive"):
        autotuning.candidates("fast")


def test_the_decision_is_the_fastest_priced_candidate():
    link = Link(50e-6, 125e6)
    names = autotuning.candidates("balanced")
    d = autotuning.decide(BIG, 4, link, 0.2, names, bucket_sizes=(4 << 20, 32 << 20))
    assert d.predicted_step_s == min(r[3] for r in d.candidates)
    assert (d.compressor, d.exchange, d.bucket_bytes) in {r[:3] for r in d.candidates}
    # 16 MB at 1 Gbit/s, 4 workers: uncompressed, 0.19 s on the wire per 0.2 s step.
    assert d.compressor != "none" and d.predicted_speedup > 1.5
    # Every price is the cost model's own.
    c = gs.CompressedAllReduce(d.compressor, bucket_bytes=d.bucket_bytes).compressor
    p = costmodel.predict(c, costmodel.model_payloads(c, BIG, d.bucket_bytes, 4), d.exchange,
                          4, link, 0.2)
    assert p.step_s == pytest.approx(d.predicted_step_s)
    ops = d.ops(timeout_seconds=30)
    assert ops.compressor.name in (d.compressor, "error_feedback")
    assert ops.bucket_bytes == d.bucket_bytes


def test_workers_of_several_devices_are_priced_hierarchically():
    """Between workers of 4 devices, sums go hierarchically on the workers' link (their
    devices' legs are in the fitted link), gathers among all 8 devices."""
    link = Link(50e-6, 125e6)
    d = autotuning.decide(BIG, 2, link, 0.2, ["fp16", "int8"], bucket_sizes=(4 << 20,),
                          local=4)
    priced = {r[:2]: r[3] for r in d.candidates}
    assert set(priced) == {("fp16", "hierarchical"), ("int8", "gather"), ("int8", "two_phase")}
    for (name, exchange), step_s in priced.items():
        c = gs.CompressedAllReduce(name).compressor
        p = costmodel.predict(c, costmodel.model_payloads(c, BIG, 4 << 20, 8), exchange, 2,
                              link, 0.2, local=4, local_link=Link(0.0, float("inf")))
        assert step_s == pytest.approx(p.step_s)
    # The hierarchical sum costs what the all-reduces it was fitted to cost.
    fp16 = costmodel.model_payloads("fp16", BIG, 4 << 20, 8)
    wire = sum(exchange_seconds("ring", 2, b.rounds[0][1], link) for b in fp16)
    assert costmodel.predict("fp16", fp16, "hierarchical", 2, link, 0.2, local=4,
                             local_link=Link(0.0, float("inf"))).wire_s == pytest.approx(wire)
    assert d.ops().compressor.name in ("fp16", "int8", "error_feedback")


@pytest.mark.parametrize("replicas,workers,members", [
    (8, 2, (2, 4)),     # GPU workers: the link is between workers, sums hierarchical
    (2, 2, (2, 1)),     # a device per worker
    (4, 1, (4, 1)),     # one process's devices
])
def test_the_link_is_priced_between_workers_of_several_devices(replicas, workers, members):
    strategy = types.SimpleNamespace(
        num_replicas_in_sync=replicas,
        extended=types.SimpleNamespace(_id_in_cluster=0, _num_workers=workers))
    assert autotuning._members(strategy) == members


def test_a_fast_link_and_a_lossless_class_keep_it_uncompressed_or_16_bit():
    d = autotuning.decide(BIG, 2, Link(1e-6, 50e9), 0.5, autotuning.candidates("lossless"))
    assert d.compressor in ("none", "fp16", "bf16")
    assert d.predicted_speedup == pytest.approx(1.0, abs=0.05)


def test_link_fit_recovers_latency_and_bandwidth():
    n, true = 4, Link(2e-4, 3e8)
    sizes = [4096, 65536, 1 << 20, 1 << 23]
    seconds = [exchange_seconds("ring", n, s, true) for s in sizes]
    fit = autotuning.fit_link(sizes, seconds, n)
    assert fit.latency_s == pytest.approx(true.latency_s, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(true.bytes_per_s, rel=1e-6)


def test_link_fit_takes_latency_from_small_and_bandwidth_from_large_all_reduces():
    """A link whose largest transfer runs below the rate small ones see (as measured on
    the cluster suite): latency comes from the smallest all-reduce, bandwidth from the
    largest, where a least-squares line would put the shortfall into the latency."""
    n, true = 4, Link(2e-3, 12.5e6)
    sizes = [4096, 65536, 1 << 20, 1 << 23]
    seconds = [exchange_seconds("ring", n, s, true) for s in sizes]
    seconds[-1] *= 1.15
    fit = autotuning.fit_link(sizes, seconds, n)
    assert fit.latency_s == pytest.approx(true.latency_s, rel=0.01)
    moved = 2 * (n - 1) / n * sizes[-1]
    assert exchange_seconds("ring", n, sizes[-1], fit) == pytest.approx(seconds[-1], rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(moved / (seconds[-1] - 6 * fit.latency_s), rel=1e-6)
    # Noise that leaves the largest no slower than the smallest: the steepest rate seen.
    flat = autotuning.fit_link([4096, 1 << 20], [0.01, 0.01], n)
    assert flat.bytes_per_s == pytest.approx(2 * (n - 1) / n * (1 << 20) / 0.01)
    assert exchange_seconds("ring", n, 4096, flat) == pytest.approx(0.01)


def test_link_fit_prices_all_to_all_rounds_from_the_probe():
    """The all-to-all of tiny parts is nearly all fixed cost: each round gets its share
    (N-1 rounds for an even N, N for an odd one), and a two-phase exchange pays them."""
    sizes, seconds = [4096, 1 << 23], [0.002, 0.2]
    for n, rounds in ((4, 3), (5, 5), (8, 7)):
        fit = autotuning.fit_link(sizes, seconds, n, all_to_all_s=0.021)
        assert fit.round_s == pytest.approx(0.021 / rounds)
        assert fit.latency_s == autotuning.fit_link(sizes, seconds, n).latency_s
        assert exchange_seconds("two_phase", n, 0, fit) == pytest.approx(
            0.021 + (n - 1) * fit.latency_s)
    assert autotuning.fit_link(sizes, seconds, 4).round_s is None
    # Two workers of four devices: the all-to-all ran among all eight.
    fit = autotuning.fit_link(sizes, seconds, 2, all_to_all_s=0.021, local=4)
    assert fit.round_s == pytest.approx(0.021 / 7)
    assert fit.latency_s == autotuning.fit_link(sizes, seconds, 2).latency_s


def test_all_to_all_probe_times_the_pairwise_exchange(devices):
    strategy = _strategy(devices)
    seconds = autotuning.probe_all_to_all(strategy, repeats=3)
    assert 0 < seconds < 10
    one = tf.distribute.MirroredStrategy(devices[:1])
    assert autotuning.probe_all_to_all(one) == 0.0


def _strategy(devices):
    # Not TensorFlow's default collectives: their group keys would clash with the other
    # 4-device strategies of this process.
    return tf.distribute.MirroredStrategy(devices,
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def _model(strategy):
    with strategy.scope():
        return tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64),
                                    tf.keras.layers.Dense(4)])


def _gradients(model, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    return tape.gradient(loss, model.trainable_variables)


def _sgd_step(strategy, model, x, opt, then=lambda: None):
    """A traced training step of `model` on `x` with `opt`, returning `then()`."""
    @tf.function
    def step():
        def fn():
            grads = _gradients(model, x)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn)
        return then()
    return step


def test_autotune_measures_installs_and_trains(devices):
    strategy = _strategy(devices)
    model = _model(strategy)
    calls = []
    ops = gs.autotune(strategy, model, compute=lambda: calls.append(1),
                      compressors=["none", "fp16", "topk"], probe_bytes=(4096, 1 << 16),
                      calibrate_numel=20_000, bucket_sizes=(1 << 20, 4096))
    assert len(calls) == 4                       # one warm-up and three timed
    assert gs._tf_compat.cross_device_ops_of(strategy) is ops
    assert ops.decision.compressor in ("none", "fp16", "topk")
    assert ops.decision.link.bytes_per_s > 0 and ops.decision.link.latency_s > 0
    assert ops.decision.link.round_s > 0
    # Four compressor-and-exchange pairs were timed on the strategy, the fastest
    # predicted of each kind of exchange among them, and the fastest measured chosen.
    d = ops.decision
    ranked = list(dict.fromkeys(r[:2] for r in sorted(d.candidates, key=lambda r: r[3])))
    tried = [t[:2] for t in d.trials[:4]]
    assert len(d.trials) == 5 and tried == sorted(tried, key=ranked.index)
    # Then the fastest of those four at the other bucket size (4 KiB cuts the 8 KiB
    # kernel and its bias apart, 1 MiB holds both).
    winner = min(d.trials[:4], key=lambda t: t[4])
    assert d.trials[4][:2] == winner[:2] and d.trials[4][2] != winner[2]

    def kind(exchange):
        return "all-reduce" if exchange in ("ring", "tree") else exchange
    assert {kind(e) for _, e in ranked} == {"all-reduce", "gather", "two_phase"}
    for k in ("all-reduce", "gather", "two_phase"):
        assert next(p for p in ranked if kind(p[1]) == k) in tried
    assert all(t[4] > d.compute_s for t in d.trials)
    # The fastest measured (in the run-off, when the two fastest trials were close).
    fastest = min(d.runoff or d.trials, key=lambda t: t[4])
    assert (d.compressor, d.exchange, d.bucket_bytes) == fastest[:3]
    assert d.measured_step_s == fastest[4] and d.predicted_step_s == fastest[3]
    assert ops.stats()["steps"] == 0          # a fresh ops, not a trial's past warm-up
    # By default a pick of the aggressive class watches its compression error, unless
    # it exchanges in two phases (where no replica holds a whole bucket).
    guarded = d.compressor == "topk" and d.exchange != "two_phase"
    assert (ops.compressor.name == "guard") == guarded and d.guard is None

    def compressor(name, exchange, guard):
        return dataclasses.replace(d, compressor=name, exchange=exchange, guard=guard).ops() \
            .compressor.name
    assert compressor("topk", "gather", None) == compressor("powersgd", "ring", True) == "guard"
    assert compressor("powersgd", "ring", None) == "powersgd"
    assert compressor("topk", "two_phase", True) == compressor("topk", "gather", False) \
        == "error_feedback"
    # The installed ops serve the strategy's gradient reduction.
    x = tf.random.stateless_normal([8, 32], (1, 2))
    with strategy.scope():
        _sgd_step(strategy, model, x, tf.keras.optimizers.SGD(0.1))()
    assert ops.stats()["steps"] >= 1


def test_trials_pass_over_a_compressor_the_steps_optimizer_refuses(devices):
    """dgc refuses Adam (its momentum and Adam's first moment compound): its trials
    measure infinity, its other exchange is not timed, and its trial goes to the next
    compressor; a choice among refused compressors only is an error naming them."""
    strategy = _strategy(devices)
    model = _model(strategy)
    x = tf.random.stateless_normal([8, 32], (1, 2))

    def make_step(ops):
        with strategy.scope():
            return _sgd_step(strategy, model, x,
                             ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3)))
    kwargs = dict(compute=0.001, calibrate_numel=20_000, make_step=make_step, verbose=False,
                  install=False, runoff=0)
    d = gs.autotune(strategy, model, compressors=["dgc", "fp16", "topk"], trials=3,
                    **kwargs).decision
    # Only dgc's trials are refused; whichever of its exchanges ranked among the first
    # three, the trials went on to time three candidates it can train with.
    assert all((t[4] == np.inf) == (t[0] == "dgc") for t in d.trials)
    timed = {(t[0], autotuning._kind(t[1])) for t in d.trials if np.isfinite(t[4])}
    assert timed == {("fp16", "all-reduce"), ("topk", "gather"), ("topk", "two_phase")}
    assert d.compressor != "dgc" and np.isfinite(d.measured_step_s)
    with pytest.raises(ValueError, match=r"cannot train with any compressor tried \(dgc\)"):
        gs.autotune(strategy, model, compressors=["dgc"], trials=2, **kwargs)


def test_autotune_times_the_jobs_own_step(devices):
    """With `make_step`, each trial builds the job's training step under its own ops
    (with the optimizer those ops adapt) and times it whole: forward, backward, the
    reduction and the update, `compute` not added. The trials train; the model's
    variables, trainable or not, are restored after them."""
    strategy = _strategy(devices)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64),
                                     tf.keras.layers.BatchNormalization(),
                                     tf.keras.layers.Dense(4)])
    x = tf.random.stateless_normal([8, 32], (1, 2))
    before = [v.numpy() for v in model.variables]
    built, moved, trained = [], [], []

    def differs():
        return any(not np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))

    def make_step(ops):
        assert gs._tf_compat.cross_device_ops_of(strategy) is ops   # installed first
        built.append(ops)
        moved.append(differs())
        with strategy.scope():
            opt = ops.adapt_optimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))

        @tf.function
        def step():
            def fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(model(x, training=True) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.experimental_local_results(strategy.run(fn))

        def run():
            out = step()
            trained.append(differs())
            return out
        return run

    ops = gs.autotune(strategy, model, compute=100.0, make_step=make_step, trial_steps=3,
                      runoff=0, compressors=["none", "fp16", "topk"], probe_bytes=(4096, 1 << 16),
                      calibrate_numel=20_000, bucket_sizes=(1 << 20, 4096))
    d = ops.decision
    assert len(built) == len(d.trials) == 5
    for trial, used in zip(d.trials, built):
        trial_ops = dataclasses.replace(d, compressor=trial[0], exchange=trial[1],
                                        bucket_bytes=trial[2]).ops()
        assert repr(used) == repr(trial_ops)
        # Each trial times the ops as they would be chosen: guarded where they would be.
        assert ("Guard(" in repr(used)) == (trial[0] == "topk" and trial[1] != "two_phase")
        # The step went through the trial's ops: one tracing call, one untimed, three timed.
        assert used.stats()["steps"] == costmodel.STEADY_STEP + 4
        assert 0 < trial[4] < 100.0              # the step's own time, compute not added
    assert d.measured_step_s == min(t[4] for t in d.trials)
    # The trials trained, each from the job's weights, and left no trace.
    assert moved == [False] * 5 and trained == [True] * 5 * (2 + 3)   # 3 timed steps each
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    with pytest.raises(ValueError, match="make_step must build a step function, got 3"):
        gs.autotune(strategy, model, compute=0.1, make_step=3)
    # One function built once and handed out again would time the first trial's ops
    # in every trial.
    fresh = _strategy(devices)
    exact = gs._tf_compat.cross_device_ops_of(fresh)
    once = tf.function(lambda: tf.constant(0.0))
    with pytest.raises(ValueError, match="make_step returned the same step function twice"):
        gs.autotune(fresh, [((32, 64), tf.float32)], compute=0.1, make_step=lambda ops: once,
                    compressors=["none", "fp16", "topk"], probe_bytes=(4096, 1 << 16),
                    calibrate_numel=20_000, bucket_sizes=(1 << 20,))
    assert gs._tf_compat.cross_device_ops_of(fresh) is exact   # the ops it had


def test_a_runoff_times_the_two_fastest_trials_again_in_turns(devices):
    """Close trials (here forced: any two within 1000x) are timed again, each on the
    step it was built and timed with, in turns; the faster there is chosen and the
    weights go back to where the job left them."""
    strategy = _strategy(devices)
    model = _model(strategy)
    x = tf.random.stateless_normal([8, 32], (1, 2))
    before = [v.numpy() for v in model.variables]
    built, calls = [], []

    def make_step(ops):
        tag = len(built)
        built.append(ops)
        with strategy.scope():
            opt = tf.keras.optimizers.SGD(0.1)
        # Which trial's step ran, in the order they ran.
        return _sgd_step(strategy, model, x, opt,
                         lambda: tf.py_function(lambda: calls.append(tag) or 0, [], tf.int32))

    steps = 2
    ops = gs.autotune(strategy, model, compute=100.0, make_step=make_step, trial_steps=steps,
                      runoff=1000, compressors=["none", "fp16", "topk"],
                      probe_bytes=(4096, 1 << 16), calibrate_numel=20_000,
                      bucket_sizes=(1 << 20, 4096))
    d = ops.decision
    assert len(built) == len(d.trials) == 5
    fastest = sorted(d.trials, key=lambda t: t[4])[:2]
    assert [t[:4] for t in d.runoff] == [t[:4] for t in fastest]
    assert d.measured_step_s == min(t[4] for t in d.runoff)
    assert (d.compressor, d.exchange, d.bucket_bytes) == min(d.runoff, key=lambda t: t[4])[:3]
    # Each trial: a tracing call, an untimed one and the timed ones; then the two
    # finalists' own steps in turns, each turn an untimed call and the timed ones.
    a, b = (next(i for i, t in enumerate(d.trials) if t[:3] == f[:3]) for f in fastest)
    trial_calls = [i for i in range(5) for _ in range(2 + steps)]
    turns = ([a] * (1 + steps) + [b] * (1 + steps)) * autotuning.RUNOFF_ROUNDS
    assert calls == trial_calls + turns
    for i, used in enumerate(built):
        runs = calls.count(i) - 1                  # the tracing call synchronises too
        assert used.stats()["steps"] == costmodel.STEADY_STEP + runs
    for v, w in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), w)
    assert gs._tf_compat.cross_device_ops_of(strategy) is ops


def test_trials_start_at_the_default_bucket_size(devices):
    """The model prices one 32 MiB bucket under two of 4 MiB (it leaves out how buckets
    overlap), but the first trials run at the default size; the winner then runs at
    the other."""
    strategy = _strategy(devices)
    weights = [((1024, 1024), tf.float32), ((1024, 1024), tf.float32)]
    big = 32 * 2**20
    ops = gs.autotune(strategy, weights, compute=0.01, compressors=["none", "fp16", "topk"],
                      probe_bytes=(4096, 1 << 16), calibrate_numel=20_000, trial_steps=1,
                      runoff=0, bucket_sizes=(DEFAULT_BUCKET_BYTES, big))
    d = ops.decision
    price = {r[:3]: r[3] for r in d.candidates}
    assert any(price[(c, e, big)] < price[(c, e, DEFAULT_BUCKET_BYTES)] for c, e, _ in price)
    *first, last = d.trials
    assert len(first) == 4 and {t[2] for t in first} == {DEFAULT_BUCKET_BYTES}
    winner = min(first, key=lambda t: t[4])
    assert last[:3] == (*winner[:2], big)


def test_autotune_refuses_bad_input(devices):
    strategy = _strategy(devices)
    weights = [((4, 4), tf.float32)]
    with pytest.raises(ValueError, match="compute must be seconds per step"):
        gs.autotune(strategy, weights, compute="fast")
    with pytest.raises(ValueError, match="trials must be an integer >= 0, got -1"):
        gs.autotune(strategy, weights, compute=0.1, trials=-1)
    with pytest.raises(ValueError, match="trial_steps must be an integer >= 1, got 0"):
        gs.autotune(strategy, weights, compute=0.1, trial_steps=0)
    with pytest.raises(ValueError, match="runoff must be a fraction >= 0, got -0.1"):
        gs.autotune(strategy, weights, compute=0.1, runoff=-0.1)
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        gs.autotune(strategy, weights, compute=0.1, compressors=["zip"])
    with pytest.raises(ValueError, match="guard must be True, False or None, got 1"):
        gs.autotune(strategy, weights, compute=0.1, guard=1)
    busy = tf.distribute.MirroredStrategy(devices, cross_device_ops=gs.CompressedAllReduce("fp16"))
    with pytest.raises(ValueError, match="already uses CompressedAllReduce"):
        gs.autotune(busy, weights, compute=0.1)


@pytest.mark.parametrize("kwargs,message", [
    ({"compute": float("inf")}, r"compute must be seconds per step \(finite, >= 0\)"),
    ({"accuracy": "bogus", "compressors": ["fp16"]}, "unknown accuracy class 'bogus'"),
    ({"compressors": "topk"}, r"compressors must be a list of names, got the string 'topk' "
                              r"\(one: \['topk'\]\)"),
    ({"bucket_sizes": [0]}, "bucket_bytes must be"),
    ({"bucket_sizes": []}, "bucket_sizes must hold one or more sizes in bytes, got none"),
    ({"probe_bytes": []}, r"probe_bytes must be two or more sizes in bytes .* got \[\]"),
    ({"probe_bytes": [4096, -1]}, "probe_bytes must be two or more sizes"),
    ({"bucket_byts": 1}, r"autotune: CompressedAllReduce got unexpected keyword argument\(s\) "
                         r"\['bucket_byts'\]"),
], ids=["inf", "class", "string", "bucket", "no_buckets", "no_probe", "bad_probe",
        "ops_kwarg"])
def test_autotune_refuses_before_measuring(devices, kwargs, message):
    """Arguments that would fail after probing and timing are refused first, each with a
    ValueError, as the docstring says."""
    strategy = _strategy(devices)
    measured = []
    kwargs = {"compute": lambda: measured.append(1), **kwargs}
    with pytest.raises(ValueError, match=message):
        gs.autotune(strategy, [((4, 4), tf.float32)], **kwargs)
    assert not measured


def test_autotune_refuses_weights_it_cannot_see_and_a_strategy_without_ops(devices):
    unbuilt = tf.keras.Sequential([tf.keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="autotune needs the weights the gradients are of, got "
                                         "none in Sequential; build the model first"):
        gs.autotune(_strategy(devices), unbuilt, compute=0.1)
    one = tf.distribute.OneDeviceStrategy(devices[0])
    with pytest.raises(ValueError, match="cannot install cross-device ops into "
                                         "OneDeviceStrategy; .* or pass install=False"):
        gs.autotune(one, [((4, 4), tf.float32)], compute=0.1)


def test_autotune_prints_its_decision_and_takes_numpy_seconds(devices, capsys):
    """The decision reaches the user without absl's verbosity raised; numpy's scalars
    are numbers (of seconds, trials and steps) and flags."""
    strategy = _strategy(devices)
    ops = gs.autotune(strategy, [((64, 64), tf.float32)], compute=np.float32(0.01),
                      compressors=["none", "fp16"], probe_bytes=(4096, 1 << 16),
                      calibrate_numel=20_000, bucket_sizes=(1 << 20,), trials=np.int64(2),
                      trial_steps=np.int32(1), runoff=np.float32(0.1), guard=np.False_)
    out = capsys.readouterr().out.splitlines()
    decision = [line for line in out if line.startswith("tf_gradsync.autotune: ")]
    assert len(decision) == 1 and f"exchange {ops.decision.exchange}" in decision[0]
    assert decision[0].endswith("train with the optimizer ops.adapt_optimizer(optimizer) returns")
    assert sum(line.startswith("tf_gradsync.autotune trial: ") for line in out) == 2
    assert ops.decision.compute_s == pytest.approx(0.01) and ops.decision.guard is False
    # A strategy of its own: the first call installed its pick, which may compress.
    gs.autotune(_strategy(devices), [((64, 64), tf.float32)], compute=0.01, compressors=["fp16"],
                probe_bytes=(4096, 1 << 16), calibrate_numel=20_000, trials=0, verbose=False,
                install=False)
    assert "tf_gradsync.autotune" not in capsys.readouterr().out


def test_measurements_are_averaged_by_one_function_per_strategy(devices):
    """Every worker's numbers are averaged by one traced function, whatever their count
    (a function per call made TensorFlow warn the user of retracing)."""
    strategy = _strategy(devices)
    for n in range(1, 8):
        assert autotuning._mean_over_workers(strategy, list(range(n))) == list(range(n))
    assert autotuning._TOTALS[strategy].experimental_get_tracing_count() == 1


@pytest.mark.slow
def test_every_worker_reaches_the_same_decision(tmp_path):
    """Two workers measure different compute times (1 and 2 ms); the averaged
    measurements give one decision, and training under it keeps the workers equal."""
    import _worker  # tests/_worker.py
    # A run-off however far apart the two fastest trials: its turns are collectives too.
    ranks = _worker.launch(str(tmp_path), "--compression=autotune", "--steps=5",
                           '--options={"runoff": 1000}')
    a, b = (r["decision"] for r in ranks)
    assert a == b
    assert a["link"][2] > 0           # the all-to-all probe ran across both workers
    # Candidates were timed across both workers, the two fastest again in a run-off,
    # and the faster there chosen.
    assert len(a["trials"]) == 4
    fastest = sorted(a["trials"], key=lambda t: t[4])[:2]
    assert [t[:4] for t in a["runoff"]] == [t[:4] for t in fastest]
    assert a["measured_step_s"] == min(t[4] for t in a["runoff"])
    assert a["compute_s"] == pytest.approx(0.0015, rel=1e-3)
    assert ranks[0]["fingerprints"] == ranks[1]["fingerprints"]
    np.testing.assert_array_equal(np.asarray(ranks[0]["weights"][0]),
                                  np.asarray(ranks[1]["weights"][0]))


def test_autotune_with_sparse_as_dense_returns_ops_that_send_the_tables_dense(devices):
    """`sparse_as_dense=True` among autotune's arguments reaches the ops it returns: a
    step of a model with an Embedding then sends the table's gradient through fp16,
    halving every byte (a gathered table's int32 indices would keep it below 2)."""
    strategy = _strategy(devices)
    with strategy.scope():
        ids = tf.keras.Input((3,), dtype="int32")
        rows = tf.keras.layers.Embedding(50, 4)(ids)
        model = tf.keras.Model(ids, tf.keras.layers.Dense(2)(tf.keras.layers.Flatten()(rows)))
        opt = tf.keras.optimizers.SGD(0.1)
    ops = gs.autotune(strategy, model, compute=0.01, compressors=["fp16"], trials=0,
                      probe_bytes=(4096, 1 << 16), calibrate_numel=20_000, verbose=False,
                      sparse_as_dense=True)
    assert ops.sparse_as_dense and gs._tf_compat.cross_device_ops_of(strategy) is ops
    x = tf.constant(np.arange(24).reshape(8, 3) % 50, tf.int32)

    @tf.function
    def step():
        def replica(xs):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(xs) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        strategy.run(replica, (x[:2],))
    step()
    assert ops.stats()["compression_ratio"] == 2.0


def test_a_models_embedding_tables_are_left_out_of_the_priced_weights():
    """An Embedding's gradient is the rows it looked up, gathered alike under every
    candidate: autotune prices the model's other weights, not the table as a dense
    gradient compressed; with `sparse_as_dense=True` among the ops' arguments it is
    one."""
    ids = tf.keras.Input((5,), dtype="int32")
    rows = tf.keras.layers.Embedding(10_000, 16)(ids)
    model = tf.keras.Model(ids, tf.keras.layers.Dense(3)(tf.keras.layers.Flatten()(rows)))
    assert autotuning._specs(model) == [((80, 3), tf.float32), ((3,), tf.float32)]
    table = model.layers[1].embeddings
    assert autotuning._specs([table]) == [((10_000, 16), tf.float32)]   # named: kept
    assert autotuning._specs(model, sparse_as_dense=True) == [
        ((10_000, 16), tf.float32), ((80, 3), tf.float32), ((3,), tf.float32)]
