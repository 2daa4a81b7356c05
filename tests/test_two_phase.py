"""Two-phase exchange (scatter-reduce with server-side error feedback, then all-gather):
chunking, the pairing schedule, a numpy model, conservation of every compressor's
gradient mass, bytes, and the pipeline on four devices against the driver."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import algorithms, costmodel
from tf_gradsync import compression as C
from tf_gradsync.algorithms.pairwise import tournament
from tf_gradsync.compression import _selection, two_phase
from _compress import make_state, reduce
from test_compressors import _topk_model
from test_cross_device_ops import _crossing_edges

SHAPES = ((3, 3, 2, 4), (4,), (0, 5), (50, 10), (10,), ())
LAYOUT = C.Layout(SHAPES)
#: Compressors whose payloads are gathered: the ones two phases are for.
GATHERED = [n for n in C.names() if not gs.CompressedAllReduce(n).compressor.summable]


def test_gathered_compressors_are_the_expected_ones():
    assert set(GATHERED) == {"adaptive", "dgc", "int8", "onebit", "qsgd", "sign", "terngrad",
                             "threshold", "topk"}


def test_split_cuts_tensors_into_pieces_and_keeps_whole_ones():
    chunks = two_phase.split(C.Layout(((2, 3), (4,))), 2, member=1)
    assert chunks.offsets == (0, 5) and chunks.member == 1
    assert [c.shapes for c in chunks.layouts] == [((5,),), ((1,), (4,))]
    for parts in range(1, 9):
        chunks = two_phase.split(LAYOUT, parts)
        sizes = [c.numel for c in chunks.layouts]
        assert sum(sizes) == LAYOUT.numel and max(sizes) - min(sizes) <= 1
        assert list(chunks.offsets) == list(np.cumsum([0] + sizes[:-1]))
        # Piece by piece, the chunks hold exactly the bucket's tensors, in order.
        pieces = [s for c in chunks.layouts for s in c.sizes]
        edges = sorted(set(np.cumsum(pieces)) | set(np.cumsum(LAYOUT.sizes)))
        assert set(np.cumsum(LAYOUT.sizes)) <= set(np.cumsum(pieces)) and edges[-1] == 587
        for c in chunks.layouts:
            for shape in c.shapes:
                assert shape in SHAPES or len(shape) == 1
    with pytest.raises(ValueError, match="5 elements cannot be cut into 8 chunks"):
        two_phase.split(C.Layout.flat(5), 8)


@pytest.mark.parametrize("members", range(2, 10))
def test_tournament_pairs_every_two_members_once(members):
    rounds = tournament(members)
    assert len(rounds) == members - 1 + members % 2
    met = [p for r in rounds for p in r]
    assert sorted(met) == [(a, b) for a in range(members) for b in range(a + 1, members)]
    for r in rounds:
        seen = [m for p in r for m in p]
        assert len(seen) == len(set(seen))


def test_topk_two_phases_match_a_numpy_model():
    n, ratio, steps = 3, 0.1, 3
    c = C.ErrorFeedback(C.get("topk", ratio=ratio))
    chunks = [two_phase.split(LAYOUT, n, r) for r in range(n)]
    states = [make_state(c, LAYOUT, ch) for ch in chunks]
    worker = np.zeros((n, LAYOUT.numel))       # each replica's residual, chunk by chunk
    server = np.zeros(LAYOUT.numel)            # each owner's residual, at its chunk
    rng = np.random.default_rng(0)
    for step in range(steps):
        xs = rng.standard_normal((n, LAYOUT.numel)).astype(np.float32)
        got = reduce(c, [tf.constant(x) for x in xs], states, shapes=SHAPES, step=step,
                     two_phases=True)
        want = np.zeros(LAYOUT.numel)
        for j in range(n):
            lo, hi = chunks[0].bounds(j)
            lay = chunks[0].layouts[j]
            sent = []
            for r in range(n):
                e = xs[r, lo:hi] + worker[r, lo:hi]
                sent.append(_topk_model(e, ratio, lay))
                worker[r, lo:hi] = e - sent[-1]
            total = np.sum(sent, 0) + server[lo:hi]
            want[lo:hi] = _topk_model(total, ratio, lay)
            server[lo:hi] = total - want[lo:hi]
        for r in range(n):
            np.testing.assert_allclose(got.results[r].numpy(), want, rtol=1e-5, atol=1e-6)
        assert got.transports == [C.SCATTER, C.GATHER]


def _residual_mass(states, n):
    """The sum of every residual, placed in the bucket: the workers' (one per chunk)
    and the owners' (each at the chunk it owns); DGC's accumulated velocity is one."""
    total = np.zeros(LAYOUT.numel)
    for r, state in enumerate(states):
        chunks = two_phase.split(LAYOUT, n, r)
        for key, v in state.items():
            j, name = (r, key) if key == two_phase.SERVER else (int(key[1:key.index("_")]),
                                                                key[key.index("_") + 1:])
            if name in ("residual", "v", two_phase.SERVER):
                lo, hi = chunks.bounds(j)
                total[lo:hi] += v.numpy()
    return total


@pytest.mark.parametrize("name", GATHERED)
def test_every_gathered_compressor_conserves_mass_and_agrees(name):
    """Inputs plus old residuals equal the result plus new residuals (worker-side and
    owner-side error feedback lose nothing), and every replica gets the same result.
    Unbiased compressors run under error feedback here: without it, what a worker's
    rounding loses is noise that is not kept anywhere."""
    n = 4
    if name == "dgc":       # DGC keeps its own memory, v; without momentum it is a residual
        c = C.get(name, momentum=0.0)
    else:
        c = gs.CompressedAllReduce(name, error_feedback=True).compressor
    states = [make_state(c, LAYOUT, two_phase.split(LAYOUT, n, r)) for r in range(n)]
    keys = states[0].keys()
    assert two_phase.SERVER in keys and all(k.startswith("c") for k in keys
                                            if k != two_phase.SERVER)
    rng = np.random.default_rng(1)
    mass = np.zeros(LAYOUT.numel)
    for step in range(3):
        xs = rng.standard_normal((n, LAYOUT.numel)) * np.repeat([1, 1e-3, 1, 1e3, 1e-2, 5],
                                                                LAYOUT.sizes)
        got = reduce(c, [tf.constant(x, tf.float32) for x in xs], states, shapes=SHAPES,
                     step=step, two_phases=True)
        for r in range(1, n):
            np.testing.assert_array_equal(got.results[r].numpy(), got.results[0].numpy())
        mass = mass + xs.sum(0)
        left = _residual_mass(states, n)
        np.testing.assert_allclose(got.results[0].numpy().astype(np.float64) + left, mass,
                                   rtol=1e-4, atol=1e-4 * np.abs(mass).max())
        mass = left


@pytest.mark.parametrize("name", GATHERED)
def test_bfloat16_buckets_with_sampled_selections(name):
    """A bfloat16 bucket whose chunks are long enough for the sampled selections
    (`_selection.LARGE`): the owner re-encodes its summed chunk in bfloat16, and every
    compressor then sends what the same bucket in float32 sends, to bfloat16's
    rounding (a bin position rounded in bfloat16 can pass the last bin)."""
    shapes = ((3 * _selection.LARGE,), (40,))
    n = 2
    c = gs.CompressedAllReduce(name).compressor
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(sum(s[0] for s in shapes)) for _ in range(n)]
    errors = {}
    for dtype in (tf.bfloat16, tf.float32):
        got = reduce(c, [tf.constant(x, dtype) for x in xs], shapes=shapes, two_phases=True)
        y = got.results[0].numpy().astype(np.float64)
        for r in range(1, n):
            np.testing.assert_array_equal(got.results[r].numpy(), got.results[0].numpy())
        assert got.results[0].dtype == dtype and np.isfinite(y).all()
        ref = sum(np.asarray(tf.cast(tf.constant(x, dtype), tf.float64)) for x in xs)
        errors[dtype.name] = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert errors["bfloat16"] <= errors["float32"] + 0.02, errors


@pytest.mark.parametrize("name", GATHERED)
def test_non_finite_entry_reaches_every_replica(name):
    """A NaN on one member, in a chunk long enough for the sampled selections: every
    replica's result is not finite (as a plain all-reduce's, so that a loss scaler
    skips the step), no state keeps it, and the next step is finite again (a NaN's
    magnitude cuts no candidates, so a selection alone can drop it)."""
    shapes = ((3 * _selection.LARGE,), (40,))
    layout = C.Layout(shapes)
    members = 2
    c = gs.CompressedAllReduce(name).compressor
    states = [make_state(c, layout, two_phase.split(layout, members, r)) for r in range(members)]
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((members, layout.numel))
    xs[1, layout.numel // 2] = np.nan
    got = reduce(c, [tf.constant(x, tf.float32) for x in xs], states, shapes=shapes,
                 two_phases=True)
    for y in got.results:
        assert not np.isfinite(y.numpy()).all()
    for state in states:
        for key, value in state.items():
            assert np.isfinite(value.numpy()).all(), key
    xs = rng.standard_normal((members, layout.numel))
    got = reduce(c, [tf.constant(x, tf.float32) for x in xs], states, shapes=shapes,
                 two_phases=True, step=1)
    assert np.isfinite(got.results[0].numpy()).all()


@pytest.mark.parametrize("shapes", [((64, 10),), SHAPES], ids=["alike", "mixed"])
@pytest.mark.parametrize("name", GATHERED)
def test_gathered_chunks_decode_as_each_chunk_alone_bit_for_bit(name, shapes, monkeypatch):
    """The owners' chunks decode into the bucket (`decode_chunks`: the sparse ones
    placed at once) exactly as decoding each chunk alone and concatenating them, with
    chunks alike (a bucket that divides evenly) and not."""
    layout, n = C.Layout(shapes), 4
    assert (len(set(two_phase.split(layout, n).layouts)) == 1) == (shapes != SHAPES)
    c = gs.CompressedAllReduce(name).compressor
    xs = [tf.constant(np.random.default_rng(r).standard_normal(layout.numel), tf.float32)
          for r in range(n)]

    def result():
        states = [make_state(c, layout, two_phase.split(layout, n, r)) for r in range(n)]
        got = reduce(c, xs, states, shapes=shapes, two_phases=True)
        return [r.numpy() for r in got.results]

    fast = result()
    # The base class's decoding: each chunk alone, then concatenated.
    monkeypatch.setattr(type(c.server_codec()), "decode_chunks", C.Compressor.decode_chunks)
    for got, want in zip(fast, result()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["int8", "sign", "topk", "qsgd", "terngrad", "onebit"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_are_n_minus_one_over_n_of_a_payload_per_phase(name, n):
    """Each replica sends (N-1)/N of its chunks' payloads and (N-1)/N of the owners'
    re-compressed chunks; the chunks weigh the bucket's payload within 5% (statistics of
    tensors a chunk boundary cuts in two); where the owner re-compresses with the
    compressor's own codec, that is 2(N-1)/N of the payload."""
    shapes = ((64, 3, 3, 32), (128,), (256, 300))
    layout = C.Layout(shapes)
    c = gs.CompressedAllReduce(name).compressor
    xs = [tf.random.stateless_normal([layout.numel], (r, 0)) for r in range(n)]
    gathered = reduce(c, xs, shapes=shapes)
    payload = C.nbytes(gathered.payloads[0])
    assert gathered.sent == n * (n - 1) * payload
    whole, chunks, server = two_phase.payload_bytes(c, layout, n)
    assert whole == payload and payload <= chunks <= 1.05 * payload
    two = reduce(c, xs, shapes=shapes, two_phases=True)
    per_replica = two.sent / n
    assert per_replica == pytest.approx((n - 1) / n * (chunks + server), rel=0.01)
    # The owners re-send in their server codec (int8 for sign, onebit and TernGrad).
    assert server == two_phase.payload_bytes(c.server_codec(), layout, n)[1]
    if c.server_codec().name == c.codec().name:
        assert server == chunks
        assert per_replica <= 1.05 * 2 * (n - 1) / n * payload
    else:
        assert name in ("sign", "onebit", "terngrad") and c.server_codec().name == "int8"


@pytest.mark.parametrize("name,first", [("int8", 3), ("qsgd", 3), ("sign", 6), ("topk", 6)])
def test_auto_prices_wire_and_codec_of_both_exchanges(name, first):
    """`auto` gathers at 2 members, and up to the first count where two phases cost less
    than a gather, wire and codec priced: from 3 for int8 (a quarter of the bucket
    gathered N-1 times), from 6 for top-k and sign, whose small payloads gather cheaply
    while two phases re-compress at the owners; as TensorFlow's ops (gathered decodes at
    half a round trip each), top-k goes in two phases from 3. The pipeline's buckets
    follow it."""
    layout = C.Layout(((2500, 1000),))
    ops = gs.CompressedAllReduce(name)
    picks = {n: costmodel.choose_exchange(ops.compressor, layout, n) for n in range(2, 10)}
    assert picks == {n: "two_phase" if n >= first else "gather" for n in range(2, 10)}
    assert all(ops.bucket_exchange(layout, n, across_workers=True) == picks[n] for n in picks)
    if name == "topk":
        assert costmodel.choose_exchange(ops.compressor, layout, 3, jit_compile=False) \
            == "two_phase"
    assert gs.CompressedAllReduce(name, exchange="gather").bucket_exchange(
        layout, 8, across_workers=True) == "gather"
    assert gs.CompressedAllReduce("fp16").bucket_exchange(layout, 8) == "all-reduce"
    # A guard watches whole buckets: gathered, whatever two phases would cost.
    guarded = gs.CompressedAllReduce(name, guard=True)
    assert costmodel.choose_exchange(guarded.compressor, layout, 8) == "gather"
    assert guarded.bucket_exchange(layout, 8, across_workers=True) == "gather"


@pytest.mark.parametrize("name", [n for n in C.names()
                                  if not C.get(n).summable and C.get(n).splittable])
def test_auto_gathers_among_the_cpu_devices_of_one_process(name):
    """Within one process the members are CPU devices, linked by copies in memory: the
    wire is cheap and two phases' second compression is not, so every bucket gathers up
    to 8 devices (adaptive at 4 went in two phases, with a graph per chunk)."""
    ops = gs.CompressedAllReduce(name)
    layout = C.Layout(((1000, 1000), (1000,)))
    assert [ops.bucket_exchange(layout, n) for n in range(2, 9)] == ["gather"] * 7


def test_two_phases_put_two_nths_of_a_gather_on_the_wire():
    for n in (3, 8, 64):
        link = algorithms.cost.Link(latency_s=0)
        ratio = (algorithms.cost.exchange_seconds("gather", n, 1e9, link)
                 / algorithms.cost.exchange_seconds("two_phase", n, 1e9, link))
        assert ratio == pytest.approx(n / 2)


@pytest.mark.parametrize("name", ["sign", "topk", "int8"])
def test_pipeline_on_four_devices_matches_the_driver(devices, name):
    """Device copies and the in-process exchange give the driver's result; the bytes
    `stats()` counts are the driver's; only payload crosses devices."""
    ops = gs.CompressedAllReduce(name, exchange="two_phase", bucket_bytes=1 << 20)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    shapes = [(24, 16), (16,), (5, 5, 3)]
    rng = np.random.default_rng(2)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in devices]

    def value(ctx, k):
        r = ctx.replica_id_in_sync_group
        with tf.device(devices[r]):
            return tf.identity(grads[r][k])

    values = [strategy.experimental_distribute_values_from_function(lambda ctx, k=k: value(ctx, k))
              for k in range(len(shapes))]
    assert [v.device for v in values[0].values] == [strategy.extended.worker_devices[r]
                                                    for r in range(len(devices))]

    @tf.function
    def step():
        return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                                 [(v, v) for v in values])

    outs = [[t.numpy() for t in strategy.experimental_local_results(o)] for o in step()]
    for per_replica in outs:
        for other in per_replica[1:]:
            np.testing.assert_array_equal(other, per_replica[0])
    # The driver with the same compressor, on the same bucket (the plan puts the last
    # tensor first, as backprop produces it); int8's stochastic rounding draws from
    # each device's own seed, so it is compared in distribution.
    (bucket,) = gs.plan_buckets([(s, tf.float32) for s in shapes], 1 << 20).buckets
    assert bucket.layout.shapes == tuple(reversed(shapes))
    got = np.concatenate([o[0].ravel() for o in reversed(outs)])
    xs = [tf.constant(np.concatenate([g.ravel() for g in reversed(gr)])) for gr in grads]
    want = reduce(ops.compressor, xs, shapes=bucket.layout.shapes, two_phases=True)
    exact = np.sum([x.numpy() for x in xs], 0)
    if name == "int8":
        assert np.linalg.norm(got - exact) < 0.05 * np.linalg.norm(exact)
    else:
        np.testing.assert_allclose(got, want.results[0].numpy(), rtol=1e-5, atol=1e-5)
    assert ops.stats()["last_bytes_sent"] == want.sent // len(devices)    # per replica

    edges = _crossing_edges(step.get_concrete_function().graph)
    assert edges
    assert all(t.dtype != tf.float32 or t.shape.num_elements() <= 64 for t, _, _ in edges), \
        [(t.name, t.dtype.name, t.shape) for t, _, _ in edges if t.dtype == tf.float32]


@pytest.mark.slow
@pytest.mark.parametrize("workers,chief", [(3, False), (2, True)], ids=["3-workers", "chief"])
def test_workers_match_devices_of_one_process(tmp_path, devices, workers, chief):
    """Pairwise collectives across worker processes compute what copies between the
    devices of one process compute, and the workers agree step by step; in a job with
    a chief task, the chief and worker 0 take distinct places (chunk owners, seeds)."""
    import _regression
    import _worker
    steps = 8
    runs = _worker.launch(tmp_path, "--compression=sign", "--exchange=two_phase",
                          f"--steps={steps}", workers=workers, chief=chief)
    for run in runs[1:]:
        assert run["fingerprints"] == runs[0]["fingerprints"]

    ops = gs.CompressedAllReduce("sign", exchange="two_phase")
    strategy = tf.distribute.MirroredStrategy(devices[:workers], cross_device_ops=ops)
    model, opt = _regression.model_and_optimizer(strategy, 16, 4)
    step = _regression.train_step(strategy, model, opt)

    def batch(s, k):
        def fn(ctx):
            r = ctx.replica_id_in_sync_group
            rng = np.random.default_rng([r, s])
            x, y = rng.normal(size=(8, 16)), rng.normal(size=(8, 4))
            with tf.device(strategy.extended.worker_devices[r]):
                return tf.identity(tf.constant((x, y)[k], tf.float32))
        return strategy.experimental_distribute_values_from_function(fn)

    for s in range(steps):
        step(batch(s, 0), batch(s, 1))
    for got, want in zip(runs[0]["weights"], model.get_weights()):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
    # The same payloads; across workers they travel packed into words, padded to the
    # longer of two chunks' payloads.
    sent, ref = runs[0]["stats"]["last_bytes_sent"], ops.stats()["last_bytes_sent"]
    assert ref <= sent <= 1.05 * ref


@pytest.mark.parametrize("levels", [1, 4, 64])
def test_an_unbiased_compressor_reduces_without_owners_residual(devices, levels):
    """QSGD is unbiased and runs without error feedback: its owners re-compress without
    a residual too. With one, at 1 or 4 levels (whose error exceeds the input) the
    owners' residuals fed on themselves: the reduced gradient's error grew without
    bound (4 levels: 3.8 -> 246 times the sum in 12 steps); without, it stays where
    one step puts it."""
    ops = gs.CompressedAllReduce(C.get("qsgd", levels=levels), exchange="two_phase")
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

    @tf.function
    def step(s):
        def fn():
            ctx = tf.distribute.get_replica_context()
            x = tf.random.stateless_normal([4096], tf.stack([s, ctx.replica_id_in_sync_group]))
            return x, ctx.all_reduce("sum", [x])[0]
        return strategy.run(fn)

    errors = []
    for s in range(10):
        x, y = step(tf.constant(s))
        want = sum(v.numpy() for v in strategy.experimental_local_results(x))
        got = strategy.experimental_local_results(y)[0].numpy()
        errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert max(errors[5:]) < 1.5 * max(errors[:5]), errors
    keys = ops._state.values()                # pylint: disable=protected-access
    assert keys and not any(two_phase.SERVER in k for k in keys)


@pytest.mark.parametrize("name", ["terngrad", "sign", "onebit", "int8"])
def test_owners_residual_stays_bounded(name):
    """The owners' error feedback keeps what their re-compression lost; with a codec
    that can carry the sum (int8 for the one- and two-bit payloads), that residual and
    the result stay bounded over steps instead of accumulating noise (TernGrad re-sent
    as TernGrad grew both about as the square root of the steps)."""
    layout = C.Layout(((300, 200), (200,)))
    n, steps = 4, 12
    c = gs.CompressedAllReduce(name).compressor
    states = [make_state(c, layout, two_phase.split(layout, n, r)) for r in range(n)]
    ratios = []
    for step in range(steps):
        xs = [tf.random.stateless_normal([layout.numel], (step, r)) for r in range(n)]
        out = reduce(c, xs, states, shapes=layout.shapes, two_phases=True, step=step)
        want = np.linalg.norm(sum(x.numpy() for x in xs))
        residual = np.linalg.norm(states[0][two_phase.SERVER].numpy())
        ratios.append((residual / want, np.linalg.norm(out.results[0].numpy()) / want))
    (r_first, out_first), (r_last, out_last) = ratios[1], ratios[-1]
    assert r_last < 0.1 and r_last < 1.5 * r_first + 0.01, ratios
    assert out_last < 1.5 * out_first + 0.01, ratios
