"""The accuracy guard: a bucket whose pooled compression error stays above the bound
falls back, identically on every replica, and returns when the error would fall."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import costmodel
from tf_gradsync.compression import ErrorFeedback, Guard, Layout, get

from _compress import make_state, reduce

LAYOUT = Layout(((100, 10),))


def _sparse(step: int) -> tf.Tensor:
    """One non-zero: top-k at 0.1% (one entry) sends it exactly."""
    x = np.zeros(1000, np.float32)
    x[(step * 7) % 1000] = step + 1
    return tf.constant(x)


def _topk():
    return ErrorFeedback(get("topk", ratio=0.001))


def _run(compressor, states, xs, step):
    """One reduction of `xs` through the driver (`_compress.reduce`), errors unmeasured."""
    return reduce(compressor, xs, states, shapes=LAYOUT.shapes, step=step, seed=(step, 0),
                  measure_error=False)


def test_falls_back_after_a_lossy_window_and_returns_when_the_inner_one_would_not_lose():
    inner = get("topk", ratio=0.001)            # no memory: its error is that of x alone
    guard = Guard(inner, window=3)
    run = costmodel.roundtrip_fn(guard, LAYOUT)
    topk_bytes = sum(b for _, b in costmodel.bucket_rounds(inner, LAYOUT))
    assert [b for _, b in costmodel.bucket_rounds(guard, LAYOUT)] == [topk_bytes + 8]
    sent = []
    # Dense noise: one entry in 1000 kept. Each step pools the step before's error,
    # so the first window (3 pooled steps) ends at the fourth step.
    for step in range(4):
        x = tf.random.stateless_normal([1000], (step, 1))
        y, b = run(x)
        sent.append(int(b))
    assert sent == [topk_bytes + 8] * 4          # the payload and the pooled error
    for step in range(3):                        # in fp16 now: the sum, to fp16 precision
        x = tf.random.stateless_normal([1000], (step, 2))
        y, b = run(x)
        assert int(b) == 2 * 1000 + 8
        np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-3, atol=1e-3)
    for step in range(3):                        # sparse input: top-k would lose nothing
        y, b = run(_sparse(step))
        assert int(b) == 2 * 1000 + 8
    y, b = run(_sparse(3))                       # back
    assert int(b) == topk_bytes + 8
    np.testing.assert_array_equal(y.numpy(), _sparse(3).numpy())


def test_the_inner_memory_advances_while_the_fallback_sends():
    """Under error feedback the inner compressor keeps encoding during the fallback:
    its residual is the one error feedback alone would hold on the same inputs, so
    its measured error does not restart from an empty memory."""
    guard, alone = Guard(_topk(), window=2), _topk()
    state, ref = make_state(guard, LAYOUT), make_state(alone, LAYOUT)
    for step in range(6):
        x = tf.random.stateless_normal([1000], (step, 4))
        for c, st in ((guard, state), (alone, ref)):
            _run(c, [st], [x], step)
    assert int(state["level"].numpy()) == 1
    np.testing.assert_array_equal(state["inner_residual"].numpy(), ref["residual"].numpy())


def test_a_compressor_within_the_bound_is_never_replaced():
    guard = Guard(ErrorFeedback(get("topk", ratio=0.5)), window=2)
    run = costmodel.roundtrip_fn(guard, LAYOUT)
    for step in range(6):
        _, b = run(tf.random.stateless_normal([1000], (step, 1)))
        assert int(b) == 500 * 8 + 8


def test_replicas_decide_on_the_pooled_error(devices):
    """One replica's bucket is lossy, three are sparse: every replica follows the
    pooled error and all of them switch on the same step."""
    guard = Guard(_topk(), bound=0.3, window=2)
    n = len(devices)
    state = [make_state(guard, LAYOUT) for _ in range(n)]
    levels = []
    for step in range(4):
        xs = [tf.random.stateless_normal([1000], (step, 9)) * 10 if r == 0 else _sparse(step)
              for r in range(n)]
        _run(guard, state, xs, step)
        levels.append([int(s["level"].numpy()) for s in state])
    # Step 0's error is pooled on step 1, and the window of two ends on step 2.
    assert levels == [[0] * n, [0] * n, [1] * n, [1] * n]


def test_guards_a_compressor_of_several_rounds(devices):
    """PowerSGD (two rounds) guarded: on the inner compressor, its results and state are
    PowerSGD's alone, with 8 bytes more; on the fallback it keeps running its rounds
    (the second needs the first's sum), its result unused, so its state still
    advances as PowerSGD's alone; every replica switches on the same step."""
    n = len(devices)
    guard, alone = Guard(get("powersgd", rank=1, start_iter=0), bound=0.5, window=2), \
        get("powersgd", rank=1, start_iter=0)
    states, ref = ([make_state(c, LAYOUT) for _ in range(n)] for c in (guard, alone))
    fp16 = 2 * (n - 1) * (2 * 1000 + 8)          # local_exchange's count for a sum
    for step in range(5):
        xs = [tf.random.stateless_normal([1000], (step, r)) for r in range(n)]
        got, want = _run(guard, states, xs, step), _run(alone, ref, xs, step)
        levels = [int(s["level"].numpy()) for s in states]
        if step < 3:                              # the window of two pooled steps ends
            for g, w in zip(got.results, want.results):
                np.testing.assert_array_equal(g.numpy(), w.numpy())
            assert got.sent == want.sent + 2 * (n - 1) * 8
        else:
            np.testing.assert_allclose(got.results[0].numpy(), tf.add_n(xs).numpy(),
                                       rtol=2e-3, atol=2e-3)
            assert got.sent == want.sent + fp16
        assert levels == [int(step >= 2)] * n
        for st, rf in zip(states, ref):
            for k, v in rf.items():
                np.testing.assert_array_equal(st["inner_" + k].numpy(), v.numpy())


def test_a_compressor_of_several_rounds_returns_when_it_would_not_lose(devices):
    """Guarded PowerSGD without error feedback falls back on noise and returns once
    the replicas' buckets are one rank-1 matrix, which rank 1 sends exactly."""
    n = len(devices)
    guard = Guard(get("powersgd", rank=1, start_iter=0, error_feedback=False), bound=0.6,
                  window=2)
    states = [make_state(guard, LAYOUT) for _ in range(n)]
    u, v = np.arange(1, 101, dtype=np.float32), np.linspace(-1, 1, 10, dtype=np.float32)
    rank1 = [tf.constant(np.outer(u, v).ravel() * (r + 1)) for r in range(n)]
    levels = []
    for step in range(6):
        xs = ([tf.random.stateless_normal([1000], (step, r)) for r in range(n)]
              if step < 3 else rank1)
        out = _run(guard, states, xs, step)
        levels.append(int(states[0]["level"].numpy()))
    # Back after step 4: its window pooled step 2's noise and step 3's exact shadow.
    assert levels == [0, 0, 1, 1, 0, 0]
    np.testing.assert_allclose(out.results[0].numpy(), tf.add_n(rank1).numpy(), rtol=1e-4)


def test_ops_take_a_guard_and_check_it():
    assert isinstance(gs.CompressedAllReduce("topk", guard=True).compressor, Guard)
    assert gs.CompressedAllReduce("fp16", guard=True).compressor.name == "fp16"   # lossless
    with pytest.raises(ValueError, match="guard must be True or False, got 'yes'"):
        gs.CompressedAllReduce("topk", guard="yes")
    assert gs.CompressedAllReduce("powersgd", guard=True).compressor.name == "guard"
    with pytest.raises(ValueError, match="exchange='two_phase' cuts buckets into chunks"):
        gs.CompressedAllReduce("topk", guard=True, exchange="two_phase")
    with pytest.raises(ValueError, match="bound"):
        Guard("topk", bound=0)
    assert gs.SyncConfig(compression="sign", guard=True).build().compressor.name == "guard"


@pytest.mark.parametrize("algorithm", ["ring", "collective"])
def test_guarded_powersgd_reduces_as_powersgd_through_a_strategy(devices, algorithm):
    """In a strategy's step, over three buckets: PowerSGD's results unguarded, while
    its error stays within the bound (to rounding: a round's tensors of one dtype are
    summed fused, so the error terms riding on the first round move where a ring cuts
    it into chunks, and with them the order of some additions)."""
    got = []
    for guard in (False, True):
        ops = gs.CompressedAllReduce("powersgd", guard=guard, algorithm=algorithm,
                                     bucket_bytes=4000, timeout_seconds=60)
        ops.start_at_step(1000)                          # past PowerSGD's warm-up
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

        def fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            xs = [tf.random.stateless_normal(s, tf.stack([r, i]))
                  for i, s in enumerate([(30, 20), (20,), (40, 25)])]
            return tf.distribute.get_replica_context().all_reduce("SUM", xs)
        step = tf.function(lambda: strategy.run(fn))
        runs = [[strategy.experimental_local_results(t)[0].numpy() for t in step()]
                for _ in range(3)]
        got.append((runs, ops.stats()["last_bytes_sent"]))
    for plain, guarded in zip(got[0][0], got[1][0]):
        for a, b in zip(plain, guarded):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert got[0][1] < got[1][1]


def test_stats_say_how_many_buckets_the_fallback_sends(devices):
    """Top-k at 0.1% loses almost everything of random gradients: after the first
    window every bucket goes in fp16, and `stats()` says so (the bytes alone showed
    it before)."""
    ops = gs.CompressedAllReduce(get("topk", ratio=0.001), guard=True, bucket_bytes=4000)
    assert ops.stats()["guarded_buckets"] == ops.stats()["fallback_buckets"] == 0
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    def fn(step):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        xs = [tf.random.stateless_normal(s, tf.stack([r * 100 + step, i]))
              for i, s in enumerate([(30, 20), (20,), (40, 25)])]
        return tf.distribute.get_replica_context().all_reduce("SUM", xs)
    step = tf.function(lambda s: strategy.run(fn, args=(s,)))
    step(tf.constant(0))
    first = ops.stats()
    assert first["guarded_buckets"] >= 2 and first["fallback_buckets"] == 0
    for s in range(1, 2 * ops.compressor.window + 2):
        step(tf.constant(s))
    last = ops.stats()
    assert last["fallback_buckets"] == last["guarded_buckets"] == first["guarded_buckets"]
    assert last["last_bytes_sent"] > first["last_bytes_sent"]
    assert "fallback_buckets" not in gs.CompressedAllReduce("topk").stats()
