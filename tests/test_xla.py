"""Decodings compiled by XLA: the same reduction as TensorFlow's ops, identical on every
replica, and really compiled where a compressor declares it."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import compression as C
from tf_gradsync.compression import _bits, _segments, _sparse, driver, two_phase, xla
from _compress import make_state, reduce
from tf_gradsync.bench import ops_from_spec

SHAPES = ((3, 3, 2, 4), (4,), (0, 5), (50, 10), (10,), ())
LAYOUT = C.Layout(SHAPES)
#: Every compressor as `CompressedAllReduce` builds it by default (error feedback
#: where it applies) whose decodings compile.
COMPILED = [n for n in C.names() if gs.CompressedAllReduce(n).compressor.xla_decode]


def test_the_compressors_that_compile_are_the_expected_ones():
    assert set(COMPILED) == {"adaptive", "dgc", "int8", "onebit", "qsgd", "randomk", "sign",
                             "terngrad", "threshold", "topk"}
    assert {n for n in C.names() if C.get(n).xla_compress} == {"int8", "onebit", "sign"}


def _states(c, n, two):
    return [make_state(c, LAYOUT, two_phase.split(LAYOUT, n, r) if two else None)
            for r in range(n)]


#: Summed payloads (random-k) take one exchange, not two phases.
CASES = [(name, exchange) for name in COMPILED + ["randomk:ratio=0.3", "randomk:cyclic=true",
                                                  "randomk:scale=true:ratio=0.25"]
         for exchange in ("gather", "two_phase")
         if exchange == "gather" or not name.startswith("randomk")]


@pytest.mark.parametrize("name,exchange", CASES)
def test_compiled_decodings_reduce_as_tensorflows_ops(name, exchange):
    """Three steps of four replicas, compiled and not, from the same inputs and states:
    the same sums (to float32 rounding), identical on every replica, the same bytes,
    compression errors and residuals (random-k: strata of equal lengths, a power of
    two, of other lengths, cyclic)."""
    c = ops_from_spec(name).compressor
    n, two = 4, exchange == "two_phase"
    plain, compiled = _states(c, n, two), _states(c, n, two)
    rng = np.random.default_rng(3)
    for step in range(3):
        xs = [tf.constant(x, tf.float32) for x in rng.standard_normal((n, LAYOUT.numel))
              * np.repeat([1, 1e-3, 1, 1e3, 1e-2, 5], LAYOUT.sizes)]
        want = reduce(c, xs, plain, shapes=SHAPES, step=step, two_phases=two)
        got = reduce(c, xs, compiled, shapes=SHAPES, step=step, two_phases=two,
                     jit_compile=True)
        for r in range(1, n):
            np.testing.assert_array_equal(got.results[r].numpy(), got.results[0].numpy())
        scale = np.abs(want.results[0].numpy()).max()
        np.testing.assert_allclose(got.results[0].numpy(), want.results[0].numpy(),
                                   rtol=1e-5, atol=1e-6 * scale)
        assert got.sent == want.sent
        np.testing.assert_allclose(float(got.error_sq), float(want.error_sq), rtol=1e-4)
        for a, b in zip(plain, compiled):
            for key in a:
                np.testing.assert_allclose(b[key].numpy(), a[key].numpy(), rtol=1e-5,
                                           atol=1e-6 * max(scale, 1.0), err_msg=key)


def _compiled_functions(graph) -> int:
    """How many functions the traced graph calls compiled by XLA."""
    return sum(1 for f in graph._functions.values()   # pylint: disable=protected-access
               if f.cached_definition.attr["_XlaMustCompile"].b)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_decodings_are_compiled_only_when_asked(jit_compile):
    """The traced step of a gathered sign bucket calls XLA-compiled functions for each
    replica's compress, the error feedback's new residual and the sum of the gathered
    payloads, and none with `jit_compile=False`."""
    c = gs.CompressedAllReduce("sign").compressor
    states = _states(c, 2, False)
    xs = [tf.random.stateless_normal([LAYOUT.numel], (r, 1)) for r in range(2)]

    @tf.function
    def step(xs):
        ctxs = [C.Context(state=s, num_replicas=2, replica=r, layout=LAYOUT,
                          jit_compile=jit_compile) for r, s in enumerate(states)]
        return driver.run(c, xs, ctxs, driver.local_exchange).results

    graph = step.get_concrete_function(xs).graph
    assert _compiled_functions(graph) == (6 if jit_compile else 0)


@pytest.mark.parametrize("shape", [(128, 128), (127, 128)], ids=["large", "small"])
def test_pipeline_compiles_by_default_and_not_when_told(devices, shape):
    """Buckets of `MIN_COMPILED_NUMEL` entries and more compile by default; smaller
    ones, where compiling costs seconds and saves nothing, run TensorFlow's ops."""
    assert xla.MIN_COMPILED_NUMEL == 128 * 128
    large = shape[0] * shape[1] >= xla.MIN_COMPILED_NUMEL
    for jit_compile, compiled in ((True, large), (False, False)):
        ops = gs.CompressedAllReduce("int8", jit_compile=jit_compile)
        strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill(shape, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)))

        @tf.function
        def step():
            return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                                     [(value, value)])[0]

        out = strategy.experimental_local_results(step())
        for o in out:
            np.testing.assert_allclose(o.numpy(), 3.0, rtol=0.02)
        assert (_compiled_functions(step.get_concrete_function().graph) > 0) == compiled


def test_sparse_sums_take_one_scatter_when_compiled():
    """Two sparse payloads: placed and added by TensorFlow, one scatter under XLA; the
    same sum either way."""
    n = 1000
    parts = [(tf.constant([1.0, 2.0, 3.0]), tf.constant([5, 7, 999])),
             (tf.constant([10.0, 20.0]), tf.constant([7, 0]))]
    want = np.zeros(n, np.float32)
    want[[5, 7, 999, 0]] = [1.0, 12.0, 3.0, 20.0]
    np.testing.assert_array_equal(_sparse.sum_sparse(parts, n, tf.float32).numpy(), want)
    seen = []

    def body(p):
        seen.append(xla.tracing())
        return _sparse.sum_sparse(p, n, tf.float32)
    np.testing.assert_array_equal(xla.call(body, parts).numpy(), want)
    assert seen == [True] and not xla.tracing()


def test_jit_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="jit_compile must be True or False, got 'yes'"):
        gs.CompressedAllReduce("sign", jit_compile="yes")


@pytest.mark.parametrize("bits,values", [(1, None), (1, (-1.0, 1.0)), (2, (0.0, 1.0, -1.0, 0.0)),
                                         (4, None)])
def test_unpacking_compiled_gives_the_tables_codes(bits, values):
    """Under XLA codes are shifted out of their bytes instead of looked up in a table:
    the same codes (or values), leading axes kept, the tail cut to n."""
    rng = np.random.default_rng(4)
    n = 8 * 37 // bits - 3
    codes = rng.integers(0, 1 << bits, (3, n))
    packed = tf.stack([_bits.pack(tf.constant(c), bits) for c in codes])
    dtype = tf.int32 if values is None else tf.float32
    want = _bits.unpack(packed, bits, n, values, dtype).numpy()
    got = tf.function(lambda p: xla.call(lambda q: _bits.unpack(q, bits, n, values, dtype), p)
                      )(packed).numpy()
    np.testing.assert_array_equal(want, codes if values is None else np.asarray(values)[codes])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["topk", "threshold", "dgc"])
def test_long_tensors_select_the_same_entries_compiled(name):
    """Tensors long enough for the sampled selection (its comparison with the threshold
    compiled when asked): the same payload, entry for entry, and the same sum."""
    shapes = ((300, 250), (64,), (40_000,))
    c = gs.CompressedAllReduce(name).compressor
    layout = C.Layout(shapes)
    rng = np.random.default_rng(5)
    xs = [tf.constant(rng.standard_normal(layout.numel), tf.float32) for _ in range(2)]
    got = [reduce(c, xs, [make_state(c, layout) for _ in xs], shapes=shapes,
                  jit_compile=jit) for jit in (False, True)]
    for a, b in zip(got[0].payloads[0], got[1].payloads[0]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(got[0].results[0].numpy(), got[1].results[0].numpy())


def _compiled_ops(fn, *args) -> set:
    """The op types of the XLA-compiled functions `fn(*args)` traces."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return {node.op for f in graph._functions.values()   # pylint: disable=protected-access
            if f.cached_definition.attr["_XlaMustCompile"].b
            for node in f.cached_definition.node_def}


@pytest.mark.parametrize("runs,padded", [
    ([(512, 40), (100, 1)], True),       # a tensor in chunks, the last shorter: whole rows
    ([(4000, 1), (30, 1)], False),       # a kernel and its bias: padding would double it
])
def test_per_segment_values_are_padded_only_to_a_little_more(runs, padded):
    """Compiled, `Segments.apply` pads a tensor cut into chunks to whole rows, and never a
    bucket by more than an eighth (a kernel and its bias stay unpadded)."""
    seg = _segments.Segments(runs=runs)
    v = tf.zeros([seg.numel])
    per = tf.ones([seg.count])
    ops = _compiled_ops(lambda v, p: xla.call(lambda v, p: seg.apply(tf.multiply, v, p), v, p),
                        v, per)
    assert ("Pad" in ops or "PadV2" in ops) == padded, ops
