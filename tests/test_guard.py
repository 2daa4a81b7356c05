"""The accuracy guard: a bucket whose pooled compression error stays above the bound
falls back, identically on every replica, and returns when the error would fall."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import costmodel
from tf_gradsync.compression import ErrorFeedback, Guard, Layout, driver, get

LAYOUT = Layout(((100, 10),))


def _sparse(step: int) -> tf.Tensor:
    """One non-zero: top-k at 0.1% (one entry) sends it exactly."""
    x = np.zeros(1000, np.float32)
    x[(step * 7) % 1000] = step + 1
    return tf.constant(x)


def _topk():
    return ErrorFeedback(get("topk", ratio=0.001))


def test_falls_back_after_a_lossy_window_and_returns_when_the_inner_one_would_not_lose():
    inner = get("topk", ratio=0.001)            # no memory: its error is that of x alone
    guard = Guard(inner, window=3)
    run = costmodel.roundtrip_fn(guard, LAYOUT)
    topk_bytes = sum(b for _, b in costmodel.bucket_rounds(inner, LAYOUT))
    sent = []
    for step in range(3):                        # dense noise: one entry in 1000 kept
        x = tf.random.stateless_normal([1000], (step, 1))
        y, b = run(x)
        sent.append(int(b))
    assert sent == [topk_bytes + 8] * 3          # the payload and the pooled error
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
    state = {k: tf.Variable(s.initializer(s.shape, s.dtype))
             for k, s in guard.state_spec(LAYOUT).items()}
    ref = {k: tf.Variable(s.initializer(s.shape, s.dtype))
           for k, s in alone.state_spec(LAYOUT).items()}
    for step in range(6):
        x = tf.random.stateless_normal([1000], (step, 4))
        for c, st in ((guard, state), (alone, ref)):
            ctx = gs.compression.Context(state=st, step=step, seed=(step, 0), layout=LAYOUT)
            driver.run(c, [x], [ctx], lambda m: driver.local_exchange(m))
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
    state = [{k: tf.Variable(s.initializer(s.shape, s.dtype)) for k, s in
              guard.state_spec(LAYOUT).items()} for _ in range(n)]

    def reduce(step):
        xs = [tf.random.stateless_normal([1000], (step, 9)) * 10 if r == 0 else _sparse(step)
              for r in range(n)]
        ctxs = [gs.compression.Context(state=state[r], step=step, seed=(step, 0),
                                       num_replicas=n, replica=r, layout=LAYOUT)
                for r in range(n)]
        return driver.run(guard, xs, ctxs, lambda m: driver.local_exchange(m))

    levels = []
    for step in range(4):
        reduce(step)
        levels.append([int(s["level"].numpy()) for s in state])
    assert levels == [[0] * n, [1] * n, [1] * n, [1] * n]


def test_ops_take_a_guard_and_check_it():
    assert isinstance(gs.CompressedAllReduce("topk", guard=True).compressor, Guard)
    assert gs.CompressedAllReduce("fp16", guard=True).compressor.name == "fp16"   # lossless
    with pytest.raises(ValueError, match="guard must be True or False, got 'yes'"):
        gs.CompressedAllReduce("topk", guard="yes")
    with pytest.raises(ValueError, match="single-round codec"):
        gs.CompressedAllReduce("powersgd", guard=True)
    with pytest.raises(ValueError, match="bound"):
        Guard("topk", bound=0)
    assert gs.SyncConfig(compression="sign", guard=True).build().compressor.name == "guard"
