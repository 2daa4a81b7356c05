"""Multi-worker training on localhost: worker processes started by tf_gradsync.launch."""

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
import multiworker_digits  # examples/multiworker_digits.py
import train_digits
from _multiworker import PARAMS, ROOT, assert_same_weights, launch, results, run_launcher


@pytest.fixture(scope="module")
def none_2workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("none2")
    proc, out, _ = launch(tmp, 2, "--compression=none", "--epochs=10")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return results(out, 2)


@pytest.mark.slow
def test_keras3_fit_none_two_workers(none_2workers):
    weights, res = none_2workers
    assert_same_weights(weights)
    stats = res[0]["stats"]
    # One bucket of every gradient; a 2-member ring sends 2(N-1)/N = 1x the bucket.
    assert stats["last_bytes_sent"] == stats["last_bytes_dense"] == PARAMS * 4
    assert stats["steps"] == 10 * 23
    assert res[0]["accuracy"] >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("compression,options,ratio", [
    # fp16: test_keras3_fit_three_workers and test_tf_keras_two_workers.
    ("topk", '{"ratio": 0.05}', None),
    ("powersgd", '{"rank": 16}', None),
])
def test_keras3_fit_compressed_two_workers(tmp_path, none_2workers, compression, options, ratio):
    proc, out, _ = launch(tmp_path, 2, f"--compression={compression}",
                          f"--compression_options={options}", "--epochs=10")
    assert proc.returncode == 0, proc.stdout[-4000:]
    weights, res = results(out, 2)
    assert_same_weights(weights)
    stats = res[0]["stats"]
    # Bytes and steps agree across workers; comm_error is each worker's own gradients'.
    local = ("comm_error",)
    assert {k: v for k, v in res[1]["stats"].items() if k not in local} == \
        {k: v for k, v in stats.items() if k not in local}
    assert 0 < res[1]["stats"]["comm_error"] < 1
    assert stats["last_bytes_dense"] == PARAMS * 4
    if ratio:
        assert stats["compression_ratio"] == pytest.approx(ratio)
    else:
        # The last step's: PowerSGD all-reduces its first 100 steps uncompressed.
        assert stats["last_bytes_dense"] / stats["last_bytes_sent"] > 2
    assert res[0]["accuracy"] >= none_2workers[1][0]["accuracy"] - 0.02


@pytest.mark.slow
def test_keras3_fit_three_workers(tmp_path):
    # A global batch divisible by the replica count: Keras builds the model from a
    # cross-worker mean of the first batch, which needs equal shapes on every worker.
    proc, out, _ = launch(tmp_path, 3, "--compression=fp16", "--epochs=6", "--batch_size=63")
    assert proc.returncode == 0, proc.stdout[-4000:]
    weights, res = results(out, 3)
    assert_same_weights(weights)
    # fp16 halves a 3-member ring's 2(N-1)/N of the bucket.
    assert res[0]["stats"]["last_bytes_sent"] == PARAMS * 4 * 4 // 3 // 2
    assert res[0]["accuracy"] >= 0.9


@pytest.mark.slow
def test_custom_loop_matches_single_process_mirrored(tmp_path, devices):
    proc, out, _ = launch(tmp_path, 2, "--compression=none", "--loop=custom", "--epochs=2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    weights, _ = results(out, 2)
    assert_same_weights(weights)
    # ReductionToOneDevice: TF's default collectives would reuse a group key that an
    # earlier 4-device strategy in this process already holds.
    strategy = tf.distribute.MirroredStrategy(devices[:2],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    x_train, _, y_train, _ = train_digits.load_data(0)
    with strategy.scope():
        model = train_digits.build_model(tf.keras, 0)
    multiworker_digits.custom_loop(strategy, model, x_train, y_train, 2, 64)
    for got, want in zip(weights[0], model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tf_keras_two_workers(tmp_path):
    proc, out, _ = launch(tmp_path, 2, "--compression=fp16", "--epochs=6",
                          env={"TF_USE_LEGACY_KERAS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    weights, res = results(out, 2)
    assert_same_weights(weights)
    assert res[0]["stats"]["compression_ratio"] == pytest.approx(2.0)
    assert res[0]["accuracy"] >= 0.9


@pytest.mark.slow
def test_dead_worker_fails_the_job_in_bounded_time(tmp_path):
    proc, out, elapsed = launch(tmp_path, 2, "--compression=fp16", "--epochs=50",
                                "--die_at_step=5", "--timeout=20", timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert elapsed < 120
    assert not glob.glob(str(out / "result_*.json"))
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert left.strip() == "", f"orphan workers: {left}"


_STALLING_WORKER = """
import os, sys, time
import numpy as np
import tensorflow as tf
import tf_gradsync as gs
keras = tf.keras
ops = gs.CompressedAllReduce("fp16", timeout_seconds=float(sys.argv[1]))
strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)   # no CommunicationOptions
rank = strategy.worker_index
x = np.random.RandomState(0).randn(512, 8).astype("float32")
y = (x[:, 0] > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])

class Stall(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and batch == 3:
            time.sleep(600)

start = time.monotonic()
try:
    model.fit(x, y, batch_size=32, epochs=20, verbose=0, callbacks=[Stall()])
    print("RESULT finished", flush=True)
except Exception as e:
    print("RESULT raised", type(e).__name__, round(time.monotonic() - start, 1), flush=True)
"""


def _worker_env(cluster: list[str], rank: int, **extra: str) -> dict:
    """The environment of worker `rank` of `cluster` started by hand (TF_CONFIG)."""
    return dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **extra,
                TF_CONFIG=json.dumps({"cluster": {"worker": cluster},
                                      "task": {"type": "worker", "index": rank}}))


@pytest.mark.slow
def test_a_stuck_peer_fails_fit_within_the_ops_timeout(tmp_path):
    """Under model.fit a peer that is alive but stuck also stalls the metrics'
    collectives, which are TensorFlow's: the ops' timeout_seconds bounds them as well,
    without CommunicationOptions (the survivor waited as long as the peer slept)."""
    from tf_gradsync import launch as launcher
    cluster = [f"127.0.0.1:{p}" for p in launcher.free_ports(2)]
    procs = []
    for rank in range(2):
        env = _worker_env(cluster, rank, TF_NUM_INTRAOP_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _STALLING_WORKER, "8"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        out, _ = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    result = [l.split() for l in out.splitlines() if l.startswith("RESULT")]
    assert result and result[-1][1] == "raised", out[-3000:]
    assert result[-1][2] == "DeadlineExceededError", out[-3000:]


_ALONE = """
import sys, time
import tf_gradsync as gs
start = time.monotonic()
try:
    gs.MultiWorkerMirroredStrategy(startup_timeout_seconds=float(sys.argv[1]))
    print("RESULT started", flush=True)
except TimeoutError as e:
    print("RESULT raised", round(time.monotonic() - start, 1), e, flush=True)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_that_never_starts_fails_the_others_at_startup(rank):
    """A task of the cluster that never starts left the others waiting at the strategy's
    creation without end or output (TensorFlow's coordination service, before any
    collective with a timeout): `startup_timeout_seconds` bounds the wait, on the
    leader (task 0) and on the others alike, naming it."""
    from tf_gradsync import launch as launcher
    cluster = [f"127.0.0.1:{p}" for p in launcher.free_ports(2)]
    env = _worker_env(cluster, rank)
    out = subprocess.run([sys.executable, "-c", _ALONE, "3"], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    (result,) = [l.split(maxsplit=3) for l in out.splitlines() if l.startswith("RESULT")]
    assert result[1] == "raised", out[-3000:]
    assert f"worker {rank}: the cluster's 2 tasks did not all start and join within " \
           "startup_timeout_seconds=3" in result[3]


def test_a_late_worker_joins_within_the_startup_timeout():
    """A worker started seconds after the other joins it within the wait."""
    from tf_gradsync import launch as launcher
    cluster = [f"127.0.0.1:{p}" for p in launcher.free_ports(2)]
    procs = []
    try:
        for rank in range(2):
            env = _worker_env(cluster, rank)
            procs.append(subprocess.Popen([sys.executable, "-c", _ALONE, "120"], env=env,
                                          stdout=subprocess.PIPE, text=True))
            time.sleep(6)       # the second starts late
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for out in outs:
        assert "RESULT started" in out, out[-2000:]


#: Summed (hierarchical: shards between workers), gathered, and two-phase payloads;
#: PowerSGD sums two rounds.
HIERARCHICAL_MODES = ("fp16:auto", "powersgd:auto", "sign:gather", "sign:two_phase",
                      "topk:two_phase")


def test_twin_reductions_keep_their_own_state_across_workers(tmp_path):
    """Two reductions of one shape in a step, across two workers: the second (zero)
    stays zero (its collectives and state are its own, keyed alike on both workers),
    both workers agree, and the loss all-reduced by hand is exact and no step."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_twin_worker.py")
    proc, _ = run_launcher(script, 2, str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    runs = [json.loads((tmp_path / f"worker_{r}.json").read_text()) for r in range(2)]
    for a, b in zip(runs[0]["steps"], runs[1]["steps"]):
        assert a["first"] == b["first"] and a["loss"] == b["loss"]
        assert a["second"] == b["second"] == 0 and np.abs(a["first"]).sum() > 0
        assert a["loss"] == pytest.approx(a["own_loss"] + b["own_loss"], rel=1e-6)
    assert runs[0]["synchronisations"] == 6


@pytest.mark.slow
def test_two_workers_of_two_devices_match_four_devices_of_one_process(tmp_path, devices):
    """With several devices per worker, every exchange (hierarchical sums, gathers, two
    phases) computes what the same four replicas compute in one process; between workers
    the hierarchical sum sends each worker's shards, not a second full payload."""
    import _hierarchical
    steps = 3
    proc, _ = run_launcher(_hierarchical.__file__, 2, f"--out={tmp_path}",
                           f"--modes={','.join(HIERARCHICAL_MODES)}", f"--steps={steps}",
                           timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    workers = [json.loads((tmp_path / f"worker_{r}.json").read_text()) for r in range(2)]
    for mode in HIERARCHICAL_MODES:
        name, exchange = mode.split(":")
        ops = gs.CompressedAllReduce(name, exchange=exchange)
        fn = _hierarchical.reduce_fn(ops, devices)
        for step in range(steps):
            want = fn([_hierarchical.values(m, step) for m in range(4)])
            for rank, run in enumerate(workers):
                for v, per_device in enumerate(run[mode]["results"][step]):
                    for i, got in enumerate(per_device):
                        # fp16 partial sums are rounded in another order across workers.
                        tol = 2e-3 if name == "fp16" else 1e-5
                        np.testing.assert_allclose(
                            np.array(got), want[v][rank * 2 + i].numpy(), rtol=tol, atol=tol,
                            err_msg=f"{mode} step {step} value {v} worker {rank} device {i}")
        sent = [run[mode]["bytes"] for run in workers]
        ref = ops.stats()["last_bytes_sent"]
        # Across workers, payloads of different shapes travel padded to whole words.
        assert all(ref <= s <= 1.1 * ref for s in sent), (mode, sent, ref)


@pytest.mark.slow
def test_ops_that_exchange_otherwise_describe_themselves_otherwise():
    """Workers compare their ops by description: every setting that changes what
    travels is in it. `jit_compile` picks gather or two phases for top-k at 3 to 6
    workers, and workers that disagreed waited in collectives that never matched."""
    base = gs.CompressedAllReduce("topk")
    for other in (gs.CompressedAllReduce("topk", jit_compile=False),
                  gs.CompressedAllReduce("topk", exchange="gather"),
                  gs.CompressedAllReduce("topk", bucket_bytes=1 << 20),
                  gs.CompressedAllReduce("topk", algorithm="ring"),
                  gs.CompressedAllReduce("topk", warmup_steps=2),
                  gs.CompressedAllReduce("topk", guard=True),
                  gs.CompressedAllReduce(gs.compression.get("topk", ratio=0.1))):
        assert repr(other) != repr(base)
    assert repr(gs.CompressedAllReduce("topk")) == repr(base)


@pytest.mark.parametrize("rank1,described", [
    ("fp16", "CompressedAllReduce(Float16(prescale=True)"),
    ("stock", "no CompressedAllReduce (TensorFlow's own collectives)")])
def test_workers_of_different_ops_stop_at_once_naming_their_ops(tmp_path, rank1, described):
    """A worker built with another compressor would meet the others in collectives of
    other keys and shapes and wait there forever (top-k against fp16 did, without a
    timeout); one without ops failed at the first step with TensorFlow's "Collective
    instance ... expected type". All stop at the strategy's creation, naming their ops."""
    import _worker  # tests/_worker.py
    proc, _ = run_launcher(_worker.__file__, 2, f"--out={tmp_path}", "--compression=topk",
                           f"--rank1_compression={rank1}", "--steps=3", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "worker 0 has CompressedAllReduce(ErrorFeedback(inner=TopK(ratio=0.01))" in out
    assert f"worker 1 has {described}" in out
    assert "every worker must build the same compressor" in out


@pytest.mark.parametrize("compression,exchange,rtol", [
    ("fp16", "auto", 0), ("int8", "auto", 0.02), ("int8", "two_phase", 0.05),
    ("powersgd", "auto", 0)])     # PowerSGD's modes: its dense warm-up, then its rounds
def test_workers_tracing_in_other_orders_or_retracing_alone_still_meet(tmp_path, compression,
                                                                       exchange, rtol):
    """Exchange keys follow from what an exchange is, not from the order a worker traced
    it in: two functions traced in opposite orders, and one retraced by one worker alone,
    used to wait for each other until the timeout."""
    import _trace_order  # tests/_trace_order.py
    proc, _ = run_launcher(_trace_order.__file__, 2, f"--out={tmp_path}",
                           f"--compression={compression}", f"--exchange={exchange}",
                           timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = [json.loads((tmp_path / f"trace_{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    for name, shape, factor in [("f", [64], 3), ("g", [16, 3], 3), ("h", [40], 5)]:
        want = (np.arange(np.prod(shape)).reshape(shape) + 1.0) * factor
        np.testing.assert_allclose(got[0][name], want, rtol=rtol, atol=rtol * want.max())


def test_gradients_of_shapes_known_when_they_run_are_compressed_and_counted(tmp_path):
    """Keras traces `fit` with relaxed shapes: over sequences of varying lengths a Dense
    kernel's gradient is [None, n]. It takes its variable's shape and is compressed (it
    went through TensorFlow's collectives, uncounted: fp16 read 2x while sending 1.1x);
    the call that meets the end of the data counts no step; a tensor of a shape known
    only when it runs, all-reduced by hand, is counted as its ring sends it, no step."""
    import _fit_worker  # tests/_fit_worker.py
    proc, _ = run_launcher(_fit_worker.__file__, 2, f"--out={tmp_path}", "--case=sequences",
                           "--compression=fp16", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = [json.loads((tmp_path / f"sequences_{r}.json").read_text()) for r in range(2)]
    assert results[0]["weights"] == results[1]["weights"]
    params = 8 * 16 + 16 + 16 * 4 + 4
    for r in results:
        fit, hand = r["after_fit"], r["after_hand"]
        assert fit["steps"] == _fit_worker.BATCHES
        # A ring all-reduce over 2 replicas sends each one's whole bucket once.
        assert fit["last_bytes_dense"] == 4 * params
        assert fit["last_bytes_sent"] == 2 * params
        np.testing.assert_array_equal(r["reduced"], np.full([6, 5], 2.0))
        assert hand["steps"] == fit["steps"]
        assert hand["bytes_sent"] - fit["bytes_sent"] == 6 * 5 * 4
        assert hand["bytes_dense"] - fit["bytes_dense"] == 6 * 5 * 4


@pytest.mark.parametrize("name,dense", [("none", False), ("fp16", False), ("sign", False),
                                        ("fp16", True)])
def test_embedding_gradients_across_workers_are_counted(tmp_path, name, dense):
    """TensorFlow's collectives gather embedding gradients across workers; their bytes
    (values in 16 bits under fp16) count in `stats()` as in one process: a step sends
    what the planner prices for two workers. With `sparse_as_dense` the table's
    gradient is bucketed and compressed with the rest, as the planner prices it then."""
    import _fit_worker  # tests/_fit_worker.py
    from tf_gradsync import plan
    spec = f"{name}:sparse_as_dense=true" if dense else name
    proc, _ = run_launcher(_fit_worker.__file__, 2, f"--out={tmp_path}", "--case=embedding",
                           f"--compression={spec}", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    path = str(tmp_path / "rec.keras")
    _fit_worker.build().save(path)
    specs, lookups = plan.gradients_of(path, None, batch=8)
    row = next(r for r in plan.plan(specs, [spec], [2], ["1gbit"], 0.01, lookups=lookups)
               if r["compressor"] == spec)
    # Across workers a gathered payload of several tensors (sign's bits and scales)
    # travels packed in int32 words, whose padding the planner does not price.
    padding = 0 if name in ("none", "fp16") else 4 * len(specs)
    for rank in range(2):
        stats = json.loads((tmp_path / f"embedding_{rank}.json").read_text())
        assert stats["steps"] == 1 and stats["bytes_sent"] == stats["last_bytes_sent"]
        assert 0 <= stats["last_bytes_sent"] - row["bytes_per_worker"] < padding + 1
        if dense:    # every gradient in one fp16 ring all-reduce
            assert stats["compression_ratio"] == 2.0
