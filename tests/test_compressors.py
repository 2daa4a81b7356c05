"""Conformance tests for every registered compressor, plus ErrorFeedback and PowerSGD.

Single-round compressors run through one battery parametrised over
`compression.names()`; multi-round ones (PowerSGD) are driven by `simulate`, a small
N-replica model of the pipeline's round protocol with explicit summation.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import compression as C
from tf_gradsync.compression import _util

FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
SINGLE = [n for n in C.names() if not issubclass(type(C.get(n)), C.RoundCompressor)]
STOCHASTIC = ["qsgd", "randomk", "terngrad"]


def make_state(c, n, dtype=tf.float32):
    return {k: tf.Variable(s.initializer(s.shape, s.dtype), trainable=False)
            for k, s in c.state_spec(n, dtype).items()}


def ctx(state=None, seed=(1, 2), step=0, num_replicas=1):
    return C.Context(state=state or {}, step=tf.convert_to_tensor(step, tf.int64),
                     seed=tf.convert_to_tensor(seed, tf.int64), num_replicas=num_replicas)


def roundtrip(c, x, state=None, **kw):
    payload, meta = c.compress(x, ctx(state, **kw))
    return payload, c.decompress(payload, meta)


def rand(n, seed=0, dtype=tf.float32):
    return tf.constant(np.random.default_rng(seed).standard_normal(n), dtype)


# ----------------------------------------------------------------- battery
@pytest.mark.parametrize("name", C.names())
def test_registered_defaults(name):
    c = C.get(name)
    assert type(c).name == name and repr(c).startswith(type(c).__name__)
    assert "Example" in type(c).__doc__
    assert c.has_own_memory == (name in ("dgc", "powersgd"))


@pytest.mark.parametrize("name", SINGLE)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_roundtrip_shape_dtype(name, dtype):
    c = C.get(name)
    x = rand(257, dtype=dtype)
    c.check_input(x)
    _, y = roundtrip(c, x, make_state(c, 257, dtype))
    assert y.shape == (257,) and y.dtype == dtype
    assert np.all(np.isfinite(tf.cast(y, tf.float64).numpy()))


@pytest.mark.parametrize("name", SINGLE)
def test_all_zeros_and_single_element(name):
    c = C.get(name)
    _, y = roundtrip(c, tf.zeros([100]), make_state(c, 100))
    np.testing.assert_array_equal(y.numpy(), np.zeros(100))
    x = tf.constant([-0.75])          # n = 1: every compressor sends it exactly
    _, y = roundtrip(c, x, make_state(c, 1))
    np.testing.assert_allclose(y.numpy(), [-0.75], rtol=1e-6)


@pytest.mark.parametrize("name", SINGLE)
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_propagates(name, bad):
    """Documented behaviour: a NaN/Inf in the bucket makes the reconstruction non-finite."""
    c = C.get(name)
    x = rand(300).numpy()
    x[7] = bad
    _, y = roundtrip(c, tf.constant(x), make_state(c, 300))
    assert not np.all(np.isfinite(y.numpy()))


def test_none_exact():
    c = C.get("none")
    for x in (rand(33, dtype=tf.float64), tf.range(10), rand(5, dtype=tf.bfloat16)):
        _, y = roundtrip(c, x)
        np.testing.assert_array_equal(y.numpy(), x.numpy())


@pytest.mark.parametrize("name", ["topk", "threshold", "randomk", "dgc"])
def test_ratio_one_is_lossless(name):
    c = C.get(name, ratio=1.0)
    x = rand(5)
    _, y = roundtrip(c, x, make_state(c, 5))
    np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-6)


@pytest.mark.parametrize("name", STOCHASTIC)
def test_unbiased(name):
    c = C.get(name)
    assert c.unbiased
    n, trials = 64, 300
    x = rand(n, seed=3)
    f = tf.function(lambda s: roundtrip(c, x, seed=tf.stack([s, tf.constant(7, tf.int64)]))[1])
    ys = np.stack([f(tf.constant(t, tf.int64)).numpy() for t in range(trials)])
    err = np.abs(ys.mean(0) - x.numpy())
    se = ys.std(0) / math.sqrt(trials)
    assert np.all(err <= 5 * se + 1e-6), (err / np.maximum(se, 1e-12)).max()


# ----------------------------------------------------------------- numpy references
def test_topk_reference():
    x = rand(500, seed=1)
    (values, idx), y = roundtrip(C.get("topk", ratio=0.03), x)
    ref = np.zeros(500, np.float32)
    keep = np.argsort(-np.abs(x.numpy()))[:15]
    ref[keep] = x.numpy()[keep]
    assert values.shape == (15,) and idx.dtype == tf.int32
    np.testing.assert_array_equal(y.numpy(), ref)


def test_int8_reference():
    x = rand(300, seed=2).numpy()
    (q, scale), y = roundtrip(C.get("int8"), tf.constant(x))
    ref_scale = np.abs(x).max() / 127
    np.testing.assert_allclose(scale.numpy(), ref_scale, rtol=1e-6)
    np.testing.assert_array_equal(q.numpy(), np.round(x / scale.numpy()).astype(np.int8))
    np.testing.assert_allclose(y.numpy(), q.numpy() * scale.numpy(), rtol=1e-6)


def _packbits(bits):
    return np.packbits(np.asarray(bits, np.uint8), bitorder="little")


def test_sign_reference():
    x = rand(1001, seed=4).numpy()
    (packed, scale), y = roundtrip(C.get("sign"), tf.constant(x))
    np.testing.assert_array_equal(packed.numpy(), _packbits(x >= 0))
    np.testing.assert_allclose(scale.numpy(), np.abs(x).mean(), rtol=1e-5)
    np.testing.assert_allclose(y.numpy(), np.where(x >= 0, 1, -1) * np.abs(x).mean(), rtol=1e-5)


def test_onebit_reference():
    x = rand(77, seed=5).numpy()
    (packed, hi, lo), y = roundtrip(C.get("onebit"), tf.constant(x))
    np.testing.assert_array_equal(packed.numpy(), _packbits(x >= 0))
    ref = np.where(x >= 0, x[x >= 0].mean(), x[x < 0].mean())
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5)
    _, y = roundtrip(C.get("onebit"), tf.constant([1.0, 3.0]))   # empty negative class
    np.testing.assert_allclose(y.numpy(), [2.0, 2.0])


def _uniform(n, seed=(1, 2), dtype=tf.float32):
    return tf.random.stateless_uniform([n], tf.constant(seed, tf.int64), dtype=dtype).numpy()


def test_terngrad_reference():
    x = rand(203, seed=6).numpy()
    (packed, scale), y = roundtrip(C.get("terngrad"), tf.constant(x))
    s = np.abs(x).max()
    np.testing.assert_allclose(scale.numpy(), s)
    t = np.where(_uniform(203) < np.abs(x) / s, np.sign(x), 0)
    codes = np.pad(np.where(t > 0, 1, np.where(t < 0, 2, 0)), (0, 1)).reshape(-1, 4)
    np.testing.assert_array_equal(packed.numpy(), (codes * [1, 4, 16, 64]).sum(1).astype(np.uint8))
    np.testing.assert_allclose(y.numpy(), t * s, rtol=1e-6)


def test_qsgd_reference():
    x = rand(150, seed=7).numpy()
    c = C.get("qsgd", levels=8)
    (q, norm), y = roundtrip(c, tf.constant(x))
    np.testing.assert_allclose(norm.numpy(), np.linalg.norm(x), rtol=1e-5)
    level = np.minimum(np.floor(np.abs(x) * 8 / norm.numpy() + _uniform(150)), 8)
    np.testing.assert_array_equal(q.numpy(), (np.sign(x) * level).astype(np.int8))
    np.testing.assert_allclose(y.numpy(), q.numpy() * norm.numpy() / 8, rtol=1e-6)


def test_randomk_shared_coordinates_sum():
    c = C.get("randomk", ratio=0.1)
    xs = [rand(100, seed=s) for s in range(3)]
    outs = [c.compress(x, ctx(seed=(5, 6))) for x in xs]
    summed = c.decompress([tf.add_n([p[0] for p, _ in outs])], outs[0][1])
    parts = tf.add_n([c.decompress(p, m) for p, m in outs])
    np.testing.assert_allclose(summed.numpy(), parts.numpy(), rtol=1e-5)
    nz = np.flatnonzero(summed.numpy())
    assert len(nz) == 10
    np.testing.assert_allclose(summed.numpy()[nz], 10 * tf.add_n(xs).numpy()[nz], rtol=1e-5)


def test_threshold_matches_topk_on_small_and_pads():
    x = rand(800, seed=8)
    _, a = roundtrip(C.get("threshold", ratio=0.05), x)
    _, b = roundtrip(C.get("topk", ratio=0.05), x)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    big = rand(20000, seed=9).numpy()
    (vals, idx), y = roundtrip(C.get("threshold", ratio=0.01), tf.constant(big))
    assert vals.shape == (200,)
    true = set(np.argsort(-np.abs(big))[:200])
    assert len(true & set(idx.numpy())) >= 190
    sparse = np.zeros(20000, np.float32)
    sparse[[0, 3, 9000, 19999]] = [1.0, -2.0, 3.0, 4.0]   # fewer candidates than k: padding
    (vals, idx), y = roundtrip(C.get("threshold", ratio=0.01), tf.constant(sparse))
    assert vals.shape == (200,)
    np.testing.assert_array_equal(y.numpy(), sparse)


# ----------------------------------------------------------------- DGC
def test_dgc_reference_three_steps():
    n, k, m = 50, 5, 0.9
    c = C.get("dgc", ratio=k / n, momentum=m)
    state = make_state(c, n)
    u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step in range(3):
        g = rand(n, seed=10 + step).numpy()
        u = m * u + g
        v = v + u
        keep = np.argsort(-np.abs(v))[:k]
        ref = np.zeros(n, np.float32)
        ref[keep] = v[keep]
        u[keep] = 0
        v[keep] = 0
        _, y = roundtrip(c, tf.constant(g), state, step=step)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["u"].numpy(), u, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["v"].numpy(), v, rtol=1e-5, atol=1e-6)


def test_dgc_warmup_clip_and_nan_reset():
    c = C.get("dgc", ratio=0.01, warmup_steps=100, warmup_ratio=0.25)
    state = make_state(c, 400)
    # stages 0.25, 0.0855, 0.0292, 0.01 (a factor 2.92 each), a third of the warm-up each
    assert c.num_variants == 4
    steps = (0, 33, 34, 66, 67, 99, 100, 500)
    sizes = [roundtrip(c, rand(400), state, step=s)[0][0].shape[0] for s in steps]
    assert sizes == [100, 100, 35, 35, 12, 12, 4, 4]
    assert [int(c.variant(ctx(step=s))) for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert C.get("dgc", ratio=0.001, warmup_steps=10).ratios == pytest.approx(
        [0.25, 0.0629, 0.0158, 0.00398, 0.001], rel=1e-2)   # the paper's ladder, roughly
    c = C.get("dgc", ratio=1.0, momentum=0.0, clip_norm=2.0)
    _, y = roundtrip(c, 10 * rand(64), make_state(c, 64), num_replicas=4)
    np.testing.assert_allclose(np.linalg.norm(y.numpy()), 1.0, rtol=1e-5)
    state = make_state(c, 64)
    x = rand(64).numpy()
    x[3] = math.nan
    _, y = roundtrip(c, tf.constant(x), state)
    assert np.isnan(y.numpy()).any()
    assert not state["u"].numpy().any() and not state["v"].numpy().any()


# ----------------------------------------------------------------- ErrorFeedback
@pytest.mark.parametrize("name", ["topk", "sign", "int8", "threshold", "onebit", "fp16"])
def test_error_feedback_residual(name):
    inner = C.get(name)
    ef = C.ErrorFeedback(inner)
    assert (ef.summable, ef.prescale, ef.unbiased) == (inner.summable, inner.prescale, False)
    state = make_state(ef, 200)
    x1, x2 = rand(200, seed=1), rand(200, seed=2)
    _, y1 = roundtrip(ef, x1, state)
    np.testing.assert_allclose(state["residual"].numpy(), (x1 - y1).numpy(), atol=1e-6)
    _, y2 = roundtrip(ef, x2, state)
    e2 = x2 + (x1 - y1)
    np.testing.assert_allclose(y2.numpy(), inner.decompress(*inner.compress(e2, ctx())).numpy(),
                               atol=1e-6)
    np.testing.assert_allclose(state["residual"].numpy(), (e2 - y2).numpy(), atol=1e-5)


def test_error_feedback_nan_resets_and_state_namespacing():
    ef = C.ErrorFeedback("topk")
    state = make_state(ef, 100)
    roundtrip(ef, rand(100), state)
    x = rand(100).numpy()
    x[0] = math.inf
    payload, y = roundtrip(ef, tf.constant(x), state)
    assert not np.all(np.isfinite(payload[0].numpy()))
    assert not state["residual"].numpy().any()

    class Stateful(C.Compressor):
        unbiased = False
        def state_spec(self, numel, dtype):
            return {"residual": C.StateSpec((1,), tf.float32)}
        def compress(self, x, c):
            c.state["residual"].assign_add([1.0])
            return (x,), None
        def decompress(self, payload, meta):
            return payload[0] * 0.5

    ef = C.ErrorFeedback(Stateful())
    state = make_state(ef, 4)
    assert sorted(state) == ["inner_residual", "residual"]
    roundtrip(ef, tf.ones([4]), state)
    assert state["inner_residual"].numpy()[0] == 1.0
    np.testing.assert_allclose(state["residual"].numpy(), 0.5)


@pytest.mark.parametrize("inner", ["dgc", "powersgd"])
def test_error_feedback_rejects_own_memory(inner):
    assert C.get(inner).has_own_memory
    with pytest.raises(ValueError, match="own memory"):
        C.ErrorFeedback(inner)


# ----------------------------------------------------------------- sizes and arguments
EXPECTED_BYTES = {  # n = 1000 float32 (dense: 4000 bytes)
    "none": 4000, "fp16": 2000, "bf16": 2000, "int8": 1004, "qsgd": 1004, "terngrad": 254,
    "sign": 129, "onebit": 133, "topk": 80, "threshold": 80, "randomk": 40, "dgc": 8,
    "adaptive": 800,   # starts critical: max_ratio = 10%
}


@pytest.mark.parametrize("name", SINGLE)
def test_payload_bytes(name):
    c = C.get(name)
    payload, _ = c.compress(rand(1000), ctx(make_state(c, 1000)))
    got = int(c.payload_bytes(payload))
    assert got == EXPECTED_BYTES[name]
    assert got == sum(t.numpy().nbytes for t in payload)
    assert 4000 / got == pytest.approx(4000 / EXPECTED_BYTES[name])


@pytest.mark.parametrize("name,kwargs,bad", [
    ("topk", {"ratio": 0}, "0"), ("topk", {"ratio": 1.5}, "1.5"), ("randomk", {"ratio": -1}, "-1"),
    ("threshold", {"ratio": 2}, "2"), ("threshold", {"sample_ratio": 0.0}, "0.0"),
    ("dgc", {"ratio": 0}, "0"), ("dgc", {"momentum": 1.0}, "1.0"), ("dgc", {"clip_norm": 0}, "0"),
    ("dgc", {"warmup_steps": -1}, "-1"),
    ("dgc", {"warmup_steps": 5, "warmup_ratio": 1e-4}, "0.0001"),
    ("qsgd", {"levels": 0}, "0"), ("qsgd", {"levels": 128}, "128"),
    ("qsgd", {"levels": 2.5}, "2.5"),
    ("powersgd", {"rank": 0}, "0"), ("powersgd", {"start_iter": -2}, "-2"),
    ("powersgd", {"min_compression_rate": 0.5}, "0.5"), ("powersgd", {"warm_start": 1}, "1"),
    ("randomk", {"scale": 1}, "1"),
    ("adaptive", {"min_ratio": 0}, "0"), ("adaptive", {"min_ratio": 1.5}, "1.5"),
    ("adaptive", {"min_ratio": 0.2, "max_ratio": 0.1}, "0.1"), ("adaptive", {"max_ratio": 2}, "2"),
    ("adaptive", {"threshold": 0}, "0"), ("adaptive", {"interval": 0}, "0"),
    ("adaptive", {"interval": 2.5}, "2.5"),
])
def test_argument_validation(name, kwargs, bad):
    with pytest.raises(ValueError, match=f"{list(kwargs)[-1]} must .*{bad}"):
        C.get(name, **kwargs)


# ----------------------------------------------------------------- PowerSGD
def simulate(c, xs, states, step=0):
    """N replicas through first_round / next_round / finish with explicit sums."""
    n = len(xs)
    ctxs = [ctx(s, seed=(step, 3), step=step, num_replicas=n) for s in states]
    xs = [x * tf.cast(1 / n, x.dtype) if c.prescale else x for x in xs]
    rounds, carries, payloads = 0, [], []
    for x, cx in zip(xs, ctxs):
        p, carry = c.first_round(x, cx)
        payloads.append(p)
        carries.append(carry)
    while True:
        rounds += 1
        reduced = [tf.add_n(list(ts)) for ts in zip(*payloads)]
        nxt = [c.next_round(reduced, carries[i], ctxs[i]) for i in range(n)]
        carries = [cr for _, cr in nxt]
        if nxt[0][0] is None:
            break
        payloads = [p for p, _ in nxt]
    return [c.finish(reduced, carries[i], ctxs[i]) for i in range(n)], rounds


def test_powersgd_exact_for_low_rank_and_residual():
    c = C.get("powersgd", rank=2)
    rows, cols, r = c.matrix_shape(1024)
    assert (rows, cols, r) == (32, 32, 2)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((32, 2)) @ rng.standard_normal((2, 32))
    xs = [tf.constant((base * (i + 1)).ravel(), tf.float32) for i in range(3)]
    states = [make_state(c, 1024) for _ in xs]
    outs, rounds = simulate(c, xs, states)
    assert rounds == 2
    mean = tf.add_n(xs).numpy() / 3
    for y in outs:
        np.testing.assert_allclose(y.numpy(), mean, atol=1e-4)
    np.testing.assert_allclose(sum(s["residual"].numpy() for s in states), 0, atol=1e-4)
    np.testing.assert_allclose(states[0]["q"].numpy(), states[1]["q"].numpy())


def test_powersgd_error_feedback_conserves_mass():
    c = C.get("powersgd", rank=1)
    states = [make_state(c, 900) for _ in range(2)]
    sent, total = 0, 0
    for step in range(3):
        xs = [rand(900, seed=10 * step + i) for i in range(2)]
        outs, _ = simulate(c, xs, states, step=step)
        np.testing.assert_allclose(outs[0].numpy(), outs[1].numpy())
        sent = sent + outs[0].numpy()
        total = total + tf.add_n(xs).numpy() / 2
    np.testing.assert_allclose(sent + sum(s["residual"].numpy() for s in states), total, atol=1e-4)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_powersgd_dtypes_and_bytes(dtype):
    c = C.get("powersgd")
    state = make_state(c, 10000, dtype)
    x = rand(10000, dtype=dtype)
    (p,), carry = c.first_round(x, ctx(state))
    (q,), carry = c.next_round([p], carry, ctx(state))
    assert int(c.payload_bytes([p])) + int(c.payload_bytes([q])) == 800 * p.dtype.size
    assert c.next_round([q], carry, ctx(state))[0] is None
    y = c.finish([q], carry, ctx(state))
    assert y.shape == (10000,) and y.dtype == dtype


def test_powersgd_dense_fallback_start_iter_and_nan():
    c = C.get("powersgd", rank=4, start_iter=5)
    assert c.matrix_shape(30) is None and c.state_spec(30, tf.float32) == {}
    xs = [rand(30, seed=i) for i in range(2)]
    outs, rounds = simulate(c, xs, [{}, {}])
    assert rounds == 1
    np.testing.assert_allclose(outs[0].numpy(), tf.add_n(xs).numpy() / 2, rtol=1e-6)
    states = [make_state(c, 400)]
    simulate(c, [rand(400)], states, step=2)        # before start_iter: no memory
    assert not states[0]["residual"].numpy().any()
    simulate(c, [rand(400)], states, step=5)
    assert states[0]["residual"].numpy().any()
    x = rand(400).numpy()
    x[1] = math.nan
    outs, _ = simulate(c, [tf.constant(x)], states, step=6)
    assert np.isnan(outs[0].numpy()).any()
    assert not states[0]["residual"].numpy().any()
    assert np.all(np.isfinite(states[0]["q"].numpy()))


# ----------------------------------------------------------------- exact top-k
def _topk_sets(mag, k):
    """The fast path's indices, top_k's, and a stable numpy argsort's (lower index first)."""
    fast = _util.top_k_indices(tf.constant(mag), k).numpy()
    assert len(fast) == k
    ref = np.argsort(-mag, kind="stable")[:k]
    plain = tf.math.top_k(tf.constant(mag), k).indices.numpy()
    return set(fast.tolist()), set(plain.tolist()), set(ref.tolist())


@pytest.mark.parametrize("k", [1, 7, 1000, 12000])
@pytest.mark.parametrize("kind", ["normal", "ties", "ties1000", "few_nonzero", "constant",
                                  "sampled_high"])
def test_topk_fast_path_is_exact(kind, k):
    # n = 100k: a 1000-entry sample. k = 1, 7, 1000 keep k of many more candidates;
    # k = 12000 drops the few extra candidates instead; "constant" and "few_nonzero"
    # make every entry a candidate; "sampled_high" leaves too few (full ranking).
    n = 100_000
    rng = np.random.default_rng(k)
    if kind == "normal":
        mag = np.abs(rng.standard_normal(n))
    elif kind == "ties":           # ten distinct values: the k-th value is tied many times
        mag = rng.integers(0, 10, n).astype(np.float64)
    elif kind == "ties1000":       # ~100 copies of each value, ties at the cut
        mag = rng.integers(0, 1000, n).astype(np.float64)
    elif kind == "few_nonzero":    # fewer nonzeros than k for the larger k
        mag = np.zeros(n)
        mag[rng.choice(n, 500, replace=False)] = rng.random(500) + 1
    elif kind == "constant":
        mag = np.ones(n)
    else:                          # the sample sees only large values: too few candidates
        mag = rng.random(n)
        pick = tf.random.stateless_uniform([1000], _util._TOPK_SEED, 0, n, dtype=tf.int32)
        mag[pick.numpy()] = 10.0
    mag = mag.astype(np.float32)
    fast, plain, ref = _topk_sets(mag, k)
    assert fast == plain
    # top_k breaks ties towards lower indices, like a stable sort.
    assert fast == ref


def test_topk_compress_matches_plain_top_k_on_a_large_bucket():
    x = rand(200_000, seed=11)
    (values, idx), y = roundtrip(C.get("topk", ratio=0.01), x)
    keep = np.argsort(-np.abs(x.numpy()), kind="stable")[:2000]
    assert set(idx.numpy().tolist()) == set(keep.tolist())
    ref = np.zeros(200_000, np.float32)
    ref[keep] = x.numpy()[keep]
    np.testing.assert_array_equal(y.numpy(), ref)


# ----------------------------------------------------------------- random-k under error feedback
def test_randomk_unscaled_and_error_feedback_form():
    x = rand(100, seed=12)
    c = C.get("randomk", ratio=0.1, scale=False)
    assert not c.unbiased and c.for_error_feedback() is c
    (values,), y = roundtrip(c, x)
    nz = np.flatnonzero(y.numpy())
    np.testing.assert_array_equal(y.numpy()[nz], x.numpy()[nz])      # not scaled by n / k
    ef = C.ErrorFeedback("randomk")
    assert ef.inner.scale is False and ef.summable
    state = make_state(ef, 100)
    residual = np.zeros(100, np.float32)
    for step in range(50):
        g = rand(100, seed=step).numpy()
        _, y = roundtrip(ef, tf.constant(g), state, seed=(step, 3))
        e = g + residual
        kept = np.flatnonzero(y.numpy())
        np.testing.assert_allclose(y.numpy()[kept], e[kept], rtol=1e-5, atol=1e-6)
        residual = e - y.numpy()
        np.testing.assert_allclose(state["residual"].numpy(), residual, atol=1e-5)
    # Memory holds about k/n-th of a step's worth per coordinate: bounded, not growing.
    assert np.linalg.norm(residual) < 20 * np.linalg.norm(rand(100).numpy())


# ----------------------------------------------------------------- adaptive
def _accordion(reduced, interval, threshold):
    """Numpy model of the decision rule: the level (1: max_ratio) used at each step."""
    level, prev, acc, count, levels = 1, -1.0, 0.0, 0, []
    for g in reduced:
        levels.append(level)
        acc, count = acc + g, count + 1
        if count == interval:
            norm = float(np.linalg.norm(acc))
            change = abs(norm - prev)
            decided = level if prev < 0 else int(change >= threshold * prev and change > 0)
            prev = norm if decided == level else -1.0
            level, acc, count = decided, 0.0, 0
    return levels


def test_adaptive_ratio_follows_the_reduced_norm():
    n, interval = 400, 3
    c = C.get("adaptive", min_ratio=0.01, max_ratio=0.1, threshold=0.5, interval=interval)
    state = make_state(c, n)
    base = rand(n, seed=13).numpy()
    scales = [1] * 12 + [3] * 9 + [3.2] * 9 + [0.5] * 12
    reduced = [s * base for s in scales]
    levels, sizes = [], []
    for step, g in enumerate(reduced):
        cx = ctx(state, step=step)
        levels.append(int(c.variant(cx)))
        payload, meta = c.compress(tf.constant(g), cx)
        sizes.append(payload[0].shape[0])
        c.observe(tf.constant(g), cx)
    want = _accordion(reduced, interval, 0.5)
    assert levels == want
    assert set(levels) == {0, 1}          # moved between the bounds, both ways
    assert sizes == [40 if lv else 4 for lv in levels]
    # a non-finite reduction is left out of the interval
    count = int(state["count"].numpy())
    bad = np.full(n, np.nan, np.float32)
    c.observe(tf.constant(bad), ctx(state))
    assert int(state["count"].numpy()) == count and np.isfinite(state["accum"].numpy()).all()


@pytest.mark.parametrize("algorithm", ["ring", "collective"])
def test_adaptive_decisions_identical_on_all_replicas(algorithm, devices):
    interval, n = 2, 600
    c = C.get("adaptive", min_ratio=0.01, max_ratio=0.1, threshold=0.3, interval=interval)
    ops = gs.CompressedAllReduce(c, algorithm=algorithm, error_feedback=False,
                                 timeout_seconds=60)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    scale = tf.Variable(1.0)

    def fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, scale * tf.random.stateless_normal([n], tf.stack([r, 5])))
    step = tf.function(lambda: strategy.run(fn))
    xs = [tf.random.stateless_normal([n], [r, 5]).numpy() for r in range(4)]
    reduced, levels = [], []
    for s in [1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4]:
        scale.assign(s)
        out = [v.numpy() for v in strategy.experimental_local_results(step())]
        state = ops._state.values()
        level = [int(state[k]) for k in sorted(state) if k.endswith("_level")]
        assert len(level) == 4 and len(set(level)) == 1          # one decision everywhere
        for o in out[1:]:
            np.testing.assert_array_equal(out[0], o)
        # the reduction used this step's ratio: the sum of each replica's top k
        k = 60 if (levels[-1] if levels else 1) else 6
        want = np.zeros(n, np.float32)
        for x in xs:
            keep = np.argsort(-np.abs(s * x), kind="stable")[:k]
            want[keep] += s * x[keep]
        np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-6)
        reduced.append(out[0])
        levels.append(level[0])
    # levels[i] is the decision after step i, i.e. the level of step i + 1
    assert [1] + levels[:-1] == _accordion(reduced, interval, 0.3)
    assert set(levels) == {0, 1}


def test_adaptive_inner_and_error_feedback():
    with pytest.raises(ValueError, match="sparsifying inner compressor, got 'sign'; valid: "
                                         "randomk, threshold, topk"):
        C.get("adaptive", inner="sign")
    with pytest.raises(ValueError, match="got QSGD"):
        C.get("adaptive", inner=C.get("qsgd"))
    c = C.get("adaptive", inner=C.get("threshold", sample_ratio=0.5), min_ratio=0.1, max_ratio=0.2)
    assert [v.ratio for v in c.variants] == [0.1, 0.2]
    assert all(v.sample_ratio == 0.5 for v in c.variants)
    r = C.get("adaptive", inner="randomk")
    assert r.unbiased and not r.summable and r.num_variants == 2
    ef = C.ErrorFeedback(r)
    assert all(not v.scale for v in ef.inner.variants)
    assert C.get("adaptive", min_ratio=0.05, max_ratio=0.05).num_variants == 1
