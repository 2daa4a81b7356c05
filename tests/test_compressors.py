"""Conformance battery over every registered compressor, and numpy models of each one.

Every compressor runs the way the pipeline runs it: its rounds driven by
`compression.driver.run` with an in-process exchange (tests/_compress.py). The numpy
models check the per-tensor statistics on a bucket of several tensors (a convolution
kernel, a matrix, biases, a scalar and an empty tensor).
"""

import math
import os
import types
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import compression as C
from tf_gradsync.compression import _bits, _draws, _segments, _selection, _sparse, _util, xla
from _compress import context, make_state, reduce, roundtrip
import _tf_keras  # tests/_tf_keras.py

FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
#: A bucket of several tensors; the empty one holds no elements.
SHAPES = ((3, 3, 2, 4), (4,), (0, 5), (50, 10), (10,), ())
LAYOUT = C.Layout(SHAPES)
N = LAYOUT.numel                      # 72 + 4 + 500 + 10 + 1 = 587


def rand(n, seed=0, dtype=tf.float32, scales=None):
    """Normal entries; with `scales`, tensor t of LAYOUT is scaled by scales[t]."""
    x = np.random.default_rng(seed).standard_normal(n)
    if scales is not None:
        x = x * np.repeat(scales, LAYOUT.sizes)
    return tf.constant(x, dtype)


def tensors(v):
    """The non-empty tensors of a LAYOUT bucket, as flat numpy arrays."""
    v = np.asarray(v)
    return [v[o:o + s] for o, s in zip(LAYOUT.offsets, LAYOUT.sizes) if s]


#: The package's own compressors (a user's, registered by a plugin, `pytest -p mymodule`,
#: runs the battery too, but not the checks of built-in numbers).
OURS = [n for n in C.names() if type(C.get(n)).__module__.startswith("tf_gradsync.")]

#: Per-tensor magnitudes spanning six orders: a shared statistic would zero the small ones.
SCALES = np.array([1.0, 1e-3, 1.0, 1e3, 1e-2, 5.0])


# ----------------------------------------------------------------- battery
@pytest.mark.parametrize("name", C.names())
def test_registered_defaults(name):
    c = C.get(name)
    assert type(c).name == name and repr(c).startswith(type(c).__name__)
    assert c.num_modes >= 1
    if name in OURS:
        assert "Example" in type(c).__doc__
        assert c.has_own_memory == (name in ("dgc", "powersgd"))


@pytest.mark.parametrize("name", C.names())
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_roundtrip_shape_dtype(name, dtype):
    c = C.get(name)
    x = rand(N, dtype=dtype)
    c.check_input(x)
    y = roundtrip(c, x, shapes=SHAPES)
    assert y.shape == (N,) and y.dtype == dtype
    assert np.all(np.isfinite(tf.cast(y, tf.float64).numpy()))


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", [n for n in C.names() if not C.get(n).summable])
def test_combine_is_the_sum_of_the_decodes(name, replicas):
    """Gathered payloads combine into the sum of their decodes (sparsifiers scatter all
    replicas' values at once, or place two and add them), here with replicas that mostly
    pick the same entries."""
    c = C.get(name).codec()
    base = rand(N, seed=9, scales=SCALES)
    payloads = []
    for r in range(replicas):
        x = base + 0.1 * rand(N, seed=r, scales=SCALES)
        payload, meta = c.compress(x, context(make_state(c, LAYOUT), layout=LAYOUT, replica=r))
        payloads.append(tuple(payload))
    want = sum(tf.cast(c.decompress(p, meta), tf.float64).numpy() for p in payloads)
    got = c.combine(payloads, meta)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", [n for n in C.names() if C.get(n).summable
                                  and type(C.get(n)).rounds is C.Compressor.rounds])
def test_summed_payloads_decode_to_the_sum_of_the_decodes(name):
    """What `summable` promises, and the wire relies on: payloads added elementwise
    decode to the sum of their decodes (one seed, so random-k's coordinates are shared)."""
    c = C.get(name)
    xs = [rand(N, seed=r, scales=SCALES) for r in range(3)]
    payloads, meta = [], None
    for r, x in enumerate(xs):
        payload, meta = c.compress(x, context(make_state(c, LAYOUT), layout=LAYOUT, replica=r))
        payloads.append(tuple(payload))
    summed = tuple(tf.add_n(list(parts)) for parts in zip(*payloads))
    want = sum(c.decompress(p, meta).numpy().astype(np.float64) for p in payloads)
    tol = 2e-2 if any(t.dtype in (tf.float16, tf.bfloat16) for t in summed) else 1e-6
    np.testing.assert_allclose(c.decompress(summed, meta).numpy(), want, rtol=tol,
                               atol=tol * np.abs(want).max())


BATCHED = [n for n in C.names() if C.get(n).batched_decode]


@pytest.mark.parametrize("shapes", [SHAPES, ((3000,),)], ids=["several", "one"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", BATCHED)
def test_batched_decode_is_each_rows_decode_bit_for_bit(name, dtype, shapes):
    """Payloads stacked along a leading axis decode row by row as each alone would,
    and combine sums them as a reduction over the stacked decodes would: the same sum
    on every replica."""
    c, layout = C.get(name).codec(), C.Layout(shapes)
    payloads = []
    for r in range(4):
        x = tf.cast(rand(layout.numel, seed=r), dtype)
        payload, meta = c.compress(x, context(make_state(c, layout), layout=layout, replica=r))
        payloads.append(tuple(payload))
    rows = c.decompress(tuple(tf.stack(ts) for ts in zip(*payloads)), meta)
    alone = tf.stack([c.decompress(p, meta) for p in payloads])
    assert rows.dtype == alone.dtype == dtype and rows.shape == (4, layout.numel)
    np.testing.assert_array_equal(rows.numpy(), alone.numpy())
    np.testing.assert_array_equal(c.combine(payloads, meta).numpy(),
                                  tf.reduce_sum(alone, 0).numpy())


def test_sparse_decodes_match_numpy():
    """`place` puts distinct indices' values into zeros; `sum_sparse` adds parts whose
    indices repeat across them."""
    rng = np.random.default_rng(4)
    n = 50
    indices = [[21, 1, 5, 9, 13, 17], [1, 5, 30, 31, 49, 0], [9, 40, 41, 42, 43, 44]]
    parts = [(rng.standard_normal(6).astype(np.float32), np.array(i, np.int32))
             for i in indices]
    want = np.zeros(n, np.float32)
    np.put(want, parts[0][1], parts[0][0])
    np.testing.assert_array_equal(_sparse.place(*parts[0], n, tf.float32).numpy(), want)
    for count in (1, 2, 3):
        want = np.zeros(n, np.float64)
        for v, i in parts[:count]:
            np.add.at(want, i, v)
        got = _sparse.sum_sparse(parts[:count], n, tf.float32)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError):
        _sparse.place(np.ones(1, np.float32), np.array([n], np.int32), n, tf.float32)


@pytest.mark.parametrize("name", ["threshold", "dgc"])
def test_selection_pads_at_distinct_unselected_entries(name):
    """With fewer candidates than k, the selection pads with zeros at entries it did not
    select, so every index is distinct and the payload decodes to the selection."""
    x = np.zeros(50_000, np.float32)
    x[[0, 3, 9000, 49_999]] = [1.0, -2.0, 3.0, 4.0]
    c = C.get(name).codec()
    layout = C.Layout.flat(50_000)
    (values, idx), meta = c.compress(tf.constant(x), context(make_state(c, layout), layout=layout))
    idx, values = idx.numpy(), values.numpy()
    assert len(np.unique(idx)) == len(idx) == 500
    np.testing.assert_array_equal(np.sort(idx[values != 0]), [0, 3, 9000, 49_999])
    np.testing.assert_array_equal(c.decompress((values, idx), meta).numpy(), x)


@pytest.mark.parametrize("name", C.names())
def test_all_zeros_and_single_element(name):
    c = C.get(name)
    np.testing.assert_array_equal(roundtrip(c, tf.zeros([N]), shapes=SHAPES).numpy(),
                                  np.zeros(N))
    # n = 1: every compressor sends it exactly.
    np.testing.assert_allclose(roundtrip(c, tf.constant([-0.75])).numpy(), [-0.75], rtol=1e-6)


@pytest.mark.parametrize("name", C.names())
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_propagates(name, bad):
    """Documented behaviour: a NaN/Inf in the bucket makes the reconstruction non-finite."""
    c = C.get(name, **({"start_iter": 0} if name == "powersgd" else {}))
    x = rand(N).numpy()
    x[100] = bad
    y = roundtrip(c, tf.constant(x), shapes=SHAPES)
    assert not np.all(np.isfinite(y.numpy()))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf", "xla"])
@pytest.mark.parametrize("name", C.names())
def test_non_finite_entry_in_a_large_tensor(name, jit_compile):
    """A tensor long enough for the sampled selections (`_selection.LARGE`), with one
    NaN or Inf at its start, middle or end (the vectorised loops' tails): the step
    runs, its result is not finite, and the state (error feedback, momentum) is left
    finite, as the defaults of `CompressedAllReduce` build the compressor (DGC's and
    threshold's candidates are binned by magnitude, where a NaN must not become an
    out-of-range bin)."""
    c = C.with_error_feedback(C.get(name, **({"start_iter": 0} if name == "powersgd" else {})),
                              None)
    shapes = ((2 * _selection.LARGE + 1,), (40,))
    n = sum(s[0] for s in shapes)
    for pos, bad in [(0, math.inf), (n // 3, math.nan), (shapes[0][0] - 1, math.nan),
                     (shapes[0][0] - 2, -math.inf)]:
        x = rand(n, seed=pos).numpy()
        x[pos] = bad
        state = make_state(c, C.Layout(shapes))
        y = roundtrip(c, tf.constant(x), state, shapes=shapes, jit_compile=jit_compile)
        assert not np.all(np.isfinite(y.numpy())), (pos, bad)
        for key, value in state.items():
            assert np.all(np.isfinite(value.numpy())), (pos, bad, key)


@pytest.mark.parametrize("name", C.names())
def test_short_tensors_all_nan_on_one_replica(name):
    """Short tensors of no power-of-two length, all NaN on one replica (a loss scale's
    overflow): the step runs and its result is not finite (the sparsifiers ranked their
    padding above the NaNs and gathered past the bucket's end), and the next, finite
    step is finite again."""
    shapes = ((100,), (30, 7))
    n = sum(math.prod(s) for s in shapes)
    c = C.with_error_feedback(C.get(name), None)
    states = [make_state(c, C.Layout(shapes)) for _ in range(2)]
    bad = np.full(n, math.nan, np.float32)
    out = reduce(c, [rand(n), tf.constant(bad)], states, shapes=shapes)
    assert not np.all(np.isfinite(out.results[0].numpy()))
    out = reduce(c, [rand(n, seed=1), rand(n, seed=2)], states, step=1, shapes=shapes)
    assert np.all(np.isfinite(out.results[0].numpy()))


@pytest.mark.parametrize("name,dtype", [("fp16", tf.bfloat16), ("bf16", tf.float16),
                                        ("fp16", tf.float16)])
def test_a_cast_sends_16_bit_buckets_as_they_are(name, dtype):
    """fp16 on bfloat16 gradients kept neither their range nor their small values (1e6
    overflowed, 1e-9 vanished), bf16 on float16 their precision, for no byte saved: the
    payload is the bucket itself, and the sum that of `none`."""
    big, small = (1e6, 1e-9) if dtype == tf.bfloat16 else (1e4, 1e-6)
    x = [tf.constant([big, small, 0.3], dtype), tf.constant([2 * big, 3 * small, 0.1], dtype)]
    out = reduce(C.get(name), x)
    assert out.payloads[0][0].dtype == dtype
    want = reduce(C.get("none"), x).results[0].numpy().astype(np.float64)
    got = out.results[0].numpy().astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2)
    assert np.all(np.isfinite(got)) and got[1] > 0


@pytest.mark.parametrize("name", C.names())
def test_replicas_agree_and_error_is_measured(name):
    """Every replica gets the same reduction; the reported error is the compressor's:
    zero exactly where the reduction is a plain all-reduce's (a compressor of a dense
    warm-up, as PowerSGD's first step, included)."""
    c = C.get(name)
    xs = [rand(N, seed=r, scales=SCALES) for r in range(3)]
    out = reduce(c, xs, shapes=SHAPES)
    for y in out.results[1:]:
        np.testing.assert_array_equal(y.numpy(), out.results[0].numpy())
    assert 0 <= out.error < 2
    plain = reduce(C.get("none"), xs, shapes=SHAPES).results[0].numpy()
    lossless = np.allclose(out.results[0].numpy(), plain, rtol=1e-6,
                           atol=1e-6 * np.abs(plain).max())
    assert (out.error == 0) == lossless, (out.error, lossless)


@pytest.mark.parametrize("name", [n for n in C.names() if C.get(n).exact])
def test_exact_compressors_roundtrip_bit_for_bit_and_skip_the_error(name):
    """`exact` promises decompress(compress(x)) == x, so no error terms are computed."""
    c = C.get(name)
    xs = (rand(33, dtype=tf.float64), tf.range(10), rand(5, dtype=tf.bfloat16))
    for x in xs if not c.floating_only else xs[::2]:
        np.testing.assert_array_equal(roundtrip(c, x).numpy(), x.numpy())
    ctx = C.base.Context(layout=C.base.Layout.flat(33, tf.float64), errors=[])
    c.encode(xs[0], ctx)
    assert ctx.errors == []


@pytest.mark.parametrize("name", ["topk", "threshold", "randomk", "dgc"])
def test_ratio_one_is_lossless(name):
    c = C.get(name, ratio=1.0)
    x = rand(N, scales=SCALES)
    np.testing.assert_allclose(roundtrip(c, x, shapes=SHAPES).numpy(), x.numpy(), rtol=1e-6)


#: Unbiased configurations (randomk and terngrad are biased at their defaults).
UNBIASED = [("qsgd", {}), ("randomk", {"scale": True, "ratio": 0.25}),
            ("terngrad", {"clip": None, "rms_clip": None})]


@pytest.mark.parametrize("name,kwargs", UNBIASED, ids=[n for n, _ in UNBIASED])
def test_unbiased(name, kwargs):
    """The mean of many reconstructions converges to x: per tensor, its squared distance
    from x is what the sample variance predicts for the mean of `trials` draws (a bias
    would add a term that does not shrink with the trials)."""
    c = C.get(name, **kwargs)
    assert c.unbiased
    trials = 400
    x = rand(N, seed=3, scales=SCALES)
    f = tf.function(lambda s: roundtrip(c, x, seed=tf.stack([s, tf.constant(7, tf.int64)]),
                                        shapes=SHAPES))
    ys = np.stack([f(tf.constant(t, tf.int64)).numpy() for t in range(trials)])
    for t, (mean, var, want) in enumerate(zip(tensors(ys.mean(0)), tensors(ys.var(0)),
                                              tensors(x.numpy()))):
        bias_sq = np.sum((mean - want) ** 2)
        expected = np.sum(var) / trials
        assert bias_sq <= 4 * expected + 1e-10 * np.sum(want ** 2), (t, bias_sq, expected)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_replicas_round_independently(name):
    """Stochastic rounding is seeded per replica: averaging N replicas of the same
    gradient cuts the error as 1 / sqrt(N), which shared noise would not."""
    c = C.get(name)
    x = rand(1 << 14, seed=5)
    err = [np.linalg.norm(reduce(c, [x] * k, mean=True).results[0].numpy() - x.numpy())
           for k in (1, 4)]
    assert err[1] < 0.6 * err[0], err


def test_error_terms_are_accurate_on_large_buckets():
    """The squared norms behind `comm_error` (and the residual's finiteness check) keep
    float32's precision on a bucket of 20M entries (a dot product of the bucket with
    itself read 1.6% low)."""
    n = 20_000_000
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    want = float(np.sum(x.astype(np.float64) ** 2))
    residual = tf.Variable(tf.zeros([n]))

    @tf.function
    def terms(x):
        ctx = C.Context(errors=[])
        ctx.record_error(x, None)
        ctx.keep_residual(residual, x, x * 0.5)
        return ctx.errors
    (err0, norm0), (err1, norm1) = terms(tf.constant(x))
    assert float(err0) == 0
    assert float(norm0) == pytest.approx(want, rel=1e-6)
    assert float(norm1) == pytest.approx(want, rel=1e-6)
    assert float(err1) == pytest.approx(want / 4, rel=1e-6)
    np.testing.assert_array_equal(residual.numpy(), x * 0.5)


@pytest.mark.parametrize("byteorder", ["little", "big"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_matches_numpy_and_unpacks(bits, byteorder, monkeypatch):
    """Codes packed LSB first, 8 // bits per byte, the last byte padded with zeros: by
    one multiply per word on little-endian hosts, by a weighted sum elsewhere."""
    monkeypatch.setattr(_bits.sys, "byteorder", byteorder)
    per = 8 // bits
    for n in (1, per + 1, 8 * 1001 + 3):
        codes = np.random.default_rng(n).integers(0, 1 << bits, n)
        want = (np.pad(codes, (0, -n % per)).reshape(-1, per)
                << (bits * np.arange(per))).sum(1).astype(np.uint8)
        for fn in (_bits.pack, tf.function(_bits.pack, reduce_retracing=False)):
            got = fn(tf.constant(codes, tf.int32), bits).numpy()
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(_bits.unpack(tf.constant(got), bits, n).numpy(), codes)


# ----------------------------------------------------------------- numpy models
def _packbits(bits):
    return np.packbits(np.asarray(bits, np.uint8), bitorder="little")


def _uniform(n, c, seed=(1, 2)):
    """The uniform draws replica 0 makes (Context.replica_seed)."""
    return _draws.uniform(n, context(seed=seed).replica_seed()).numpy()


def test_int8_reference():
    x = rand(N, seed=2, scales=SCALES).numpy().astype(np.float32)
    (q, scale), _ = C.get("int8").compress(tf.constant(x), context(layout=LAYOUT))
    want_scale = np.array([np.abs(t).max() / 127 for t in tensors(x)], np.float32)
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-6)
    expanded = np.repeat(want_scale, [s for s in LAYOUT.sizes if s])
    np.testing.assert_array_equal(q.numpy(), np.round(x / expanded).astype(np.int8))
    y = roundtrip(C.get("int8"), tf.constant(x), shapes=SHAPES).numpy()
    np.testing.assert_allclose(y, q.numpy() * expanded, rtol=1e-6)
    # Every tensor keeps its own resolution: no tensor is rounded away.
    for a, b in zip(tensors(y), tensors(x)):
        np.testing.assert_allclose(a, b, atol=np.abs(b).max() / 254 * 1.001)


def _blocks(v, block):
    """The blocks of `block` entries of each non-empty LAYOUT tensor of `v`."""
    return [t[i:i + block] for t in tensors(v) for i in range(0, len(t), block)]


BF16_RTOL = 2.0 ** -8     # one bfloat16 rounding


@pytest.mark.parametrize("block,scale", [(32, "l2"), (None, "l1"), (7, "l1")])
def test_sign_reference(block, scale):
    x = rand(N, seed=4, scales=SCALES).numpy()
    c = C.get("sign", block=block, scale=scale)
    (packed, scales), meta = c.compress(tf.constant(x, tf.float32), context(layout=LAYOUT))
    np.testing.assert_array_equal(packed.numpy(), _packbits(x >= 0))
    pieces = tensors(x) if block is None else _blocks(x, block)
    want = np.array([np.sqrt(np.mean(p ** 2)) if scale == "l2" else np.abs(p).mean()
                     for p in pieces])
    assert scales.dtype == tf.bfloat16
    np.testing.assert_allclose(scales.numpy().astype(np.float64), want, rtol=BF16_RTOL)
    expanded = np.repeat(scales.numpy().astype(np.float64), [len(p) for p in pieces])
    np.testing.assert_allclose(c.decompress((packed, scales), meta).numpy(),
                               np.where(x >= 0, 1, -1) * expanded, rtol=1e-6)


def test_onebit_reference():
    x = rand(N, seed=5, scales=SCALES).numpy()
    y = roundtrip(C.get("onebit"), tf.constant(x, tf.float32), shapes=SHAPES).numpy()

    def rms(v):
        return np.sqrt(np.mean(v ** 2)) if len(v) else 0.0
    want = np.concatenate([np.where(p >= 0, rms(p[p >= 0]), -rms(p[p < 0]))
                           for p in _blocks(x, 32)])
    np.testing.assert_allclose(y, want, rtol=BF16_RTOL)
    y = roundtrip(C.get("onebit"), tf.constant([1.0, 7.0]))   # empty negative class
    np.testing.assert_allclose(y.numpy(), [5.0, 5.0])


def test_qsgd_reference():
    chunk, levels = 16, 8
    c = C.get("qsgd", levels=levels, chunk=chunk)
    x = rand(N, seed=7, scales=SCALES).numpy().astype(np.float32)
    (q, norms), meta = c.compress(tf.constant(x), context(layout=LAYOUT))
    pieces = [t[i:i + chunk] for t in tensors(x) for i in range(0, len(t), chunk)]
    want_norms = np.array([np.linalg.norm(p) for p in pieces], np.float32)
    np.testing.assert_allclose(norms.numpy(), want_norms, rtol=1e-5)
    expanded = np.repeat(want_norms, [len(p) for p in pieces])
    level = np.minimum(np.floor(np.abs(x) * levels / expanded + _uniform(N, c)), levels)
    np.testing.assert_array_equal(q.numpy(), (np.sign(x) * level).astype(np.int8))
    np.testing.assert_allclose(c.decompress((q, norms), meta).numpy(),
                               q.numpy() * expanded / levels, rtol=1e-5)


@pytest.mark.parametrize("optimizer,bound", [(None, 2.5), ("sgd", 2.5), ("adam", 1.0),
                                             ("rmsprop", 1.0)])
def test_terngrad_reference(optimizer, bound):
    """Clipped per tensor at 2.5 sigma, or at `rms_clip` once an optimizer that divides by
    a running root mean square has been met."""
    x = rand(N, seed=6, scales=SCALES).numpy().astype(np.float32)
    x[LAYOUT.offsets[3] + 7] = 50 * 1e3            # an outlier in the matrix
    c = C.get("terngrad")
    if optimizer is not None:
        c.check_optimizer(tf.keras.optimizers.get(optimizer))
    (packed, scale), meta = c.compress(tf.constant(x), context(layout=LAYOUT))
    clipped = [np.clip(t, -bound * t.std(), bound * t.std()) if t.std() > 0 else t
               for t in tensors(x)]
    want_scale = np.array([np.abs(t).max() for t in clipped], np.float32)
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-5)
    v = np.concatenate(clipped)
    s = np.repeat(want_scale, [len(t) for t in clipped])
    t = np.where(_uniform(N, c) < np.abs(v) / s, np.sign(v), 0)
    codes = np.pad(np.where(t > 0, 1, np.where(t < 0, 2, 0)), (0, -N % 4)).reshape(-1, 4)
    np.testing.assert_array_equal(packed.numpy(), (codes * [1, 4, 16, 64]).sum(1).astype(np.uint8))
    np.testing.assert_allclose(c.decompress((packed, scale), meta).numpy(), t * s, rtol=1e-6)


def _topk_model(x, ratio, layout=LAYOUT):
    """Per tensor, the k = max(1, ceil(ratio * size)) largest entries (ties: lower index)."""
    out = np.zeros_like(x)
    for o, s in zip(layout.offsets, layout.sizes):
        if s:
            k = min(s, max(1, math.ceil(ratio * s)))
            keep = o + np.argsort(-np.abs(x[o:o + s]), kind="stable")[:k]
            out[keep] = x[keep]
    return out


@pytest.mark.parametrize("name", ["topk", "threshold"])
def test_sparsifiers_select_per_tensor(name):
    x = rand(N, seed=1, scales=SCALES).numpy().astype(np.float32)
    c = C.get(name, ratio=0.03)
    (values, idx), _ = c.compress(tf.constant(x), context(layout=LAYOUT))
    k = sum(max(1, math.ceil(0.03 * s)) for s in LAYOUT.sizes if s)
    assert values.shape == (k,) and idx.dtype == tf.int32
    y = roundtrip(c, tf.constant(x), shapes=SHAPES).numpy()
    np.testing.assert_array_equal(y, _topk_model(x, 0.03))
    # The smallest tensor sends its largest entry although the matrix dwarfs it.
    assert np.count_nonzero(tensors(y)[1]) == 1


def test_threshold_on_long_tensors_and_padding():
    big = rand(50_000, seed=9).numpy()
    (vals, idx), _ = C.get("threshold", ratio=0.01).compress(tf.constant(big), context())
    assert vals.shape == (500,)
    assert len(set(np.argsort(-np.abs(big))[:500]) & set(idx.numpy())) >= 475
    sparse = np.zeros(50_000, np.float32)
    sparse[[0, 3, 9000, 49999]] = [1.0, -2.0, 3.0, 4.0]   # fewer candidates than k: padding
    c = C.get("threshold", ratio=0.01)
    (vals, idx), _ = c.compress(tf.constant(sparse), context())
    assert vals.shape == (500,)
    np.testing.assert_array_equal(roundtrip(c, tf.constant(sparse)).numpy(), sparse)


def test_randomk_per_tensor_shared_coordinates():
    for scale in (False, True):
        c = C.get("randomk", ratio=0.1, scale=scale)
        xs = [rand(N, seed=s, scales=SCALES) for s in range(3)]
        out = reduce(c, xs, shapes=SHAPES)
        assert out.transports == ["sum"]
        total = tf.add_n(xs).numpy()
        y = out.results[0].numpy()
        for t, (a, b) in enumerate(zip(tensors(y), tensors(total))):
            size = len(b)
            k = min(size, max(1, math.ceil(0.1 * size)))
            nz = np.flatnonzero(a)
            bounds = np.arange(k + 1) * size // k             # k strata of nearly equal length
            stratum = np.searchsorted(bounds, nz, side="right") - 1
            np.testing.assert_array_equal(stratum, np.arange(k))    # one entry from each
            factor = np.diff(bounds)[stratum] if scale else 1
            np.testing.assert_allclose(a[nz], b[nz] * factor, rtol=1e-5)
    # Different seeds, different coordinates; the same seed, the same ones.
    c = C.get("randomk", ratio=0.1)
    x = rand(N)
    a, b, a2 = (roundtrip(c, x, seed=s, shapes=SHAPES).numpy() for s in ((1, 2), (3, 4), (1, 2)))
    np.testing.assert_array_equal(a, a2)
    assert set(np.flatnonzero(a)) != set(np.flatnonzero(b))


@pytest.mark.parametrize("ratio,stride", [(0.5, 2), (0.25, 4), (1 / 32, 32)])
def test_randomk_equal_strata_one_entry_each_uniformly(ratio, stride):
    """Sizes that k divides into strata of one power-of-two length (the drawn bits): one
    entry of each stratum, each entry of a stratum equally likely, every stratum drawn
    independently of the others, as on the general path."""
    shapes = ((4, 16), (32,), (0, 3), (2, 2, 8))      # every size a multiple of 32
    layout = C.Layout(shapes)
    n, draws = layout.numel, 800
    x = tf.constant(np.arange(1, n + 1), tf.float32)
    counts, pairs = np.zeros(n), np.zeros((stride, stride))
    for s in range(draws):
        for scale in (False, True) if s == 0 else (False,):
            y = roundtrip(C.get("randomk", ratio=ratio, scale=scale), x, seed=(s, 5),
                          shapes=shapes).numpy()
            kept = np.flatnonzero(y)
            np.testing.assert_array_equal(kept // stride, np.arange(n // stride))
            np.testing.assert_array_equal(y[kept], x.numpy()[kept] * (stride if scale else 1))
        counts[kept] += 1
        pairs[kept[0] % stride, kept[1] % stride] += 1     # strata 0 and 1 together
    p = 1 / stride
    sigma = math.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - draws * p) < 5 * sigma), counts
    # Independence: the joint offsets of two strata fill the stride x stride grid evenly.
    q = draws / stride ** 2
    assert np.all(np.abs(pairs - q) < 5 * math.sqrt(q) + 1), pairs


@pytest.mark.parametrize("stride", [1, 2, 4, 32])
@pytest.mark.parametrize("compiled", [False, True])
def test_strided_coordinates_take_and_place_as_listed_indices(stride, compiled):
    """Tiled strata keep only their Philox words; what they take and place is what a
    gather at, and a placement to, the listed indices i * stride + offset give."""
    seg = _segments.Segments.of(C.Layout(((64, 32), (96,))))
    ks = [s // stride for s in seg.sizes]
    x = tf.constant(np.random.default_rng(stride).normal(size=seg.numel), tf.float32)
    drawn = _draws.random_per_segment(tf.constant([3, stride], tf.int64), seg, ks)
    assert drawn.indices is None and drawn.stride == stride
    k = seg.numel // stride
    offsets = (np.zeros(k, np.int64) if stride == 1 else
               _draws._fields(drawn.words, k, stride.bit_length() - 1).numpy())
    indices = np.arange(k) * stride + offsets
    listed = _draws.Drawn(seg.numel, drawn.lengths, indices=tf.constant(indices, tf.int32))
    run = xla.call if compiled else (lambda fn, *a: fn(*a))
    plus = tf.constant(0.5)
    for d in (drawn, listed):
        got = run(lambda x, p: d.take(x, plus=p), x, plus).numpy()
        np.testing.assert_array_equal(got, x.numpy()[indices] + 0.5)
        dense = run(lambda v: d.place(v, tf.float32), tf.constant(got)).numpy()
        want = np.zeros(seg.numel, np.float32)
        want[indices] = got
        np.testing.assert_array_equal(dense, want)


def test_gather_many_pads_to_one_capacity_for_the_compiled_gather():
    """A compiled stage gathers the indices padded to the one static capacity (so each
    call site compiles once); more indices than that take TensorFlow's gather. Either
    way the result is what `tf.gather` gives."""
    x = tf.constant(np.random.default_rng(0).normal(size=1000), tf.float32)
    lengths = []

    def compiled(fn, values, indices):
        lengths.append(int(indices.shape[0]))
        return xla.call(fn, values, indices)
    for count in (0, 1, 63, 64, 65, 999):
        idx = tf.constant(np.sort(np.random.default_rng(count).choice(1000, count, False)),
                          tf.int32)
        for stage in (compiled, _util.inline):
            got = tf.function(lambda x, i, s=stage: _selection.gather_many(x, i, 64, s))(x, idx)
            np.testing.assert_array_equal(got.numpy(), x.numpy()[idx.numpy()])
    assert lengths and set(lengths) == {64}


def test_fp16_without_prescale_casts_the_gradient_and_divides_the_sum():
    """fp16 divides by N before the cast by default (a mean on the wire: no overflow,
    small entries pushed towards float16's subnormals); `prescale=False` sends the
    gradient as it is, N times more room for small entries, and a sum past 65504 is
    Inf, as a plain fp16 all-reduce gives."""
    n = 4
    rng = np.random.default_rng(7)
    xs = [tf.constant(rng.standard_normal(N) * 1e-6, tf.float32) for _ in range(n)]
    exact = np.sum([x.numpy().astype(np.float64) for x in xs], axis=0)
    errors = {}
    for prescale in (True, False):
        c = C.get("fp16", prescale=prescale)
        out = reduce(c, xs, shapes=SHAPES)
        sent = xs[0] / n if prescale else xs[0]
        np.testing.assert_array_equal(out.payloads[0][0].numpy(),
                                      tf.cast(sent, tf.float16).numpy())
        errors[prescale] = np.abs(out.results[0].numpy() - exact).max() / np.abs(exact).max()
        mean = reduce(c, xs, shapes=SHAPES, mean=True).results[0].numpy()
        np.testing.assert_allclose(mean, out.results[0].numpy() / n, rtol=1e-6)
    assert errors[False] < errors[True] / 2, errors
    big = [tf.fill([N], 4e4) for _ in range(2)]
    assert np.isinf(reduce(C.get("fp16", prescale=False), big).results[0].numpy()).all()
    np.testing.assert_array_equal(reduce(C.get("fp16"), big).results[0].numpy(), 8e4)
    with pytest.raises(ValueError, match="prescale must be a bool"):
        C.get("fp16", prescale="no")


def test_nonzero_gives_the_positions_of_a_mask_in_order():
    """A mask's positions equal numpy's `flatnonzero` (empty, none, all and a random
    tenth true), eagerly and traced, and are found in the graph: no Python call, which
    would wait for the interpreter lock in every step."""
    rng = np.random.default_rng(3)
    for mask in (np.zeros(0, bool), np.zeros(70, bool), np.ones(70, bool),
                 rng.random(100_003) < 0.1):
        want = np.flatnonzero(mask)
        traced = tf.function(_selection.nonzero)
        for got in (_selection.nonzero(tf.constant(mask)), traced(tf.constant(mask))):
            assert got.dtype == tf.int32
            np.testing.assert_array_equal(got.numpy(), want)
    graph = tf.function(_selection.nonzero).get_concrete_function(
        tf.TensorSpec([None], tf.bool)).graph
    kinds = {op.type for op in graph.get_operations()}
    assert not any("PyFunc" in kind for kind in kinds), kinds


def test_randomk_cyclic_covers_every_entry_once_per_cycle():
    c = C.get("randomk", ratio=0.1, cyclic=True)
    x = rand(N, scales=SCALES)
    sent = []
    for step in range(12):
        y = roundtrip(c, x, step=step, seed=(step, 9), shapes=SHAPES).numpy()
        np.testing.assert_array_equal(y[y != 0], x.numpy()[y != 0])   # kept as they are
        sent.append(y != 0)
    for o, s in zip(LAYOUT.offsets, LAYOUT.sizes):
        if not s:
            continue
        k = max(1, math.ceil(0.1 * s))
        cycle = math.ceil(s / k)                      # 9, 4, 10, 10, 1 steps
        covered = np.any([m[o:o + s] for m in sent[:cycle]], axis=0)
        assert covered.all(), (s, cycle)
        # Within a cycle each step brings k entries, new ones until the last step.
        assert sum(int(m[o:o + s].sum()) for m in sent[:cycle]) == cycle * k
    # A new cycle draws a new order: the 72-entry kernel's first step of cycle 2.
    assert not np.array_equal(sent[0][:72], sent[9][:72])


# ----------------------------------------------------------------- DGC
@pytest.mark.parametrize("jit_compile", [False, True])
def test_dgc_reference_three_steps(jit_compile):
    """Momentum correction and factor masking against numpy, as TensorFlow's ops and
    with its elementwise stages compiled."""
    ratio, m = 0.1, 0.9
    c = C.get("dgc", ratio=ratio, momentum=m)
    state = make_state(c, LAYOUT)
    u, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for step in range(3):
        g = rand(N, seed=10 + step, scales=SCALES).numpy().astype(np.float32)
        u = m * u + g
        v = v + u
        ref = _topk_model(v, ratio)
        sent = ref != 0
        u[sent] = 0
        v[sent] = 0
        y = roundtrip(c, tf.constant(g), state, step=step, shapes=SHAPES,
                      jit_compile=jit_compile)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["u"].numpy(), u, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["v"].numpy(), v, rtol=1e-5, atol=1e-6)


def test_dgc_warmup_clip_and_nan_reset():
    c = C.get("dgc", ratio=0.01, warmup_steps=100, warmup_ratio=0.25)
    state = make_state(c, C.Layout.flat(400))
    # stages 0.25, 0.0855, 0.0292, 0.01 (a factor 2.92 each), a third of the warm-up each
    assert c.num_modes == 4
    steps = (0, 33, 34, 66, 67, 99, 100, 500)
    sizes = [reduce(c, [rand(400)], [state], step=s).payloads[0][0].shape[0] for s in steps]
    assert sizes == [100, 100, 35, 35, 12, 12, 4, 4]
    assert [int(c.mode(context(step=s))) for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert C.get("dgc", ratio=0.001, warmup_steps=10).ratios == pytest.approx(
        [0.25, 0.0629, 0.0158, 0.00398, 0.001], rel=1e-2)   # the paper's ladder, roughly
    c = C.get("dgc", ratio=1.0, momentum=0.0, clip_norm=2.0)
    y = reduce(c, [10 * rand(64)] * 4, mean=True).results[0]
    np.testing.assert_allclose(np.linalg.norm(y.numpy()), 1.0, rtol=1e-5)
    # A non-finite entry resets u and v, read from v's norm with the error measured and
    # from v's sum without.
    c = C.get("dgc", ratio=0.1)
    for jit_compile, measure_error, bad in [(False, True, math.nan), (True, True, math.nan),
                                            (False, False, math.nan), (True, False, -math.inf)]:
        state = make_state(c, C.Layout.flat(64))
        roundtrip(c, rand(64), state)
        assert state["u"].numpy().any() and state["v"].numpy().any()
        x = rand(64).numpy()
        x[3] = bad
        out = reduce(c, [tf.constant(x)], [state], jit_compile=jit_compile,
                     measure_error=measure_error)
        assert np.isnan(out.results[0].numpy()).any()
        assert not state["u"].numpy().any() and not state["v"].numpy().any()


class _Optimizer:
    def __init__(self, **config):
        self.config = config

    def get_config(self):
        return self.config


def test_dgc_refuses_an_optimizer_with_momentum():
    with pytest.raises(ValueError, match=r"dgc applies momentum 0.9 itself.*momentum=0.9"):
        C.get("dgc").check_optimizer(_Optimizer(momentum=0.9, learning_rate=0.1))
    C.get("dgc").check_optimizer(_Optimizer(momentum=0.0))
    C.get("dgc", momentum=0.0).check_optimizer(_Optimizer(momentum=0.9))
    with pytest.raises(ValueError, match=r"applies beta_1=0.9 again"):
        C.get("dgc").check_optimizer(_Optimizer(beta_1=0.9, beta_2=0.999))
    C.get("dgc").check_optimizer(_Optimizer(beta_1=0.0))
    C.get("topk").check_optimizer(_Optimizer(momentum=0.9))
    C.ErrorFeedback("topk").check_optimizer(_Optimizer(beta_1=0.9))


def test_dgc_adapts_sgd_to_train_without_its_momentum():
    """adapt_optimizer hands DGC the momentum: SGD's goes, at the same rate, and the
    result passes DGC's check without advice; Adam's first moment cannot go (refused)."""
    ops = gs.CompressedAllReduce("dgc")
    sgd = ops.adapt_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
    config = sgd.get_config()
    assert (config["momentum"], config["nesterov"]) == (0.0, False)
    assert config["learning_rate"] == pytest.approx(0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.compressor.check_optimizer(sgd)
    # Adam's first moment cannot go: adapting refuses it at once, as the first step would.
    with pytest.raises(C.OptimizerRefused, match="applies beta_1=0.9 again.*adapt_optimizer "
                                                 "cannot take beta_1 off for dgc"):
        ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3))
    with pytest.raises(ValueError, match="adapt_optimizer.optimizer. rebuilds it so"):
        ops.compressor.check_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))


@pytest.mark.parametrize("optimizer,adaptive", [
    (tf.keras.optimizers.Adam(), True), (tf.keras.optimizers.AdamW(), True),
    (tf.keras.optimizers.RMSprop(), True), (tf.keras.optimizers.Adagrad(), True),
    (tf.keras.optimizers.Adafactor(), True), (tf.keras.optimizers.Ftrl(), True),
    (tf.keras.optimizers.Ftrl(learning_rate_power=-1.0), False),
    (tf.keras.optimizers.SGD(0.1, momentum=0.9), False), (tf.keras.optimizers.Lion(), False),
    (_Optimizer(), False)])
def test_learning_rate_scale_by_optimizer(optimizer, adaptive):
    """Only optimizers that divide by a running root mean square need a larger rate,
    and only with payloads that leave entries out (sqrt of their send interval) or
    whose coarse values raise the mean square (1 / `rms_step`)."""
    def scale(c):
        return gs.CompressedAllReduce(c).learning_rate_scale(optimizer)
    expected = {"topk": 0.01 ** (-1 / 3), C.get("threshold", ratio=0.25): 4 ** (1 / 3),
                "randomk": 2 ** 0.5, C.get("randomk", ratio=0.1, scale=True): 10 ** 0.5,
                "adaptive": 0.01 ** (-1 / 3), C.get("dgc", momentum=0.0): 0.01 ** (-1 / 3),
                "sign": 1.25, "onebit": 1.25, C.get("sign", scale="l1"): 1.0,
                "terngrad": 1 / 0.8589, C.get("terngrad", rms_clip=None): 1 / 0.7010}
    for c, factor in expected.items():
        assert scale(c) == pytest.approx(factor if adaptive else 1.0, rel=1e-3), c
    for dense in ("none", "fp16", "int8", "qsgd", "powersgd"):
        assert scale(dense) == 1.0


# PowerSGD's step depends on how much of the gradient its rank holds, which a noise
# stream does not model; sparse payloads are priced by their send interval.
DENSE_CODES = [n for n in C.names() if n != "powersgd" and C.get(n).send_interval() == 1]


@pytest.mark.parametrize("name", DENSE_CODES)
def test_rms_step_matches_a_noise_stream(name):
    """`rms_step` against measurement: a stream of gradients (a fixed mean at a tenth of
    the noise, unit Gaussian noise) through the compressor as `CompressedAllReduce`
    builds it, set up for Adam; per entry, mean over root mean square of what arrives,
    along the mean's sign, relative to the same for the stream itself."""
    from tf_gradsync import costmodel
    compressor = gs.CompressedAllReduce(name).compressor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", C.OptimizerAdvice)
        compressor.check_optimizer(tf.keras.optimizers.Adam())     # TernGrad's bound
    run = costmodel.roundtrip_fn(compressor, C.Layout(((64, 256),)))
    rng = np.random.default_rng(0)
    mean = 0.1 * rng.standard_normal(64 * 256).astype(np.float32)
    sent, arrived = [], []
    for step in range(60):
        x = mean + rng.standard_normal(mean.size).astype(np.float32)
        y = run(tf.constant(x))[0].numpy()
        if step >= 20:                               # error feedback settled
            sent.append(x)
            arrived.append(y)

    def progress(stream):
        stream = np.asarray(stream, np.float64)
        rms = np.sqrt(np.mean(stream ** 2, axis=0))
        return np.mean(np.mean(stream, axis=0) * np.sign(mean) / rms)
    assert progress(arrived) / progress(sent) == pytest.approx(compressor.rms_step(), abs=0.05)


@pytest.mark.parametrize("name,factor", [("adam", 100 ** (1 / 3)), ("rmsprop", 100 ** (1 / 3)),
                                         ("sgd", 1.0), ("lion", 1.0)])
def test_learning_rate_scale_by_optimizer_name(name, factor):
    assert gs.CompressedAllReduce("topk").learning_rate_scale(name) == pytest.approx(factor)


def test_learning_rate_scale_of_wrappers():
    adam = tf.keras.optimizers.Adam()
    assert gs.CompressedAllReduce("topk", guard=True, warmup_steps=5).learning_rate_scale(
        adam) == pytest.approx(100 ** (1 / 3))
    assert C.get("adaptive", min_ratio=0.04).learning_rate_scale(adam) == pytest.approx(
        25 ** (1 / 3))
    assert C.get("adaptive", inner="randomk", min_ratio=0.04).learning_rate_scale(
        adam) == pytest.approx(5.0)


def test_adapt_optimizer_scales_the_rate_and_drops_the_first_moment():
    ops = gs.CompressedAllReduce("topk")
    adam = tf.keras.optimizers.Adam(1e-3, beta_2=0.99)
    adapted = ops.adapt_optimizer(adam)
    config = adapted.get_config()
    assert type(adapted) is type(adam) and adapted is not adam
    assert config["learning_rate"] == pytest.approx(1e-3 * 100 ** (1 / 3))
    assert config["beta_1"] == 0.0 and config["beta_2"] == pytest.approx(0.99)
    assert adam.get_config()["beta_1"] == pytest.approx(0.9)     # the original is kept
    with warnings.catch_warnings():     # already adapted: no advice at the first step
        warnings.simplefilter("error")
        ops.compressor.check_optimizer(adapted)
    assert ops.adapt_optimizer("adam").get_config()["beta_1"] == 0.0
    rms = ops.adapt_optimizer(tf.keras.optimizers.RMSprop(1e-3))   # no first moment
    assert rms.get_config()["learning_rate"] == pytest.approx(1e-3 * 100 ** (1 / 3))
    # Random-k at 50%: entries wait K = 2 steps, within half of Adam's window of 10
    # steps, so the first moment stays; a shorter window (beta_1 0.5) goes.
    randomk = gs.CompressedAllReduce("randomk")
    kept = randomk.adapt_optimizer(adam).get_config()
    assert kept["learning_rate"] == pytest.approx(1e-3 * 2 ** 0.5)
    assert kept["beta_1"] == pytest.approx(0.9)
    short = randomk.adapt_optimizer(tf.keras.optimizers.Adam(1e-3, beta_1=0.5))
    assert short.get_config()["beta_1"] == 0.0
    # SGD's heavy ball goes, at its long-run step: the rate / (1 - momentum).
    sgdm = tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    plain = ops.adapt_optimizer(sgdm).get_config()
    assert plain["learning_rate"] == pytest.approx(0.5)
    assert plain["momentum"] == 0.0 and plain["nesterov"] is False
    assert randomk.adapt_optimizer(sgdm) is sgdm                       # K = 2
    # Nothing to change: the optimizer itself.
    sgd = tf.keras.optimizers.SGD(0.2)
    assert ops.adapt_optimizer(sgd) is sgd
    assert gs.CompressedAllReduce("int8").adapt_optimizer(adam) is adam
    # A scaled sign sends every entry: a larger rate only, the first moment kept.
    sign = gs.CompressedAllReduce("sign").adapt_optimizer(adam).get_config()
    assert sign["learning_rate"] == pytest.approx(1.25e-3) and sign["beta_1"] == pytest.approx(0.9)
    assert gs.CompressedAllReduce("sign").adapt_optimizer(sgdm) is sgdm
    # Every entry sent every step (K = 1): no bursts, so even a short momentum window
    # (0.5: half of it is one step) stays, and nothing is advised.
    short_sgdm = tf.keras.optimizers.SGD(0.05, momentum=0.5)
    short_adam = tf.keras.optimizers.Adam(1e-3, beta_1=0.5)
    for name in ("none", "fp16", "int8", "powersgd"):
        dense = gs.CompressedAllReduce(name)
        assert dense.adapt_optimizer(short_sgdm) is short_sgdm, name
        assert dense.adapt_optimizer(short_adam) is short_adam, name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dense.compressor.check_optimizer(short_sgdm)
    # Keras' own schedules: every step's rate scaled, the schedule kept.
    factor = 100 ** (1 / 3)
    schedules = tf.keras.optimizers.schedules
    for schedule in (schedules.ExponentialDecay(1e-3, 100, 0.9),
                     schedules.CosineDecay(1e-4, 100, warmup_target=1e-3, warmup_steps=10),
                     schedules.PiecewiseConstantDecay([10], [1e-3, 1e-4]),
                     schedules.PolynomialDecay(1e-3, 100, end_learning_rate=1e-5)):
        adapted = ops.adapt_optimizer(tf.keras.optimizers.Adam(schedule))
        scaled = adapted._learning_rate                   # pylint: disable=protected-access
        assert type(scaled) is type(schedule)
        for step in (0, 5, 50, 150):
            assert float(scaled(step)) == pytest.approx(factor * float(schedule(step)))
        assert adapted.get_config()["beta_1"] == 0.0

    class Halving(tf.keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 1e-3 * 0.5 ** tf.cast(step, tf.float32)

        def get_config(self):
            return {}
    with pytest.raises(ValueError, match=r"4.64x its learning rate.*neither a number nor one "
                                         r"of Keras' schedules.*beta_1"):
        ops.adapt_optimizer(tf.keras.optimizers.Adam(Halving()))


def test_a_loss_scale_wrapper_is_seen_through():
    """Mixed precision wraps the user's optimizer in a `LossScaleOptimizer`: the checks
    read the inner one (DGC refuses its momentum, TernGrad clips as for Adam, the scale
    is Adam's), and `adapt_optimizer` adapts the inner one and wraps it again with the
    same loss-scale settings."""
    lso = tf.keras.mixed_precision.LossScaleOptimizer
    sgdm = lso(tf.keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=1024.0,
               dynamic_growth_steps=50)
    with pytest.raises(ValueError, match=r"optimizer SGD applies momentum=0.9 again"):
        C.get("dgc").check_optimizer(sgdm)
    tern = C.get("terngrad")
    tern.check_optimizer(lso(tf.keras.optimizers.Adam(1e-3)))
    assert tern.bound == tern.rms_clip
    topk = gs.CompressedAllReduce("topk")
    assert topk.learning_rate_scale(lso(tf.keras.optimizers.Adam())) == pytest.approx(
        topk.learning_rate_scale(tf.keras.optimizers.Adam()))
    for ops, lr in ((gs.CompressedAllReduce("dgc"), 0.05), (topk, 0.5)):
        adapted = ops.adapt_optimizer(sgdm)
        assert type(adapted) is lso and adapted is not sgdm
        assert (adapted.initial_scale, adapted.dynamic_growth_steps) == (1024.0, 50)
        inner = adapted.inner_optimizer.get_config()
        assert inner["momentum"] == 0.0 and inner["learning_rate"] == pytest.approx(lr)
        with warnings.catch_warnings():     # adapted: no advice, no refusal
            warnings.simplefilter("error")
            ops.compressor.check_optimizer(adapted)
            ops.compressor.check_optimizer(lso(adapted.inner_optimizer))
    assert gs.CompressedAllReduce("int8").adapt_optimizer(sgdm) is sgdm


def test_adapting_again_changes_nothing_and_another_compressors_adaptation_is_refused():
    """An optimizer adapted once is returned as it is (its rate scaled twice, AdamW's
    decay divided twice, was silent); adapted for another compressor, refused, since
    adaptations do not compose."""
    ops = gs.CompressedAllReduce("topk")
    adapted = ops.adapt_optimizer(tf.keras.optimizers.AdamW(1e-3, weight_decay=0.01))
    assert ops.adapt_optimizer(adapted) is adapted
    assert gs.CompressedAllReduce("topk").adapt_optimizer(adapted) is adapted   # same settings
    # A warm-up changes nothing in the optimizer beyond what top-k does.
    assert gs.CompressedAllReduce("topk", warmup_steps=5).adapt_optimizer(adapted) is adapted
    with pytest.raises(ValueError, match=r"AdamW was adapted for TopK\("
                                         r"ratio=0.01\) already \(4.64x its rate\).*Sign"):
        gs.CompressedAllReduce("sign").adapt_optimizer(adapted)
    scaled = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(1e-3))
    wrapped = ops.adapt_optimizer(scaled)
    assert ops.adapt_optimizer(wrapped) is wrapped
    assert wrapped.inner_optimizer.get_config()["learning_rate"] == pytest.approx(
        1e-3 * 100 ** (1 / 3))


def test_adapting_an_optimizer_that_has_taken_steps_says_they_are_lost():
    """The adapted copy starts at step 0 with empty slots: a schedule would restart."""
    sgd = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    v = tf.Variable([1.0, 2.0])
    sgd.apply_gradients([(tf.constant([0.1, 0.1]), v)])
    with pytest.warns(UserWarning, match="the 1 steps this one has taken do not carry over"):
        gs.CompressedAllReduce("topk").adapt_optimizer(sgd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gs.CompressedAllReduce("topk").adapt_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))


def test_a_rate_written_after_adapting_is_warned_of():
    """A checkpoint of an uncompressed run restored into an adapted optimizer writes its
    rate variable (the momentum stays off), as does a callback that sets rates: the
    optimizer then trains at neither setting."""
    ops = gs.CompressedAllReduce("topk")
    adapted = ops.adapt_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.base.check_adapted_rate(adapted)
    plain = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    v = tf.Variable([1.0])
    plain.build([v])
    adapted.build([v])
    adapted.learning_rate.assign(plain.learning_rate)   # what a restore writes
    with pytest.warns(C.OptimizerAdvice, match=r"SGD was adapted for TopK.* to learning rate "
                                               r"0.5 \(10x its own\) but trains at its own, "
                                               r"0.05 \(momentum=0.0 kept\): a checkpoint"):
        C.base.check_adapted_rate(adapted)
    # Another rate is taken as meant (a relative callback's, a decayed rate resumed).
    adapted.learning_rate.assign(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.base.check_adapted_rate(adapted)
    # A schedule is no variable a restore writes: nothing to check.
    schedule = ops.adapt_optimizer(tf.keras.optimizers.Adam(
        tf.keras.optimizers.schedules.ExponentialDecay(1e-3, 100, 0.9)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.base.check_adapted_rate(schedule)


def test_a_warm_up_under_an_adapted_rate_is_warned_of():
    """The warm-up's dense steps train at the rate raised for the payload's bursts; a
    piecewise schedule before adapting gives the uncompressed rate until it ends."""
    ops = gs.CompressedAllReduce("topk", warmup_steps=10)
    with pytest.warns(C.OptimizerAdvice, match=r"warmup_steps=10: the warm-up's dense gradients "
                                               r"train with Adam .* at 4.64x its rate.*"
                                               r"PiecewiseConstantDecay\(\[9\], \[rate / 4.642"):
        ops.compressor.check_optimizer(ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3)))
    # Steps 0..9 are dense, and step s reads the schedule at iteration s.
    factor = ops.learning_rate_scale("adam")
    stepped = ops.adapt_optimizer(tf.keras.optimizers.Adam(
        tf.keras.optimizers.schedules.PiecewiseConstantDecay([9], [1e-3 / factor, 1e-3])))
    assert float(stepped.learning_rate) == pytest.approx(1e-3)      # at iteration 0
    assert float(stepped._learning_rate(9)) == pytest.approx(1e-3)
    assert float(stepped._learning_rate(10)) == pytest.approx(1e-3 * factor)
    with warnings.catch_warnings():     # the advice followed: no warning
        warnings.simplefilter("error")
        ops.compressor.check_optimizer(stepped)
    # SGD's adaptation trains dense gradients at the momentum's long-run step: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.compressor.check_optimizer(ops.adapt_optimizer(
            tf.keras.optimizers.SGD(0.05, momentum=0.9)))


def test_adapt_optimizer_keeps_the_weight_decay_per_step():
    """Keras' decoupled weight decay steps with the rate (w -= w * wd * lr): scaled with
    the rate alone it decayed 4.6x (AdamW under top-k) or 9.5x (SGD with momentum)
    faster than uncompressed training."""
    for ops in (gs.CompressedAllReduce("topk"), gs.CompressedAllReduce("topk", guard=True)):
        for opt in (tf.keras.optimizers.AdamW(1e-3, weight_decay=0.1),
                    tf.keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=0.01)):
            before, after = opt.get_config(), ops.adapt_optimizer(opt).get_config()
            assert after["learning_rate"] >= before["learning_rate"]
            assert after["learning_rate"] * after["weight_decay"] == pytest.approx(
                before["learning_rate"] * before["weight_decay"])
    ops = gs.CompressedAllReduce("topk")
    with pytest.warns(C.OptimizerAdvice, match=r"4.64x the learning rate, beta_1=0.0, "
                                              r"weight_decay=0.0215 "):
        ops.compressor.check_optimizer(tf.keras.optimizers.AdamW(1e-3, weight_decay=0.1))
    assert ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3)).get_config()["weight_decay"] \
        is None
    # What `exclude_from_weight_decay` keeps out lives outside the config: it stays out.
    dense = tf.keras.layers.Dense(2)
    dense.build((None, 3))
    opt = tf.keras.optimizers.AdamW(1e-3, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    adapted = ops.adapt_optimizer(opt)
    assert adapted is not opt
    assert [adapted._use_weight_decay(v) for v in (dense.kernel, dense.bias)] == [True, False]


def test_adapt_optimizer_names_a_subclass_its_config_cannot_rebuild():
    """A subclass whose constructor takes an argument its `get_config()` leaves out
    cannot be rebuilt adapted: a ValueError says so and what to do, not from_config's
    bare TypeError."""
    class Tagged(tf.keras.optimizers.Adam):
        def __init__(self, tag, **kwargs):
            super().__init__(**kwargs)
            self.tag = tag
    with pytest.raises(ValueError, match=r"Tagged at .*x its learning rate.*cannot be "
                                         r"rebuilt from its get_config\(\) \(TypeError"):
        gs.CompressedAllReduce("topk").adapt_optimizer(Tagged("a", learning_rate=1e-3))


def test_adapt_optimizer_under_tf_keras():
    script = ("import tensorflow as tf, tf_gradsync as gs\n"
              "o = gs.CompressedAllReduce('topk').adapt_optimizer(tf.keras.optimizers.Adam(1e-3))\n"
              "c = o.get_config()\n"
              "print('RESULT', type(o).__module__, c['learning_rate'], c['beta_1'])\n"
              "s = tf.keras.optimizers.schedules.ExponentialDecay(1e-3, 100, 0.5)\n"
              "d = gs.CompressedAllReduce('topk').adapt_optimizer(tf.keras.optimizers.Adam(s))\n"
              "print('SCHEDULE', float(d._learning_rate(0)), d.get_config()['beta_1'])\n"
              "w = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(1e-3))\n"
              "a = gs.CompressedAllReduce('topk').adapt_optimizer(w)\n"
              "i = a.inner_optimizer.get_config()\n"
              "print('WRAPPED', type(a).__name__, i['learning_rate'], i['beta_1'])\n"
              "d = tf.keras.layers.Dense(2)\n"
              "d.build((None, 3))\n"
              "w = tf.keras.optimizers.AdamW(weight_decay=0.1)\n"
              "w.exclude_from_weight_decay(var_names=['bias'])\n"
              "a = gs.CompressedAllReduce('topk').adapt_optimizer(w)\n"
              "print('DECAYED', a is not w, *[a._use_weight_decay(v) for v in d.weights])\n")
    stdout = _tf_keras.run(script, timeout=300)
    module, lr, beta_1 = _tf_keras.lines(stdout)[-1]
    assert module.startswith("tf_keras")
    assert float(lr) == pytest.approx(1e-3 * 100 ** (1 / 3))
    assert float(beta_1) == 0.0
    lr, beta_1 = _tf_keras.lines(stdout, "SCHEDULE")[-1]
    assert float(lr) == pytest.approx(1e-3 * 100 ** (1 / 3)) and float(beta_1) == 0.0
    name, lr, beta_1 = _tf_keras.lines(stdout, "WRAPPED")[-1]
    assert name.startswith("LossScaleOptimizer")
    assert float(lr) == pytest.approx(1e-3 * 100 ** (1 / 3)) and float(beta_1) == 0.0
    assert _tf_keras.lines(stdout, "DECAYED")[-1] == ["True", "True", "False"]


def test_a_sparse_payload_warns_an_adaptive_optimizer():
    with pytest.warns(UserWarning, match=r"TopK\(ratio=0.01\) sends an entry about every 21.5 "
                                         r"steps: .*With Adam it trains best at 4.64x the "
                                         r"learning rate, beta_1=0.0 .*adapt_optimizer"):
        C.ErrorFeedback("topk").check_optimizer(tf.keras.optimizers.Adam())
    with pytest.warns(UserWarning, match=r"Sign\(block=16, scale='l2'\) moves an entry 0.8 "
                                         r"times as far .*With Adam it trains best at 1.25x "
                                         r"the learning rate \(.*adapt_optimizer"):
        C.ErrorFeedback("sign").check_optimizer(tf.keras.optimizers.Adam())
    with pytest.warns(UserWarning, match=r"With SGD it trains best at 10x the learning rate, "
                                         r"momentum=0.0"):
        C.ErrorFeedback("topk").check_optimizer(tf.keras.optimizers.SGD(momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.ErrorFeedback("topk").check_optimizer(tf.keras.optimizers.SGD())
        C.get("int8").check_optimizer(tf.keras.optimizers.Adam())
        C.get("randomk").check_optimizer(tf.keras.optimizers.SGD(momentum=0.9))   # K = 2


def test_advice_matches_what_adapt_optimizer_does():
    """Each compressor advises exactly the change its `adapt_optimizer` makes: dgc (its
    own momentum) none, the guard (which may send dense) the rate only, never the
    momentum its inner top-k would drop."""
    rms, sgdm, adam = (tf.keras.optimizers.RMSprop(1e-3), tf.keras.optimizers.SGD(0.05, momentum=0.9),
                       tf.keras.optimizers.Adam(1e-3))
    dgc, guard = C.get("dgc"), C.Guard(C.ErrorFeedback("topk"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dgc.check_optimizer(rms)
        guard.check_optimizer(sgdm)
    assert dgc.adapt_optimizer(rms) is rms and guard.adapt_optimizer(sgdm) is sgdm
    with pytest.warns(C.OptimizerAdvice) as caught:
        guard.check_optimizer(adam)
    assert len(caught) == 1 and "4.64x the learning rate (" in str(caught[0].message)
    adapted = guard.adapt_optimizer(adam).get_config()
    assert adapted["learning_rate"] == pytest.approx(1e-3 * 100 ** (1 / 3))
    assert adapted["beta_1"] == 0.9
    # Without its momentum dgc is a sparsifier and adapts like top-k.
    plain = C.get("dgc", momentum=0.0)
    assert plain.adapt_optimizer(sgdm).get_config()["momentum"] == 0.0
    with pytest.warns(C.OptimizerAdvice, match="momentum=0.0"):
        plain.check_optimizer(sgdm)
    # Guarding dgc keeps only what dgc cannot train without: SGD's momentum goes (dgc
    # applies its own), at the same rate.
    guarded = C.Guard(C.get("dgc"))
    with pytest.raises(ValueError, match="dgc applies momentum 0.9 itself"):
        guarded.check_optimizer(sgdm)
    config = guarded.adapt_optimizer(sgdm).get_config()
    assert config["momentum"] == 0.0 and config["learning_rate"] == pytest.approx(0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded.check_optimizer(guarded.adapt_optimizer(sgdm))


_ADAM_STEPS, _ADAM_N = 300, 2000


def _adam_run(learning_rate: float, compressor: C.Compressor | None) -> tuple[float, float]:
    """Feeds Adam `_ADAM_STEPS` steps of a gradient with mean 1 and noise 0.5 per entry,
    dense or through `compressor` (one replica, its state carried across steps, a new
    seed per step as the pipeline gives).

    Returns:
      How far the weights moved (mean over entries), and the mean number of steps
      between two sends of an entry.
    """
    rng = np.random.default_rng(0)
    grads = tf.constant(1 + 0.5 * rng.standard_normal((_ADAM_STEPS, _ADAM_N)), tf.float32)
    w = tf.Variable(tf.zeros(_ADAM_N))
    sends = tf.Variable(0.0)
    opt = tf.keras.optimizers.Adam(learning_rate)
    opt.build([w])
    state = None if compressor is None else make_state(compressor, C.Layout.flat(_ADAM_N))

    @tf.function
    def step(t):
        g = grads[t]
        if compressor is not None:
            t64 = tf.cast(t, tf.int64)
            g = roundtrip(compressor, g, state, step=t64, seed=tf.stack([t64, 7]))
        sends.assign_add(tf.math.count_nonzero(g, dtype=tf.float32))
        opt.apply_gradients([(g, w)])

    for t in range(_ADAM_STEPS):
        step(tf.constant(t))
    return float(-tf.reduce_mean(w)), _ADAM_STEPS * _ADAM_N / float(sends)


@pytest.mark.parametrize("name,kwargs", [
    ("topk", {"ratio": 0.1}), ("threshold", {"ratio": 0.04}), ("randomk", {"ratio": 0.25}),
    ("dgc", {"ratio": 0.1, "momentum": 0.0})])
def test_adam_moves_sqrt_k_slower_through_sparse_payloads(name, kwargs):
    """The law `learning_rate_scale` rests on, measured against dense Adam on the same
    gradients: through error feedback an entry sent every K steps moves about
    1/sqrt(K) as far, and sqrt(K) times the learning rate brings the distance back.
    (Here every entry has the same mean, so top-k too sends each every 1/ratio steps;
    random-k's `send_interval` is that measured interval.)"""
    c = gs.CompressedAllReduce(C.get(name, **kwargs)).compressor
    dense, _ = _adam_run(1e-3, None)
    moved, k = _adam_run(1e-3, c)
    assert k == pytest.approx(1 / kwargs["ratio"], rel=0.1)
    if name == "randomk":
        assert c.send_interval() == pytest.approx(k, rel=0.1)
    assert 0.7 < moved / dense * math.sqrt(k) < 1.3, (moved / dense, k)
    restored, _ = _adam_run(1e-3 * math.sqrt(k), c)
    assert 0.8 < restored / dense < 1.3, restored / dense


# ----------------------------------------------------------------- ErrorFeedback
@pytest.mark.parametrize("name", ["topk", "sign", "int8", "threshold", "onebit", "fp16"])
def test_error_feedback_residual(name):
    inner = C.get(name)
    ef = C.ErrorFeedback(inner)
    assert (ef.summable, ef.prescale, ef.unbiased) == (inner.summable, inner.prescale, False)
    state = make_state(ef, LAYOUT)
    x1, x2 = rand(N, seed=1, scales=SCALES), rand(N, seed=2, scales=SCALES)
    out = reduce(ef, [x1], [state], shapes=SHAPES)
    y1 = out.results[0]
    np.testing.assert_allclose(state["residual"].numpy(), (x1 - y1).numpy(), rtol=1e-5,
                               atol=1e-6)
    assert out.error == pytest.approx(np.linalg.norm((x1 - y1).numpy())
                                      / np.linalg.norm(x1.numpy()), rel=1e-4)
    y2 = roundtrip(ef, x2, state, shapes=SHAPES)
    e2 = x2 + (x1 - y1)
    np.testing.assert_allclose(y2.numpy(), roundtrip(inner, e2, shapes=SHAPES).numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state["residual"].numpy(), (e2 - y2).numpy(), rtol=1e-4,
                               atol=1e-4)


def test_error_feedback_nan_resets_and_state_namespacing():
    ef = C.ErrorFeedback("topk")
    state = make_state(ef, C.Layout.flat(100))
    roundtrip(ef, rand(100), state)
    x = rand(100).numpy()
    x[0] = math.inf
    out = reduce(ef, [tf.constant(x)], [state])
    assert not np.all(np.isfinite(out.payloads[0][0].numpy()))
    assert not state["residual"].numpy().any()

    class Stateful(C.Compressor):
        unbiased = False

        def state_spec(self, layout):
            return {"residual": C.StateSpec((1,), tf.float32)}

        def compress(self, x, c):
            c.state["residual"].assign_add([1.0])
            return (x,), None

        def decompress(self, payload, meta):
            return payload[0] * 0.5

    ef = C.ErrorFeedback(Stateful())
    state = make_state(ef, C.Layout.flat(4))
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
EXPECTED_BYTES = {  # one flat tensor of 1000 float32 (dense: 4000 bytes)
    "none": 4000, "fp16": 2000, "bf16": 2000, "int8": 1004, "qsgd": 1008, "terngrad": 254,
    "sign": 251, "onebit": 253, "topk": 80, "threshold": 80, "randomk": 2000, "dgc": 80,
    "adaptive": 800,    # starts critical: max_ratio = 10%
    "powersgd": 4000,   # a vector is sent as it is
}


@pytest.mark.parametrize("name", OURS)
def test_payload_bytes(name):
    c = C.get(name)
    out = reduce(c, [rand(1000)])
    got = sum(C.nbytes(p) for p in out.payloads)
    assert got == EXPECTED_BYTES[name]
    assert got == sum(t.numpy().nbytes for p in out.payloads for t in p)


def test_payload_bytes_per_tensor_statistics():
    """Per-tensor statistics cost one scale (or norm, or k) per tensor, not per bucket."""
    t = len(LAYOUT.tensors)                       # 5 non-empty tensors
    sizes = [s for s in LAYOUT.sizes if s]
    blocks = {b: sum(math.ceil(s / b) for s in sizes) for b in (16, 32)}
    want = {"int8": N + 4 * t, "sign": math.ceil(N / 8) + 2 * blocks[16],
            "onebit": math.ceil(N / 8) + 4 * blocks[32], "terngrad": math.ceil(N / 4) + 4 * t,
            "qsgd": N + 4 * sum(math.ceil(s / 512) for s in sizes),
            "topk": 8 * sum(max(1, math.ceil(0.01 * s)) for s in sizes),
            "randomk": 4 * sum(max(1, math.ceil(0.5 * s)) for s in sizes)}
    for name, nbytes in want.items():
        out = reduce(C.get(name), [rand(N)], shapes=SHAPES)
        assert sum(C.nbytes(p) for p in out.payloads) == nbytes, name


@pytest.mark.parametrize("name,kwargs,bad", [
    ("topk", {"ratio": 0}, "0"), ("topk", {"ratio": 1.5}, "1.5"), ("randomk", {"ratio": -1}, "-1"),
    ("threshold", {"ratio": 2}, "2"), ("threshold", {"sample_ratio": 0.0}, "0.0"),
    ("dgc", {"ratio": 0}, "0"), ("dgc", {"momentum": 1.0}, "1.0"), ("dgc", {"clip_norm": 0}, "0"),
    ("dgc", {"warmup_steps": -1}, "-1"),
    ("dgc", {"warmup_steps": 5, "warmup_ratio": 1e-4}, "0.0001"),
    ("qsgd", {"levels": 0}, "0"), ("qsgd", {"levels": 128}, "128"),
    ("qsgd", {"levels": 2.5}, "2.5"), ("qsgd", {"chunk": 0}, "0"),
    ("terngrad", {"clip": 0}, "0"), ("terngrad", {"clip": "2"}, "'2'"),
    ("terngrad", {"rms_clip": -1}, "-1"),
    ("powersgd", {"rank": 0}, "0"), ("powersgd", {"start_iter": -2}, "-2"),
    ("powersgd", {"min_compression_rate": 0.5}, "0.5"), ("powersgd", {"warm_start": 1}, "1"),
    ("powersgd", {"error_feedback": "no"}, "'no'"), ("sign", {"block": 0}, "0"),
    ("onebit", {"block": 2.5}, "2.5"),
    ("randomk", {"scale": 1}, "1"), ("randomk", {"cyclic": "yes"}, "'yes'"),
    ("adaptive", {"min_ratio": 0}, "0"), ("adaptive", {"min_ratio": 1.5}, "1.5"),
    ("adaptive", {"min_ratio": 0.2, "max_ratio": 0.1}, "0.1"), ("adaptive", {"max_ratio": 2}, "2"),
    ("adaptive", {"threshold": 0}, "0"), ("adaptive", {"interval": 0}, "0"),
    ("adaptive", {"interval": 2.5}, "2.5"),
])
def test_argument_validation(name, kwargs, bad):
    with pytest.raises(ValueError, match=f"{list(kwargs)[-1]} must .*{bad}"):
        C.get(name, **kwargs)


# ----------------------------------------------------------------- PowerSGD
def _low_rank_bucket(scale, rng):
    """A LAYOUT bucket whose matrices have rank 2 (kernel as [18, 4]); vectors random."""
    parts = []
    for shape, size in zip(LAYOUT.shapes, LAYOUT.sizes):
        if len(shape) >= 2 and size:
            rows, cols = size // shape[-1], shape[-1]
            parts.append((rng.standard_normal((rows, 2)) @ rng.standard_normal((2, cols))).ravel())
        else:
            parts.append(rng.standard_normal(size))
    return tf.constant(np.concatenate(parts) * scale, tf.float32)


def test_powersgd_matrices_per_tensor_and_exact_for_low_rank():
    c = C.get("powersgd", rank=2, start_iter=0, min_compression_rate=1)
    plan = c.plan(LAYOUT)
    # The kernel [3, 3, 2, 4] is a [18, 4] matrix and [50, 10] one; vectors, the scalar
    # and the empty tensor are sent as they are.
    assert [(m.rows, m.cols, m.rank) for m in plan.matrices] == [(18, 4, 2), (50, 10, 2)]
    assert [s for _, s in plan.dense] == [4, 10, 1]
    rng = np.random.default_rng(0)
    base = _low_rank_bucket(1.0, rng)
    xs = [base * (i + 1) for i in range(3)]
    states = [make_state(c, LAYOUT) for _ in xs]
    out = reduce(c, xs, states, shapes=SHAPES, mean=True)
    assert out.transports == ["sum", "sum"]
    p, dense = out.payloads[0]
    assert p.shape == (18 * 2 + 50 * 2,) and dense.shape == (15,)
    assert out.payloads[1][0].shape == (4 * 2 + 10 * 2,)
    mean = tf.add_n(xs).numpy() / 3
    for y in out.results:
        np.testing.assert_allclose(y.numpy(), mean, atol=1e-4)
    np.testing.assert_allclose(sum(c.residual(s, LAYOUT).numpy() for s in states), 0, atol=1e-4)
    np.testing.assert_allclose(states[0]["q"].numpy(), states[1]["q"].numpy())
    assert c.compression_stats(LAYOUT) == {
        "matrices": 2, "dense_tensors": 3, "p_elements": 136, "q_elements": 28,
        "dense_elements": 15, "uncompressed_elements": N}


#: (rank, jit_compile): compiled, the residual of a rank up to 4 is a sum of outer
#: products, of rank 6 (the [50, 10] matrix; the [18, 4] one stays at 4) a product.
POWERSGD_FORMS = [(1, False), (1, True), (6, True)]


@pytest.mark.parametrize("rank,jit_compile", POWERSGD_FORMS)
def test_powersgd_error_feedback_conserves_mass(rank, jit_compile):
    """What was sent plus what the residuals hold is what went in, over steps in which
    each residual is formed from its factors and folded into the next M."""
    c = C.get("powersgd", rank=rank, start_iter=0)
    states = [make_state(c, LAYOUT) for _ in range(2)]
    sent, total = 0, 0
    for step in range(3):
        xs = [rand(N, seed=10 * step + i, scales=SCALES) for i in range(2)]
        out = reduce(c, xs, states, step=step, shapes=SHAPES, mean=True,
                     jit_compile=jit_compile)
        np.testing.assert_allclose(out.results[0].numpy(), out.results[1].numpy())
        sent = sent + out.results[0].numpy()
        total = total + tf.add_n(xs).numpy() / 2
    # Not prescaled: each residual is in its replica's units, and the mean holds 1/2 of it.
    np.testing.assert_allclose(sent + sum(c.residual(s, LAYOUT).numpy() for s in states) / 2,
                               total,
                               rtol=1e-5, atol=1e-3)


def test_powersgd_without_error_feedback_keeps_no_residual():
    c = C.get("powersgd", rank=1, start_iter=0, error_feedback=False)
    assert sorted(c.state_spec(LAYOUT)) == ["q"]
    with_ef = C.get("powersgd", rank=1, start_iter=0)
    xs = [rand(N, seed=i, scales=SCALES) for i in range(2)]
    a = reduce(c, xs, shapes=SHAPES, mean=True)
    b = reduce(with_ef, xs, shapes=SHAPES, mean=True)
    # The first step is the same (the residual starts at zero); the error is measured.
    np.testing.assert_allclose(a.results[0].numpy(), b.results[0].numpy(), rtol=1e-5, atol=1e-6)
    assert a.error == pytest.approx(b.error, rel=1e-5) and a.error > 0


@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("rank,jit_compile", POWERSGD_FORMS)
def test_powersgd_error_terms_match_numpy(error_feedback, rank, jit_compile):
    """The error terms come from Q_i's norm, not a pass over the residual: they equal
    numpy's ||M - P_hat Q_i^T||^2 and ||M||^2 (M = x + e), summed over both replicas,
    each tensor at its own scale, over steps where the residual is not zero."""
    c = C.get("powersgd", rank=rank, start_iter=0, min_compression_rate=1,
              error_feedback=error_feedback)
    plan = c.plan(LAYOUT)
    states = [make_state(c, LAYOUT) for _ in range(2)]
    for step in range(3):
        xs = [rand(N, seed=10 * step + i, scales=SCALES) for i in range(2)]
        ms = [x.numpy().astype(np.float64)
              + (c.residual(s, LAYOUT).numpy() if error_feedback else 0)
              for x, s in zip(xs, states)]
        q_all = states[0]["q"].numpy().astype(np.float64)
        want_err = want_norm = 0.0
        for a in plan.matrices:
            mats = [m[a.offset:a.offset + a.size].reshape(a.rows, a.cols) for m in ms]
            q = q_all[a.q_offset:a.q_offset + a.cols * a.rank].reshape(a.cols, a.rank)
            p_hat = np.linalg.qr(sum(m @ q for m in mats))[0]
            want_err += sum(np.sum((m - p_hat @ (m.T @ p_hat).T) ** 2) for m in mats)
            want_norm += sum(np.sum(m ** 2) for m in mats)
        for o, size in plan.dense:
            want_norm += sum(np.sum(m[o:o + size] ** 2) for m in ms)
            want_err += sum(np.sum((m - x.numpy())[o:o + size] ** 2) for m, x in zip(ms, xs))
        out = reduce(c, xs, states, step=step, shapes=SHAPES, mean=True,
                     jit_compile=jit_compile)
        assert float(out.norm_sq) == pytest.approx(want_norm, rel=1e-5)
        assert float(out.error_sq) == pytest.approx(want_err, rel=1e-4)
        if error_feedback:   # and the residual kept is that error
            kept = sum(np.sum(c.residual(s, LAYOUT).numpy().astype(np.float64) ** 2)
                       for s in states)
            assert kept == pytest.approx(want_err, rel=1e-4)


@pytest.mark.parametrize("bad_at,bad", [(None, None), (80, math.nan), (80, -math.inf),
                                        (72, math.nan), (72, math.inf)],
                         ids=["finite", "nan-in-a-matrix", "inf-in-a-matrix",
                              "nan-sent-as-it-is", "inf-sent-as-it-is"])
@pytest.mark.parametrize("rank,jit_compile", POWERSGD_FORMS)
def test_powersgd_residual_without_the_error_measured(bad_at, bad, rank, jit_compile):
    """Without the error measured, the residual's reset reads finiteness from Q_i and
    the tensors sent as they are: every state kept equals the one kept with the error
    measured. After finite steps both replicas keep a residual. A non-finite entry of
    replica 1 in a matrix (80: the [50, 10] kernel) reaches both through the summed P,
    and both reset; in a tensor sent as it is (72: the [4] bias) only replica 1's own
    inputs are not finite, and only it resets."""
    c = C.get("powersgd", rank=rank, start_iter=0, min_compression_rate=1)
    assert any(a.offset <= 80 < a.offset + a.size for a in c.plan(LAYOUT).matrices)
    assert any(o <= 72 < o + s for o, s in c.plan(LAYOUT).dense)
    kept, results = {}, {}
    for measured in (True, False):
        states = [make_state(c, LAYOUT) for _ in range(2)]
        for step in range(3):
            xs = [rand(N, seed=10 * step + i, scales=SCALES).numpy() for i in range(2)]
            if bad_at is not None and step == 2:
                xs[1][bad_at] = bad
            out = reduce(c, [tf.constant(x) for x in xs], states, step=step, shapes=SHAPES,
                         mean=True, jit_compile=jit_compile, measure_error=measured)
        kept[measured] = [{k: v.numpy() for k, v in s.items()} for s in states]
        results[measured] = out.results[0].numpy()
    for with_error, without in zip(kept[True], kept[False]):
        assert sorted(with_error) == sorted(without)
        for name in with_error:
            np.testing.assert_array_equal(without[name], with_error[name], err_msg=name)
    # `states` are the last run's, without the error measured.
    residuals = [np.abs(c.residual(s, LAYOUT).numpy()).sum() for s in states]
    if bad is None:
        np.testing.assert_array_equal(results[False], results[True])
        assert all(r > 0 for r in residuals)
    else:
        assert not np.all(np.isfinite(results[False]))
        assert residuals[1] == 0 and (residuals[0] == 0) == (bad_at == 80)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_powersgd_dtypes_and_bytes(dtype):
    c = C.get("powersgd", start_iter=0)
    out = reduce(c, [rand(10000, dtype=dtype)], shapes=[(100, 100)])
    (p,), (q,) = out.payloads
    assert p.shape == q.shape == (400,) and p.dtype == q.dtype == (
        tf.float64 if dtype == tf.float64 else tf.float32)
    y = out.results[0]
    assert y.shape == (10000,) and y.dtype == dtype


def test_powersgd_dense_warm_up_then_low_rank():
    c = C.get("powersgd", rank=2, start_iter=5)
    assert c.num_modes == 2
    states = [make_state(c, LAYOUT) for _ in range(2)]
    for step in (0, 4):     # warm-up: one exact summed round, no residual
        xs = [rand(N, seed=step + i, scales=SCALES) for i in range(2)]
        out = reduce(c, xs, states, step=step, shapes=SHAPES)
        assert out.transports == ["sum"] and out.payloads[0][0].shape == (N,)
        np.testing.assert_allclose(out.results[0].numpy(), tf.add_n(xs).numpy(), rtol=1e-6)
        assert not c.residual(states[0], LAYOUT).numpy().any() and out.error == 0
    out = reduce(c, xs, states, step=5, shapes=SHAPES)
    assert out.transports == ["sum", "sum"] and out.error > 0
    assert c.residual(states[0], LAYOUT).numpy().any()
    x = rand(N).numpy()
    x[1] = math.nan
    out = reduce(c, [tf.constant(x)], states[:1], step=6, shapes=SHAPES)
    assert np.isnan(out.results[0].numpy()).any()
    assert not any(v.numpy().any() for k, v in states[0].items() if k != "q")
    assert np.all(np.isfinite(states[0]["q"].numpy()))


# ----------------------------------------------------------------- exact top-k
def _topk_sets(mag, k):
    """The fast path's indices, top_k's, and a stable numpy argsort's (lower index first)."""
    fast_idx, fast_values = _selection.top_k_entries(tf.constant(mag), k)
    fast = fast_idx.numpy()
    np.testing.assert_array_equal(fast_values.numpy(), mag[fast])
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
        sel = _selection
        rows = sel.sample_rows(n, sel.sample_size(1000), sel._TOPK_SEED).numpy()
        mag[(rows[:, None] * sel.SAMPLE_RUN + np.arange(sel.SAMPLE_RUN)).ravel()] = 10.0
    mag = mag.astype(np.float32)
    fast, plain, ref = _topk_sets(mag, k)
    assert fast == plain
    # top_k breaks ties towards lower indices, like a stable sort.
    assert fast == ref
    # Signed values select by magnitude.
    signed = np.where(rng.random(n) < 0.5, -mag, mag)
    idx, values = _selection.top_k_entries(tf.constant(signed), k)
    assert set(idx.numpy().tolist()) == ref
    np.testing.assert_array_equal(values.numpy(), signed[idx.numpy()])


@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "cauchy"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16, tf.float64])
def test_kth_largest_ranks_only_its_bin_and_equals_top_k(kind, dtype):
    rng = np.random.default_rng(5)
    n = 250_000
    mag = {"normal": lambda: np.abs(rng.standard_normal(n)),
           "ties": lambda: rng.integers(0, 10, n).astype(np.float64),
           "constant": lambda: np.full(n, 0.25),
           "cauchy": lambda: np.abs(rng.standard_cauchy(n))}[kind]()
    mag = tf.constant(mag, dtype)
    for k in (1, 17, 3_500, 26_000, n):
        want = tf.math.top_k(mag, k, sorted=True).values[k - 1]
        assert _selection._kth_largest(mag, k).numpy() == want.numpy(), k


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_compiled_selection_keeps_the_top_k_in_index_order(ratio):
    """Compiled (XLA's gathers, padded to a capacity) and not, the top k of a bucket
    come out in index order, the same entries as `tf.math.top_k`'s."""
    n = 300_000
    rng = np.random.default_rng(int(ratio * 1000))
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, 3000)] = 2.0            # ties at the cut for the larger k
    k = int(ratio * n)
    want = set(tf.math.top_k(tf.abs(tf.constant(x)), k).indices.numpy().tolist())
    for stage in (_util.inline, xla.call):
        idx, values = _selection.top_k_entries(tf.constant(x), k, stage=stage)
        idx = idx.numpy()
        assert set(idx.tolist()) == want and np.all(np.diff(idx) > 0)
        np.testing.assert_array_equal(values.numpy(), x[idx])
        idx, valid, values = _selection.select(tf.constant(x), k, tf.constant([1, 2], tf.int64),
                                               0.01, stage=stage)
        assert valid.numpy().all() and set(idx.numpy().tolist()) == want
        np.testing.assert_array_equal(values.numpy(), x[idx.numpy()])


def test_topk_per_tensor_on_long_and_many_short_tensors():
    """Long tensors take the sampled exact path, short ones are ranked by size class."""
    rng = np.random.default_rng(11)
    shapes = [(120_000,), *[(int(s),) for s in rng.integers(1, 3000, 40)], (70_000,)]
    layout = C.Layout(tuple(shapes))
    x = rng.standard_normal(layout.numel).astype(np.float32)
    x[rng.integers(0, layout.numel, 300)] = 0.5      # ties at the cut in places
    y = roundtrip(C.get("topk", ratio=0.01), tf.constant(x), shapes=shapes).numpy()
    want = np.zeros_like(x)
    for o, s in zip(layout.offsets, layout.sizes):
        keep = o + np.argsort(-np.abs(x[o:o + s]), kind="stable")[:max(1, math.ceil(0.01 * s))]
        want[keep] = x[keep]
    np.testing.assert_array_equal(y, want)


# ----------------------------------------------------------------- random-k under error feedback
def test_randomk_unscaled_default_and_error_feedback():
    assert not C.get("randomk").scale and not C.get("randomk").unbiased
    ops = gs.CompressedAllReduce("randomk")
    assert isinstance(ops.compressor, C.ErrorFeedback)            # the default trains
    assert not isinstance(gs.CompressedAllReduce(C.get("randomk", scale=True)).compressor,
                          C.ErrorFeedback)
    ef = C.ErrorFeedback(C.get("randomk", ratio=0.1, scale=True))
    assert ef.inner.scale is False and ef.summable
    state = make_state(ef, C.Layout.flat(100))
    residual = np.zeros(100, np.float32)
    for step in range(50):
        g = rand(100, seed=step).numpy()
        y = roundtrip(ef, tf.constant(g), state, seed=(step, 3)).numpy()
        e = g + residual
        kept = np.flatnonzero(y)
        np.testing.assert_allclose(y[kept], e[kept], rtol=1e-5, atol=1e-6)
        residual = e - y
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
    state = make_state(c, C.Layout.flat(n))
    base = rand(n, seed=13).numpy()
    scales = [1] * 12 + [3] * 9 + [3.2] * 9 + [0.5] * 12
    reduced = [s * base for s in scales]
    levels, sizes = [], []
    for step, g in enumerate(reduced):
        levels.append(int(c.mode(context(state, step=step))))
        out = reduce(c, [tf.constant(g, tf.float32)], [state], step=step)
        sizes.append(out.payloads[0][0].shape[0])
    want = _accordion(reduced, interval, 0.5)
    assert levels == want
    assert set(levels) == {0, 1}          # moved between the bounds, both ways
    assert sizes == [40 if lv else 4 for lv in levels]
    # a non-finite reduction is left out of the interval
    count = int(state["count"].numpy())
    c.observe(tf.constant(np.full(n, np.nan, np.float32)), context(state))
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
    # random-k keeps shared coordinates: summed, one mode per ratio.
    assert r.summable and r.num_modes == 2
    out = reduce(r, [rand(1000, seed=i) for i in range(2)])
    assert out.transports == ["sum"] and out.payloads[0][0].shape == (100,)
    ef = C.ErrorFeedback(C.get("adaptive", inner=C.get("randomk", scale=True)))
    assert all(not v.scale for v in ef.inner.variants)
    assert C.get("adaptive", min_ratio=0.05, max_ratio=0.05).num_modes == 1


# ----------------------------------------------------------------- dense warm-up
def test_warmup_sends_dense_then_the_inner_compressor():
    c = C.Warmup(C.ErrorFeedback("sign"), steps=3)
    assert (c.summable, c.unbiased, c.num_modes) == (False, False, 2)
    states = [make_state(c, LAYOUT) for _ in range(2)]
    for step in range(5):
        xs = [rand(N, seed=10 * step + i, scales=SCALES) for i in range(2)]
        out = reduce(c, xs, states, step=step, shapes=SHAPES)
        assert int(c.mode(context(step=step))) == (step >= 3)
        if step < 3:   # exact, and the residual is left alone
            assert out.transports == ["sum"] and out.error == 0
            np.testing.assert_allclose(out.results[0].numpy(), tf.add_n(xs).numpy(), rtol=1e-6)
            assert not states[0]["residual"].numpy().any()
        else:
            assert out.transports == ["gather"] and out.error > 0
            assert states[0]["residual"].numpy().any()
    # Modes compose: a compressor with modes of its own keeps them after the warm-up.
    d = C.Warmup(C.get("dgc", warmup_steps=10), steps=5)
    assert d.num_modes == 1 + d.inner.num_modes
    assert [int(d.mode(context(step=s))) for s in (0, 4, 5, 100)] == [
        0, 0, 1 + int(d.inner.mode(context(step=5))), d.num_modes - 1]
    with pytest.raises(ValueError, match="steps must be .*-1"):
        C.Warmup("sign", steps=-1)


def test_warmup_before_a_sparse_payload_warns_sgd_with_momentum():
    sgdm = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    with pytest.warns(UserWarning, match=r"warmup_steps=300 before .*RandomK.* every 2 steps, "
                                         r"under SGD with momentum=0.9"):
        C.Warmup(C.ErrorFeedback(C.get("randomk", ratio=0.5)), steps=300).check_optimizer(sgdm)
    # Top-k's advice (adapt_optimizer: momentum 0) covers the warm-up too: one warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        C.Warmup(C.ErrorFeedback("topk"), steps=300).check_optimizer(sgdm)
    assert [w.category for w in caught] == [C.OptimizerAdvice]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.Warmup(C.ErrorFeedback("topk"), steps=300).check_optimizer(tf.keras.optimizers.SGD(0.2))
        C.Warmup(C.ErrorFeedback("sign"), steps=300).check_optimizer(sgdm)   # every entry
        C.Warmup(C.get("powersgd"), steps=300).check_optimizer(sgdm)
    with warnings.catch_warnings(record=True) as caught:    # only the advice to adapt
        warnings.simplefilter("always")
        C.Warmup(C.ErrorFeedback("topk"), steps=0).check_optimizer(sgdm)
    assert caught and not any("warmup_steps" in str(w.message) for w in caught)


def test_ops_warmup_steps():
    ops = gs.CompressedAllReduce("topk", warmup_steps=50)
    assert isinstance(ops.compressor, C.Warmup) and ops.compressor.steps == 50
    assert isinstance(ops.compressor.inner, C.ErrorFeedback)
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative integer, got -3"):
        gs.CompressedAllReduce("topk", warmup_steps=-3)
    assert gs.SyncConfig(compression="sign", warmup_steps=7).build().compressor.steps == 7


def _layout_sizes(sizes):
    return types.SimpleNamespace(sizes=sizes)


@pytest.mark.parametrize("make", [
    lambda: _segments.Segments([3, 0, 5, 1]),                       # small, irregular
    lambda: _segments.Segments([70000, 1, 30000, 7]),               # long runs and short ones
    lambda: _segments.Segments(list(range(1, 600))),                # several id pieces
    lambda: _segments.Segments.chunks(_layout_sizes([40000, 3, 517, 20000]), 16),   # blocks
    lambda: _segments.Segments.chunks(_layout_sizes([4096, 4096]), 512),            # regular
    lambda: _segments.Segments.chunks(_layout_sizes([40007]), 32),      # one tensor's blocks
    lambda: _segments.Segments([1000]),                                             # one
], ids=["small", "long_runs", "id_pieces", "blocks", "regular", "short_last", "one"])
def test_segment_statistics_match_numpy(make):
    """Per-segment sums, extremes, means, sums of squares and expansion against numpy,
    for each way a bucket is cut into pieces (reshaped runs, segment reductions over id
    pieces)."""
    seg = make()
    sizes = np.asarray(seg.sizes)
    assert sizes.sum() == seg.numel and len(sizes) == seg.count
    v = np.random.default_rng(0).normal(size=seg.numel).astype(np.float32)
    pieces = np.split(v, np.cumsum(sizes)[:-1])
    np.testing.assert_allclose(seg.sum(tf.constant(v)).numpy(), [p.sum() for p in pieces],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(seg.max(tf.constant(v)).numpy(), [p.max() for p in pieces])
    np.testing.assert_array_equal(seg.min(tf.constant(v)).numpy(), [p.min() for p in pieces])
    np.testing.assert_array_equal(seg.abs_max(tf.constant(v)).numpy(),
                                  [np.abs(p).max() for p in pieces])
    np.testing.assert_allclose(seg.mean(tf.constant(v)).numpy(), [p.mean() for p in pieces],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(seg.sum_of_squares(tf.constant(v)).numpy(),
                               [np.sum(p.astype(np.float64) ** 2) for p in pieces], rtol=1e-5)
    # Several statistics at once, in TensorFlow's ops and compiled (one variadic
    # reduction per reshaped run), float32 and float64.
    for dtype in (np.float32, np.float64):
        w = tf.constant(v.astype(dtype))
        for run in (lambda f, *a: f(*a), xla.call):
            high, low, total, squares, positive = run(lambda x: seg.statistics(
                ("max", x), ("min", x), ("sum", x), ("sum_of_squares", x),
                ("sum_of_squares", tf.nn.relu(x))), w)
            assert high.dtype == w.dtype and high.shape == [seg.count]
            np.testing.assert_array_equal(high, [p.max() for p in pieces])
            np.testing.assert_array_equal(low, [p.min() for p in pieces])
            np.testing.assert_allclose(total, [p.sum() for p in pieces], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(squares, [np.sum(p.astype(np.float64) ** 2)
                                                 for p in pieces], rtol=1e-5)
            np.testing.assert_allclose(positive, [np.sum(np.maximum(p, 0).astype(np.float64)
                                                         ** 2) for p in pieces], rtol=1e-5)
    per = tf.range(seg.count, dtype=tf.float32) + 0.5
    np.testing.assert_array_equal(seg.apply(tf.multiply, tf.constant(v), per).numpy(),
                                  v * (np.repeat(np.arange(seg.count), sizes) + 0.5).astype(np.float32))
    want = np.repeat(np.arange(seg.count), sizes) + 0.5
    # One segment's value stays [1] and broadcasts.
    np.testing.assert_array_equal(seg.expand(per).numpy(), want if seg.count > 1 else [0.5])
    # Leading and trailing axes, in TensorFlow's ops and compiled by XLA (which expands
    # the values of several pieces instead of applying `fn` piece by piece).
    two = tf.stack([per, -per], -1)                       # [count, 2]: onebit's sides
    lead = tf.constant(np.stack([v, 2 * v]))              # [2, numel]: two replicas
    want2 = np.stack([v * want, 2 * v * want]).astype(np.float32)
    pick = lambda b, s: tf.where(b, s[..., 0], s[..., 1])
    bits = tf.constant(v > 0)
    for run in (lambda f, *a: f(*a), xla.call):
        np.testing.assert_array_equal(run(lambda x, p: seg.apply(tf.multiply, x, p),
                                          tf.constant(v), per),
                                      (v * want).astype(np.float32) if seg.count > 1
                                      else v * np.float32(0.5))
        np.testing.assert_allclose(
            run(lambda x, p: seg.apply(tf.multiply, x, p), lead, tf.stack([per, per])),
            want2, rtol=1e-6)
        np.testing.assert_array_equal(run(lambda b, s: seg.apply(pick, b, s), bits, two),
                                      np.where(v > 0, want, -want).astype(np.float32)
                                      if seg.count > 1 else np.where(v > 0, 0.5, -0.5))
        # Both axes: stacked payloads' sides, as a gather's decoding sums them.
        np.testing.assert_array_equal(
            run(lambda b, s: seg.apply(pick, b, s), tf.stack([bits, ~bits]),
                tf.stack([two, 2 * two])),
            np.stack([np.where(v > 0, want, -want), np.where(v > 0, -2 * want, 2 * want)])
            .astype(np.float32) if seg.count > 1 else
            np.stack([np.where(v > 0, 0.5, -0.5), np.where(v > 0, -1.0, 1.0)]))
    # Compiled within `xla.summing_payloads`: summed over the leading axis, as a gather's
    # decoding takes it.
    def summed(fn, x, p):
        with xla.summing_payloads():
            return seg.apply(fn, x, p)
    np.testing.assert_allclose(xla.call(lambda x, p: summed(tf.multiply, x, p), lead,
                                        tf.stack([per, per])), want2.sum(0), rtol=1e-6)
    sides = np.where(v > 0, want, -want) - 2 * np.where(v > 0, want, -want)
    np.testing.assert_allclose(
        xla.call(lambda b, s: summed(pick, b, s), tf.stack([bits, bits]),
                 tf.stack([two, -2 * two])),
        sides if seg.count > 1 else np.where(v > 0, -0.5, 0.5), rtol=1e-6)
    expanded = seg.expand(two, axis=0).numpy()
    np.testing.assert_array_equal(expanded, np.stack([want, -want], -1) if seg.count > 1
                                  else [[0.5, -0.5]])


def test_uniform_draws_are_uniform_independent_and_the_same_compiled():
    """`_draws.uniform`: on [0, 1) in steps of 2^-24, the moments and histogram of a
    uniform, no correlation between entries near each other (neighbours, a QSGD chunk
    apart) or between seeds (replicas, steps), and the same values from TensorFlow's ops
    and compiled by XLA."""
    n = 1 << 20
    seeds = [tf.constant(s, tf.int64) for s in ((1, 2), (1, 3), (2, 2))]
    u = [_draws.uniform(n, s).numpy() for s in seeds]
    for d in u:
        assert d.dtype == np.float32 and d.min() >= 0 and d.max() < 1
        np.testing.assert_array_equal(d * 2 ** 24, np.floor(d * 2 ** 24))
        assert abs(d.mean() - 0.5) < 4 * np.sqrt(1 / 12 / n)
        assert abs(d.var() - 1 / 12) < 1e-3
        counts = np.histogram(d, bins=64, range=(0, 1))[0]
        chi2 = np.sum((counts - n / 64) ** 2 / (n / 64))
        assert chi2 < 63 + 5 * np.sqrt(2 * 63), chi2          # 63 degrees of freedom
        for lag in (1, 2, 3, 512):
            assert abs(np.corrcoef(d[:-lag], d[lag:])[0, 1]) < 5 / np.sqrt(n), lag
        # Pairs of neighbours fill the unit square evenly (16 x 16 cells).
        pairs = np.histogram2d(d[:-1:2], d[1::2], bins=16, range=((0, 1), (0, 1)))[0]
        expected = n / 2 / 256
        chi2 = np.sum((pairs - expected) ** 2 / expected)
        assert chi2 < 255 + 5 * np.sqrt(2 * 255), chi2
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert abs(np.corrcoef(u[a], u[b])[0, 1]) < 5 / np.sqrt(n)
    compiled = xla.call(lambda s: _draws.uniform(n, s), seeds[0])
    np.testing.assert_array_equal(compiled.numpy(), u[0])
    np.testing.assert_array_equal(_draws.uniform(17, seeds[0], tf.float64).numpy(),
                                  u[0][:17].astype(np.float64))


# ------------------------------------------------------ writing a compressor
@pytest.fixture
def registry():
    """Names registered by a test are dropped after it."""
    from tf_gradsync.compression import base
    before = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(before)


def _scaled_sign(decode_dtype=None, bare=False):
    """A user's compressor: signs and one mean magnitude, gathered (the defaults)."""
    class ScaledSign(C.Compressor):
        def compress(self, x, ctx):
            signs = tf.cast(tf.sign(x), tf.int8)
            scale = tf.reduce_mean(tf.abs(x))
            return (signs if bare else (signs, scale)), None

        def decompress(self, payload, meta):
            y = tf.cast(payload[0], tf.float32) * payload[1]
            return tf.cast(y, decode_dtype) if decode_dtype else y
    return ScaledSign


def test_a_users_compressor_is_gathered_with_error_feedback_by_default(registry):
    """Unless it declares otherwise, a compressor's payloads are gathered (right for any
    codec; a scaled sign summed on the wire decodes to nonsense) and, biased by
    default, it gets error feedback."""
    C.register("scaled_sign")(_scaled_sign())
    ops = gs.CompressedAllReduce("scaled_sign")
    assert not ops.compressor.summable and isinstance(ops.compressor, C.ErrorFeedback)
    xs = [rand(N, seed=r) for r in range(3)]
    out = reduce(C.get("scaled_sign"), xs)
    want = sum(np.sign(x.numpy()) * np.abs(x.numpy()).mean() for x in xs)
    np.testing.assert_allclose(out.results[0].numpy(), want, rtol=1e-6)


def test_register_names_what_is_wrong(registry):
    cls = _scaled_sign()
    with pytest.raises(TypeError, match=r"@register\('mine'\)"):
        C.register(cls)
    with pytest.raises(TypeError, match="Compressor subclass"):
        C.register("mine")(object)

    class NoDecode(C.Compressor):
        def compress(self, x, ctx):
            return (x,), None
    with pytest.raises(TypeError, match="'half' .*NoDecode.* does not implement decompress"):
        C.register("half")(NoDecode)
    with pytest.raises(ValueError, match="'topk' is already registered, to .*TopK"):
        C.register("topk")(cls)
    C.register("mine")(cls)
    with pytest.raises(ValueError, match="already registered as 'mine'"):
        C.register("mine_too")(cls)
    # The same class defined again (a notebook cell run twice) replaces the first.
    again = _scaled_sign()
    assert C.register("mine")(again) is again and isinstance(C.get("mine"), again)


def test_a_bare_tensor_payload_or_a_decode_of_another_dtype_is_named(registry):
    with pytest.raises(TypeError, match="ScaledSign.compress must return .*got .*Tensor"):
        reduce(_scaled_sign(bare=True)(), [rand(N)])
    with pytest.raises(ValueError, match="decoded a bucket of float32 .* into float64"):
        reduce(_scaled_sign(decode_dtype=tf.float64)(), [rand(N), rand(N, seed=1)])
    # Under error feedback (a user's compressor's default) too, where the residual is
    # written from the decoding before any result is.
    with pytest.raises(ValueError, match=r"decoded a bucket of float32 \(.*\) into float64"):
        reduce(C.ErrorFeedback(_scaled_sign(decode_dtype=tf.float64)()), [rand(N)])


def test_state_and_modes_declared_wrongly_are_named(registry):
    """A user's `state_spec` that returns no dict of StateSpecs, and modes that `mode()`
    does not pick among, are named where they are met, not as TensorFlow's errors far
    from the compressor (a list had no `items`; mode 5 of 2 ran the last silently)."""
    class Listed(_scaled_sign()):
        def state_spec(self, layout):
            return [C.StateSpec((layout.numel,), tf.float32)]

    with pytest.raises(TypeError, match=r"Listed.state_spec must return a dict of names to "
                                        r"StateSpec.*got \[StateSpec"):
        reduce(Listed(), [rand(N)])

    def moded(picked):
        class Moded(_scaled_sign()):
            num_modes = 2

            def mode(self, ctx):
                return picked
        return Moded()

    for picked in (None, 5):
        with pytest.raises(ValueError, match=rf"num_modes=2 and its mode\(\) returned {picked}"):
            reduce(moded(picked), [rand(N)])
    out = reduce(moded(1), [rand(N), rand(N, seed=1)])     # a Python int is taken
    assert out.results[0].shape == [N]

    class Bare(C.Compressor):
        def rounds(self, x, ctx):
            yield (x,)
            return x

    with pytest.raises(ValueError, match=r"Bare\(\): a round must yield a Message\(payload, "
                                         r"transport\), got a tuple of \[TensorShape\(\[587\]\)"):
        reduce(Bare(), [rand(N)])


def _odd_dtypes():
    """A user's compressors whose payloads TensorFlow's collectives do not carry as they
    are: 16-bit fixed point, summed; signs as bools and a scale, gathered."""
    class Fixed16(C.Compressor):
        summable = unbiased = True

        def compress(self, x, ctx):
            return (tf.cast(tf.round(x * 256), tf.int16),), x.dtype

        def decompress(self, payload, meta):
            return tf.cast(payload[0], meta) / 256

    class BoolSign(C.Compressor):
        def compress(self, x, ctx):
            return (x > 0, tf.reduce_mean(tf.abs(x))), x.dtype

        def decompress(self, payload, meta):
            return tf.where(payload[0], payload[1], -payload[1])
    return Fixed16(), BoolSign()


@pytest.mark.parametrize("which", [0, 1])
def test_payloads_of_any_dtype_travel_through_tensorflows_collectives(devices, which):
    """TensorFlow's all-reduce sums no 8- or 16-bit integers (they travel as int32,
    counted so) and its gather takes no bools (packed in words as bytes): the collective
    algorithm, which multi-worker jobs use, reduces them as the ring does."""
    compressor = _odd_dtypes()[which]
    rng = np.random.default_rng(0)
    values = [rng.normal(size=[300]).astype(np.float32) for _ in devices]
    got = {}
    for algorithm in ("ring", "collective"):
        ops = gs.CompressedAllReduce(compressor, algorithm=algorithm, error_feedback=False)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

        def fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce("sum", tf.gather(np.stack(values), ctx.replica_id_in_sync_group))
        out = tf.function(lambda: strategy.run(fn))()     # pylint: disable=cell-var-from-loop
        got[algorithm] = (out.values[0].numpy(), ops.stats()["last_bytes_sent"])
    np.testing.assert_allclose(got["collective"][0], got["ring"][0], rtol=1e-6)
    if which == 0:
        want = sum(np.round(v * 256) for v in values) / 256
        np.testing.assert_allclose(got["ring"][0], want, rtol=1e-6)
        assert got["collective"][1] == 2 * got["ring"][1]


@pytest.mark.parametrize("returned", ["bare payload", "no meta"])
def test_a_bad_payload_is_named_before_auto_sizes_it(registry, devices, returned):
    """exchange="auto" sizes a bucket's payload to choose between gathering and two
    phases; a bad payload met there was iterated as a symbolic tensor instead."""
    class Bad(C.Compressor):
        def compress(self, x, ctx):
            return (x, None) if returned == "bare payload" else x

        def decompress(self, payload, meta):
            return payload[0]
    C.register("bad_payload")(Bad)
    ops = gs.CompressedAllReduce("bad_payload")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([64]) * tf.cast(ctx.replica_id_in_sync_group, tf.float32))
    with pytest.raises(TypeError, match="Bad.compress must return .payload, meta., the payload "
                                        "a tuple of tensors; got .*Tensor"):
        ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(value, value)])


def test_a_codec_that_reads_state_is_told_to_override_codec(registry):
    """Payloads are sized from `codec()` without state (the planner, `auto`'s choice
    between gathering and two phases): a compressor whose compress reads its state is
    told what to do, not handed a bare KeyError."""
    class Remembering(_scaled_sign()):
        def state_spec(self, layout):
            return {"memory": C.StateSpec((layout.numel,), tf.float32)}

        def compress(self, x, ctx):
            return super().compress(x + ctx.state["memory"], ctx)

    C.register("remembering")(Remembering)
    with pytest.raises(KeyError, match="read its state 'memory' .* from codec"):
        gs.CompressedAllReduce("remembering").bucket_exchange(LAYOUT, 4)


def test_a_compressor_of_its_own_rounds_keeps_its_own_residual_and_is_gathered(registry):
    """One that overrides `rounds` alone cannot be wrapped in error feedback or cut into
    two phases: by default it gets neither, and its bucket is gathered whole."""
    class Halves(C.Compressor):
        def rounds(self, x, ctx):
            received = yield C.Message((tf.cast(x, tf.float16),), C.GATHER)
            return tf.add_n([tf.cast(p[0], x.dtype) for p in received])

    C.register("halves")(Halves)
    ops = gs.CompressedAllReduce("halves")
    assert type(ops.compressor) is Halves and not Halves.splittable
    assert ops.bucket_exchange(LAYOUT, 8) == "gather"
    xs = [rand(N, seed=r) for r in range(3)]
    out = reduce(C.get("halves"), xs)
    want = sum(x.numpy().astype(np.float16).astype(np.float32) for x in xs)
    np.testing.assert_allclose(out.results[0].numpy(), want, rtol=1e-6)
