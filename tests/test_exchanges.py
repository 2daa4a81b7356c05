"""One battery over every exchange object: the same signature, the same results as
numpy, every byte that crosses a device counted, clear errors for what an exchange
does not move."""

import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from _multiworker import run_launcher  # tests/_multiworker.py
from tf_gradsync import algorithms
from tf_gradsync.algorithms import Group, Wire, collective
from tf_gradsync.algorithms._common import words_of
from tf_gradsync.compression import GATHER, SCATTER, SUM

EXCHANGES = {**algorithms.ALGORITHMS, "hierarchical": algorithms.HIERARCHICAL,
             "two_phase": algorithms.TWO_PHASE}
SPECS = (((5, 3), np.float32), ((7,), np.float16), ((2,), np.int32), ((4,), np.float32))


def _payloads(members, devices, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [[(rng.standard_normal(s) * 4).astype(d) for s, d in SPECS] for _ in members]
    tensors = []
    for a, d in zip(arrays, devices):
        with tf.device(d):
            tensors.append(tuple(tf.constant(x) for x in a))
    return arrays, tensors


def _on(placed: str, device: str) -> bool:
    a, b = tf.DeviceSpec.from_string(placed), tf.DeviceSpec.from_string(device)
    return (a.device_type, a.device_index) == (b.device_type, b.device_index)


def _bytes(arrays):
    return sum(x.nbytes for x in arrays)


def _run(ex, transport, group, arrays, parts=None):
    """Runs the exchange in a graph, as the pipeline does; returns what each device
    received (numpy), the devices the results were placed on, and the bytes counted."""
    wire, placed = Wire(), []

    @tf.function
    def fn():
        sent = []
        for i, d in enumerate(group.devices):   # every member builds its payloads itself
            with tf.device(d):
                if parts is None:
                    sent.append(tuple(tf.constant(x) for x in arrays[i]))
                else:
                    sent.append(tuple(tuple(tf.constant(x) for x in arrays[k]) for k in parts[i]))
        got = ex(sent, transport, group, wire)
        placed.extend(tf.nest.map_structure(lambda t: t.device, got))
        return got

    got = tf.nest.map_structure(lambda t: t.numpy(), fn())
    return got, placed, wire.static


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_every_exchange_sums_and_gathers_like_numpy(devices, name, n):
    ex = EXCHANGES[name]
    group = Group(tuple(devices[:n]))
    rng = np.random.default_rng(n)
    arrays = [[(rng.standard_normal(s) * 4).astype(d) for s, d in SPECS] for _ in range(n)]
    per_member = _bytes(arrays[0])
    for transport in ex.transports:
        # SCATTER: member i sends member j the payload arrays[(i + j) % n].
        parts = [[(i + j) % n for j in range(n)] for i in range(n)] \
            if transport == SCATTER else None
        got, placed, sent = _run(ex, transport, group, arrays, parts)
        assert len(got) == n
        for i, d in enumerate(group.devices):
            assert all(_on(p, d) for p in tf.nest.flatten(placed[i])), (name, transport)
            if transport == SUM:
                for x, *ys in zip(got[i], *arrays):
                    want = np.sum([y.astype(np.float64) for y in ys], 0)
                    # Each partial sum may be rounded to the payload's dtype.
                    eps = np.finfo(x.dtype).eps if x.dtype.kind == "f" else 0
                    atol = n * eps * np.abs(ys).sum(0).max()
                    np.testing.assert_allclose(x.astype(np.float64), want, rtol=0, atol=atol)
                continue
            assert len(got[i]) == n
            for j in range(n):   # GATHER: member j's payload; SCATTER: member j's part i
                for x, y in zip(got[i][j], arrays[(i + j) % n if parts else j]):
                    np.testing.assert_array_equal(x, y)
        # A bandwidth-optimal sum sends about 2(N-1)/N of a payload per member (exactly
        # when chunks divide evenly), a gather N-1 payloads, a scatter N-1 parts.
        if transport == SUM:
            assert sent == pytest.approx(2 * (n - 1) * per_member, rel=0.25), name
        elif name in ("collective", "hierarchical") and transport == GATHER:
            # One collective of the payload packed into words; the padding is sent too.
            assert sent == (n - 1) * n * 4 * words_of([tf.TensorSpec(s, d) for s, d in SPECS])
        else:
            assert sent == (n - 1) * n * per_member


def test_a_round_is_one_collective_per_dtype_summed_and_one_gathered(devices):
    """Each collective costs a launch and a rendezvous of every member, so a round's
    tensors travel together: summed by dtype (SPECS has three), gathered packed."""
    group = Group(tuple(devices[:2]))
    arrays = [[np.ones(s, d) for s, d in SPECS] for _ in range(2)]
    for transport, op, per_device in ((SUM, "CollectiveReduceV2", 3),
                                      (GATHER, "CollectiveGatherV2", 1)):
        @tf.function
        def fn():
            sent = []
            for d, a in zip(group.devices, arrays):
                with tf.device(d):
                    sent.append(tuple(tf.constant(x) for x in a))
            return EXCHANGES["collective"](sent, transport, group, Wire())
        ops = fn.get_concrete_function().graph.get_operations()
        assert sum(o.type == op for o in ops) == per_device * len(group.devices), transport


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_one_member_gets_its_own_payload(devices, name):
    ex = EXCHANGES[name]
    arrays, payloads = _payloads([0], devices[:1])
    wire = Wire()
    for transport in ex.transports:
        sent = [(payloads[0],)] if transport == SCATTER else payloads
        got = ex(sent, transport, Group(tuple(devices[:1])), wire)
        own = got[0] if transport == SUM else got[0][0]
        for x, y in zip(own, arrays[0]):
            np.testing.assert_array_equal(x.numpy(), y)
    assert wire.static == 0


def test_errors_name_the_exchange_and_what_it_moves(devices):
    group = Group(tuple(devices[:2]))
    _, payloads = _payloads(range(2), group.devices)
    with pytest.raises(ValueError, match="the ring exchange moves sum, gather payloads, not 'scatter'"):
        algorithms.ALGORITHMS["ring"](payloads, SCATTER, group, Wire())
    with pytest.raises(ValueError, match="two_phase exchange moves scatter, gather payloads, not 'sum'"):
        algorithms.TWO_PHASE(payloads, SUM, group, Wire())
    with pytest.raises(ValueError, match="one process; 2 workers need a collective one"):
        algorithms.ALGORITHMS["tree"](payloads, SUM, Group(group.devices, workers=2), Wire())


def test_for_round_picks_by_transport_workers_and_size(devices):
    one = Group(tuple(devices))
    two = Group(tuple(devices[:2]), workers=2, worker=1)
    assert two.size == 4 and two.members == (2, 3)
    assert algorithms.for_round(SCATTER, None, one, "auto", 10) is algorithms.TWO_PHASE
    assert algorithms.for_round(GATHER, ((),) * 4, one, "ring", 10) is algorithms.TWO_PHASE
    assert algorithms.for_round(SUM, None, two, "ring", 10) is algorithms.HIERARCHICAL
    assert algorithms.for_round(GATHER, None, two, "ring", 10).name == "collective"
    assert algorithms.for_round(SUM, None, one, "auto", 10).name == "tree"
    assert algorithms.for_round(SUM, None, one, "auto", 10 << 20).name == "ring"
    assert algorithms.for_round(SUM, None, one, "collective", 10).name == "collective"


def _reduce_step(strategy, arrays):
    """A training-like step: every replica all-reduces its own arrays."""
    stacked = [tf.constant(np.stack(per_replica)) for per_replica in zip(*arrays)]

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce("SUM", [s[ctx.replica_id_in_sync_group] for s in stacked])
        return strategy.experimental_local_results(strategy.run(fn))
    return step


def test_a_bucket_with_modes_waits_for_no_other_buckets_collectives(devices):
    """With several modes a bucket's rounds run inside one `tf.switch_case`, which takes
    the ordering tokens of the collectives it holds. With one token per device,
    TensorFlow would start each bucket's switch only after the previous one had ended
    (its exchange included); on CPUs each switch has a token of its own. The results
    still match the ring exchange, which has no collectives."""
    rng = np.random.default_rng(0)
    arrays = [[rng.standard_normal((64, 32)).astype(np.float32) for _ in range(3)]
              for _ in devices[:2]]
    got = {}
    for algorithm in ("collective", "ring"):
        # Warm-up of 1: the first step all-reduces densely, the second runs PowerSGD.
        ops = gs.CompressedAllReduce(gs.compression.get("powersgd", start_iter=1),
                                     algorithm=algorithm, bucket_bytes=8192, timeout_seconds=60)
        strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
        step = _reduce_step(strategy, arrays)
        cases = [op for op in step.get_concrete_function().graph.get_operations()
                 if op.type == "Case"]
        if algorithm == "collective":
            assert len(cases) == 3
            assert all(not op.control_inputs for op in cases), \
                [(op.name, [c.name for c in op.control_inputs]) for op in cases]
        got[algorithm] = [[[t.numpy() for t in r] for r in step()] for _ in range(2)]
    np.testing.assert_allclose(got["collective"], got["ring"], rtol=1e-5, atol=1e-5)
    # The dense first step is the exact sum; PowerSGD's second is not.
    np.testing.assert_allclose(got["collective"][0][1][0], arrays[0][0] + arrays[1][0],
                               rtol=1e-6)
    assert not np.allclose(got["collective"][1][1][0], arrays[0][0] + arrays[1][0], rtol=1e-3)


def test_cpu_collectives_with_tokens_of_their_own_complete_in_either_launch_order(
        tmp_path):
    """Two workers launch two all-reduces in opposite orders (each holds back a different
    one): CPU collectives match their peers by instance key, so both complete. This is
    what lets a bucket's switch between modes take a token of its own on CPUs."""
    script = os.path.join(os.path.dirname(__file__), "_launch_order.py")
    proc, _ = run_launcher(script, 2, f"--out={tmp_path}", timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"order_{rank}.json").read_text())
        assert got == {"a": [3.0, 20.0], "b": [3.0, 40.0]}


def test_keys_derived_from_an_exchange_do_not_depend_on_the_order_built():
    """Inside `keyed`, a collective's key follows from the identity, its place in it,
    its group and shapes: built in either order, two exchanges get the same keys; a
    frame restores the one it nests in; outside, keys are counted, never reused."""
    def keys(identity, n, group=7):
        with collective.keyed(identity):
            return [collective.next_instance_key(group, ((4,), "float32")) for _ in range(n)]
    a, b = keys("exchange a", 3), keys("exchange b", 2)
    assert keys("exchange b", 2) == b and keys("exchange a", 3) == a
    assert len(set(a + b)) == 5 and all(k >= 1 << 30 for k in a + b)
    with collective.keyed("outer"):
        first = collective.next_instance_key(7)
        assert keys("inner", 1) == keys("inner", 1)
        second = collective.next_instance_key(7)
    with collective.keyed("outer"):
        assert [collective.next_instance_key(7), collective.next_instance_key(7)] == [first,
                                                                                      second]
    assert keys("exchange a", 1, group=8) != a[:1]          # another group, another key
    counted = [collective.next_instance_key() for _ in range(2)]
    assert counted[1] == counted[0] + 1 and counted[0] < 1 << 30


def test_a_collision_of_derived_keys_takes_the_next_free_one_and_says_so(monkeypatch,
                                                                          caplog):
    monkeypatch.setattr(collective.zlib, "crc32", lambda data: 12345)
    monkeypatch.setattr(collective, "_derived", {})
    with collective.keyed("x"):
        x = collective.next_instance_key(3)
    with caplog.at_level(logging.WARNING), collective.keyed("y"):
        y = collective.next_instance_key(3)
    assert y == x + 1 and "hash to one key" in caplog.text
    with collective.keyed("x"):
        assert collective.next_instance_key(3) == x           # its own key again
