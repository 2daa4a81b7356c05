"""The cost model against what the library really sends, and against its formulas."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import costmodel
from tf_gradsync.algorithms.cost import (Link, all_to_all_rounds, bytes_sent, exchange_seconds,
                                         parse_bandwidth)
from tf_gradsync.algorithms.pairwise import tournament
from tf_gradsync.compression import Layout

#: A small model's weights: a conv kernel, a dense kernel and biases.
SPECS = [((3, 3, 8, 16), tf.float32), ((16,), tf.float32), ((400, 64), tf.float32),
         ((64,), tf.float32)]


@pytest.mark.parametrize("text,bits", [("100mbit", 1e8), ("1gbit", 1e9), ("25Gbit", 25e9),
                                       ("2.5gbit", 2.5e9), ("10mbps", 8e7), (4e9, 4e9)])
def test_bandwidths_parse_as_tc_writes_them(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits / 8)


@pytest.mark.parametrize("text", ["fast", "1 gigabit", "-1gbit", "0mbit", "", True])
def test_bad_bandwidths_say_what_is_allowed(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_link_rejects_bad_values():
    with pytest.raises(ValueError, match="latency_s"):
        Link(latency_s=-1)
    with pytest.raises(ValueError, match="bytes_per_s"):
        Link(bytes_per_s=0)
    with pytest.raises(ValueError, match="round_s must be >= 0 seconds or None, got -0.1"):
        Link(round_s=-0.1)


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_exchange_prices_follow_alpha_beta(n):
    a, b, p = 1e-4, 1e9, 4e6
    link = Link(a, b)
    assert exchange_seconds("ring", n, p, link) == pytest.approx(2 * (n - 1) * (a + p / n / b))
    assert exchange_seconds("tree", n, p, link) == pytest.approx(
        2 * math.ceil(math.log2(n)) * a + 2 * (n - 1) / n * p / b)
    assert exchange_seconds("gather", n, p, link) == pytest.approx((n - 1) * (a + p / b))
    # The all-to-all's rounds: the tournament's, each one latency unless measured.
    rounds = len(tournament(n))
    assert all_to_all_rounds(n) == rounds
    assert exchange_seconds("two_phase", n, p, link, server_bytes=2 * p) == pytest.approx(
        (rounds + n - 1) * a + (n - 1) / n * 3 * p / b)
    slow_rounds = Link(a, b, round_s=5 * a)
    assert exchange_seconds("two_phase", n, p, slow_rounds, server_bytes=2 * p) == pytest.approx(
        (5 * rounds + n - 1) * a + (n - 1) / n * 3 * p / b)
    fast = Link(1e-6, 1e11)
    assert exchange_seconds("hierarchical", n, p, link, local=4, local_link=fast) == pytest.approx(
        exchange_seconds("ring", 4, p, fast) + exchange_seconds("ring", n, p, link))
    assert bytes_sent("gather", n, p) == (n - 1) * p
    assert bytes_sent("ring", n, p) == pytest.approx(2 * (n - 1) / n * p)
    assert exchange_seconds("gather", 1, p, link) == 0


@pytest.mark.parametrize("n,local", [(2, 2), (4, 8)])
def test_workers_of_several_devices_are_priced_as_their_exchanges_run(n, local):
    a, b, p = 1e-4, 1e9, 4e6
    link, fast, m = Link(a, b), Link(1e-6, 1e11), n * local
    # Gathers run as one ring of all M devices, a worker's next to each other: the hop
    # out of a worker carries every other member's payload.
    assert exchange_seconds("gather", n, p, link, local=local) == pytest.approx(
        (m - 1) * (a + p / b))
    assert bytes_sent("gather", n, p, local=local) == (m - 1) * p
    # Two phases among the M devices: the worker's link carries what its devices send
    # to the other workers' devices, then the ring gather of the re-compressed chunks.
    moved = local * (n - 1) / n * p + (m - 1) / m * 2 * p
    assert exchange_seconds("two_phase", n, p, link, server_bytes=2 * p, local=local) == (
        pytest.approx((all_to_all_rounds(m) + m - 1) * a + moved / b))
    # One worker's devices exchange as members on the link between them; nothing
    # leaves the worker.
    for kind in ("ring", "tree", "gather", "two_phase"):
        assert exchange_seconds(kind, 1, p, link, local=local, local_link=fast) == (
            pytest.approx(exchange_seconds(kind, local, p, fast)))
        assert bytes_sent(kind, 1, p, local=local) == 0
    # Hierarchical sums share one ring's bytes among the worker's devices.
    assert bytes_sent("hierarchical", n, p, local=local) == pytest.approx(2 * (n - 1) / n * p)
    inner, outer = exchange_seconds("ring", local, p, fast), exchange_seconds("ring", n, p, link)
    assert exchange_seconds("hierarchical", n, p, link, local=local, local_link=fast) == (
        pytest.approx(inner + outer))
    for flat in ("ring", "tree"):
        with pytest.raises(ValueError, match=f"not '{flat}'; valid with local={local}: "
                                             "hierarchical, gather, two_phase"):
            exchange_seconds(flat, n, p, link, local=local)
    with pytest.raises(ValueError, match="local must be an integer >= 1"):
        exchange_seconds("gather", n, p, link, local=0)


def test_predict_prices_workers_of_several_devices():
    """Summed payloads travel in the hierarchical exchange; each device decodes the
    gathered payloads of all N L members, as N L workers of one device would."""
    link, fast = Link(1e-4, 1e9), Link(1e-6, 1e11)
    assert costmodel.exchanges_for("fp16", 4) == ("hierarchical",)
    assert costmodel.exchanges_for("fp16") == ("ring", "tree")
    assert costmodel.exchanges_for("topk", 4) == ("gather", "two_phase")
    fp16 = costmodel.model_payloads("fp16", SPECS, 4096, 8)
    p = costmodel.predict("fp16", fp16, "hierarchical", 2, link, 0.1, 1e9, local=4,
                          local_link=fast)
    assert p.wire_s == pytest.approx(sum(
        exchange_seconds("hierarchical", 2, b.rounds[0][1], link, local=4, local_link=fast)
        for b in fp16))
    assert p.bytes_per_worker == pytest.approx(sum(b.rounds[0][1] for b in fp16))  # 2(N-1)/N
    with pytest.raises(ValueError, match="fp16 cannot travel in 'ring'; valid: hierarchical"):
        costmodel.predict("fp16", fp16, "ring", 2, link, 0.1, local=4)
    topk = costmodel.model_payloads("topk", SPECS, 4096, 8)
    for exchange in ("gather", "two_phase"):
        several = costmodel.predict("topk", topk, exchange, 2, link, 0.1, 1e9, local=4)
        single = costmodel.predict("topk", topk, exchange, 8, link, 0.1, 1e9)
        assert several.codec_s == pytest.approx(single.codec_s)
    gather = costmodel.predict("topk", topk, "gather", 2, link, 0.1, 1e9, local=4)
    assert gather.bytes_per_worker == pytest.approx(7 * sum(b.rounds[0][1] for b in topk))


def test_unknown_exchange_names_the_valid_ones():
    with pytest.raises(ValueError, match="ring, tree, gather, two_phase, hierarchical"):
        exchange_seconds("butterfly", 4, 1e6)


@pytest.mark.parametrize("name", gs.compression.names())
def test_round_bytes_are_those_of_the_payload_sent(name):
    """The model's bytes per bucket equal the payload tensors the compressor sends in
    its steady state, through the protocol driver (as `CompressedAllReduce` builds it)."""
    compressor = gs.CompressedAllReduce(name).compressor
    layout = Layout(((400, 64),))
    rounds = costmodel.bucket_rounds(compressor, layout)
    x = tf.random.stateless_normal([layout.numel], (1, 2))
    run = costmodel.roundtrip_fn(compressor, layout)
    run(x)
    _, sent = run(x)
    assert sum(b for _, b in rounds) == int(sent)
    transports = {t for t, _ in rounds}
    assert transports == ({gs.compression.SUM} if compressor.summable else {gs.compression.GATHER})


def test_payload_sizes_are_traced_once_per_setting_and_layout():
    """A compressor's payload sizes are kept by its settings (its repr) and the layout:
    an equal instance reuses them (the planner prices every worker count from one
    tracing), other settings or layouts get their own."""
    layout = Layout(((300, 20), (20,)))
    first = costmodel.bucket_rounds(gs.compression.get("topk", ratio=0.01), layout)
    assert costmodel.bucket_rounds(gs.compression.get("topk", ratio=0.01), layout) is first
    wider = costmodel.bucket_rounds(gs.compression.get("topk", ratio=0.02), layout)
    assert sum(b for _, b in wider) > sum(b for _, b in first)
    assert costmodel.bucket_rounds(gs.compression.get("topk", ratio=0.01),
                                   Layout(((600, 20),))) != first
    dgc = gs.compression.get("dgc")
    whole, chunks, server = gs.compression.two_phase.payload_bytes(dgc, layout, 4)
    assert dgc.codec() is not dgc.server_codec() and chunks == server


@pytest.mark.parametrize("name", ["fp16", "int8", "topk", "sign", "powersgd"])
def test_predicted_bytes_match_the_pipeline(devices, name):
    """Bytes per replica predicted for 4 replicas against `stats()` of one reduction on
    4 devices (gathered payloads: (N-1) P; summed: 2(N-1)/N P), past any warm-up."""
    compressor = gs.compression.get(name, **({"start_iter": 0} if name == "powersgd" else {}))
    ops = gs.CompressedAllReduce(compressor, exchange="auto" if compressor.summable else "gather",
                                 bucket_bytes=64 * 1024)
    values = []
    for i, (shape, dtype) in enumerate(SPECS):
        per_device = []
        for r, d in enumerate(devices):
            with tf.device(d):
                per_device.append(tf.random.stateless_normal(shape, (i, r), dtype=dtype))
        values.append(gs._tf_compat.per_replica(per_device))
    ops.batch_reduce(tf.distribute.ReduceOp.MEAN, [(v, v) for v in values])
    sent = ops.stats()["last_bytes_sent"]
    payloads = costmodel.model_payloads(ops.compressor, SPECS, 64 * 1024, len(devices))
    exchange = costmodel.exchanges_for(ops.compressor)[0]
    p = costmodel.predict(ops.compressor, payloads, exchange, len(devices), Link(), 0.0)
    assert p.bytes_per_worker == pytest.approx(sent, rel=1e-6), (p, sent)


def test_step_adds_compute_codec_and_wire_and_overlap_hides_all_but_the_last_bucket():
    payloads = costmodel.model_payloads("fp16", SPECS, 4096, 4)
    assert len(payloads) > 2
    link = Link(1e-3, 1e6)
    plain = costmodel.predict("fp16", payloads, "ring", 4, link, 0.5, throughput=1e9)
    assert plain.step_s == pytest.approx(plain.compute_s + plain.wire_s + plain.codec_s)
    assert plain.codec_s == pytest.approx(sum(b.dense_bytes for b in payloads) / 1e9)
    hidden = costmodel.predict("fp16", payloads, "ring", 4, link, 100.0, throughput=1e9,
                               overlap=1.0)
    last = payloads[-1]
    floor = exchange_seconds("ring", 4, last.rounds[0][1], link) + last.dense_bytes / 1e9
    assert hidden.step_s == pytest.approx(100.0 + floor)
    shared = costmodel.predict("fp16", payloads, "ring", 4, link, 0.5, throughput=1e9,
                               cpu_share=0.5)
    assert shared.codec_s == pytest.approx(2 * plain.codec_s)


def test_gathered_payloads_are_cheaper_in_two_phases_at_scale():
    payloads = costmodel.model_payloads("topk", [((2000, 2000), tf.float32)], 32 << 20, 16)
    link = Link(50e-6, 125e6)
    gather = costmodel.predict("topk", payloads, "gather", 16, link, 0.1)
    two = costmodel.predict("topk", payloads, "two_phase", 16, link, 0.1)
    assert two.bytes_per_worker < gather.bytes_per_worker / 4
    assert two.wire_s < gather.wire_s


@pytest.mark.parametrize("name", ["sign", "topk", "adaptive"])
def test_a_gather_prices_each_further_payload_by_how_decodings_run(name):
    """Gathered, N payloads cost a round trip plus N-1 decodes: `DECODE_SHARE` of it each
    as TensorFlow's ops, `DECODE_SHARE_COMPILED` where the decodings compile."""
    payloads = costmodel.model_payloads(name, [((500, 400), tf.float32)], 1 << 20, 8)
    dense = sum(b.dense_bytes for b in payloads)
    for jit_compile in (True, False):
        p = costmodel.predict(name, payloads, "gather", 8, Link(), 0.0, throughput=1e9,
                              jit_compile=jit_compile)
        share = costmodel.DECODE_SHARE_COMPILED if jit_compile else costmodel.DECODE_SHARE
        assert p.codec_s == pytest.approx(dense / 1e9 * (1 + 7 * share))


def test_each_call_of_the_data_path_costs_call_s_and_two_phases_make_one_per_chunk():
    payloads = costmodel.model_payloads("topk", [((1000, 600), tf.float32), ((50,), tf.float32)],
                                        1 << 20, 4)
    split = sum(b.chunks is not None for b in payloads)
    assert len(payloads) > 1 and split
    for exchange, calls in (("gather", len(payloads)),
                            ("two_phase", 4 * split + len(payloads) - split)):
        for share in (1.0, 0.5):
            plain = costmodel.predict("topk", payloads, exchange, 4, Link(), 0.1, 1e9,
                                      cpu_share=share)
            called = costmodel.predict("topk", payloads, exchange, 4, Link(), 0.1, 1e9,
                                       cpu_share=share, call_s=1e-3)
            assert called.codec_s - plain.codec_s == pytest.approx(calls * 1e-3 / share)
    with pytest.raises(ValueError, match="call_s must be >= 0, got -1"):
        costmodel.predict("topk", payloads, "gather", 4, Link(), 0.1, call_s=-1)


def test_a_codec_is_fitted_as_a_cost_per_call_and_a_rate(monkeypatch):
    def timed(fixed):
        return lambda compressor, numel, repeats, **kw: {"seconds": fixed + numel * 4 / 2e9}
    monkeypatch.setattr(costmodel, "measure_throughput", timed(3e-4))
    rate, call = costmodel.measure_codec("sign", 1 << 20)
    assert rate == pytest.approx(2e9) and call == pytest.approx(3e-4)
    # Shorter calls no cheaper per byte: no fixed part.
    monkeypatch.setattr(costmodel, "measure_throughput", timed(0.0))
    assert costmodel.measure_codec("sign", 1 << 20) == pytest.approx((2e9, 0.0))
    monkeypatch.undo()
    rate, call = costmodel.measure_codec("int8", 1 << 17, repeats=2)
    assert rate > 0 and call >= 0


def test_predict_refuses_an_exchange_the_payload_cannot_take():
    payloads = costmodel.model_payloads("topk", SPECS, 4096, 2)
    with pytest.raises(ValueError, match="topk cannot travel in 'ring'; valid: gather, two_phase"):
        costmodel.predict("topk", payloads, "ring", 2, Link(), 0.1)
    with pytest.raises(ValueError, match="overlap"):
        costmodel.predict("topk", payloads, "gather", 2, Link(), 0.1, overlap=2)


@pytest.mark.parametrize("name", ["none", "int8", "topk"])
def test_data_path_runs_the_step_around_the_codec(name):
    """The calibration's data path: a reduction of two replicas with SUM, as optimizers
    reduce gradients (this replica's payload is all it receives), with the compression
    error the stats read."""
    compressor = gs.CompressedAllReduce(name).compressor
    layout = Layout(((400, 64),))
    x = tf.random.stateless_normal([layout.numel], (1, 2))
    codec = costmodel.roundtrip_fn(compressor, layout)
    path = costmodel.roundtrip_fn(compressor, layout, replicas=2, measure_error=True)
    decoded, sent = codec(x)
    summed, sent2, error_sq, norm_sq = path(x)
    assert int(sent2) == int(sent)
    want = x.numpy() if name == "none" else decoded.numpy()
    np.testing.assert_allclose(summed.numpy(), want, rtol=0.02, atol=0.02 * np.abs(want).max())
    if name == "none":        # exact: nothing to measure, no passes spent on it
        assert float(error_sq) == float(norm_sq) == 0
    else:
        assert 0 < float(error_sq) / float(norm_sq) < 1
    row = costmodel.measure_throughput(name, 100_000, repeats=2)
    assert row["bytes_per_s"] > 0 and row["payload_bytes"] > 0


def test_measured_throughput_is_positive_and_counts_the_payload():
    row = costmodel.measure_throughput("int8", 100_000, repeats=2, data_path=False)
    assert row["bytes_per_s"] > 0 and np.isfinite(row["seconds"])
    assert row["payload_bytes"] == sum(
        b for _, b in costmodel.bucket_rounds(gs.compression.get("int8"),
                                              Layout((costmodel.matrix_shape(100_000),))))


def test_median_seconds_returns_the_first_result_whole_and_times_every_call():
    calls = []

    def fn():
        calls.append(1)
        return {"x": tf.fill([len(calls), 3], float(len(calls))), "n": 7,
                "empty": tf.zeros([0])}
    sec, first = costmodel.median_seconds(fn, 4)
    assert len(calls) == 5 and sec >= 0
    np.testing.assert_array_equal(first["x"], np.ones([1, 3]))
    assert first["n"] == 7 and first["empty"].shape == (0,)
