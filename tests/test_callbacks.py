"""CommunicationMonitor, StepMonitor and the report CLI."""

import csv
import gc
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import report
from tf_gradsync.callbacks import CommunicationMonitor, StepMonitor, _common, is_chief
import _tf_keras  # tests/_tf_keras.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = [f"/cpu:{i}" for i in range(4)]
# Dense(4) on 8 inputs: 8 * 4 + 4 = 36 float32 parameters = 144 bytes, one bucket. A ring
# all-reduce over 4 replicas sends 2 * (4 - 1) / 4 of the bucket per replica.
DENSE_BYTES = 2 * 3 / 4 * 144
EXPECTED = {"none": DENSE_BYTES, "fp16": DENSE_BYTES / 2}
BATCH = 16


def _data(n=64, nan=False):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    if nan:
        x[3, 2] = np.nan
    return x, rng.normal(size=(n, 4)).astype(np.float32)


class _StatsDeltas(tf.keras.callbacks.Callback):
    """Runs after the monitor: what it put in `logs` next to ops.stats() deltas."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.rows = ops, []

    def on_train_begin(self, logs=None):
        self.last = self.ops.stats()

    def on_train_batch_end(self, batch, logs=None):
        now = self.ops.stats()
        steps = now["steps"] - self.last["steps"]
        self.rows.append((logs["comm_bytes"], (now["bytes_sent"] - self.last["bytes_sent"]) / steps,
                          logs["comm_bytes_dense"],
                          (now["bytes_dense"] - self.last["bytes_dense"]) / steps))
        self.last = now


def _fit(compression, monitor_args=None, n=64, epochs=2, nan=False, steps_per_execution=1):
    ops = (compression if isinstance(compression, gs.CompressedAllReduce)
           else gs.CompressedAllReduce(compression, algorithm="ring"))
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse", steps_per_execution=steps_per_execution)
    args = dict(monitor_args or {})
    monitor = CommunicationMonitor(args.pop("target", ops), **args)
    deltas = _StatsDeltas(ops)
    x, y = _data(n, nan)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[monitor, deltas])
    return types.SimpleNamespace(ops=ops, history=history.history, deltas=deltas.rows,
                                 monitor=monitor)


def _jsonl(path):
    def no_nan(token):
        raise AssertionError(f"non-JSON constant {token} in {path}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=no_nan) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for compression in ("none", "fp16"):
        d = tmp_path_factory.mktemp(compression)
        files = {"jsonl_path": str(d / f"{compression}.jsonl"), "csv_path": str(d / "run.csv"),
                 "tensorboard_dir": str(d / "tb")}
        out[compression] = _fit(compression, dict(files, batch_size=BATCH))
        out[compression].files = files
    return out


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_logged_bytes_match_stats_deltas_and_hand_computation(runs, compression):
    run, want = runs[compression], EXPECTED[compression]
    assert len(run.deltas) == 8                                  # 64 / 16 x 2 epochs
    for logged, delta, logged_dense, delta_dense in run.deltas:
        assert logged == delta == want
        assert logged_dense == delta_dense == DENSE_BYTES
    h = run.history
    assert h["comm_bytes"] == [want, want]
    assert h["comm_bytes_dense"] == [DENSE_BYTES, DENSE_BYTES]
    assert h["compression_ratio"] == [DENSE_BYTES / want] * 2
    assert h["comm_bytes_total"] == [4 * want, 8 * want]
    assert h["comm_bytes_total"][-1] == run.ops.stats()["bytes_sent"]
    # The compression error of what was sent: 0 for none, float16 rounding for fp16.
    assert all((e == 0) if compression == "none" else (0 < e < 1e-3) for e in h["comm_error"])
    assert len(h["comm_error"]) == 2
    for key in ("step_time_ms", "step_time_p50_ms", "step_time_p90_ms", "samples_per_sec"):
        assert all(v > 0 for v in h[key]), key
    assert h["step_time_p50_ms"][1] <= h["step_time_p90_ms"][1]
    assert h["samples_per_sec"][1] == pytest.approx(BATCH / h["step_time_ms"][1] * 1000)


def test_csv_jsonl_and_tensorboard_files(runs):
    files = runs["none"].files
    rows = _jsonl(files["jsonl_path"])
    assert [r["kind"] for r in rows] == ["batch"] * 4 + ["epoch"] + ["batch"] * 4 + ["epoch"]
    batches = [r for r in rows if r["kind"] == "batch"]
    assert [r["step"] for r in batches] == list(range(1, 9))
    assert [r["epoch"] for r in batches] == [0] * 4 + [1] * 4
    assert all(r["comm_bytes"] == DENSE_BYTES and r["loss"] > 0 for r in batches)
    assert batches[0]["step_time_ms"] is None, "the first batch (tracing) is not timed"
    assert all(r["step_time_ms"] > 0 for r in batches[1:])
    walls = [r["wall_time_s"] for r in rows]
    assert walls == sorted(walls) and walls[0] > 0
    epoch = rows[-1]
    assert epoch["comm_bytes_total"] == 8 * DENSE_BYTES and epoch["steps"] == 4
    assert epoch["step_time_p50_ms"] > 0

    with open(files["csv_path"], newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [r["kind"] for r in table] == [r["kind"] for r in rows]
    assert [float(r["comm_bytes"]) for r in table] == [DENSE_BYTES] * 10
    assert float(table[-1]["loss"]) == pytest.approx(epoch["loss"])

    # Read back the way TensorBoard itself reads them.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(files["tensorboard_dir"], size_guidance={"tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
               for tag in events.Tags()["tensors"]}
    assert all(events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
               for tag in scalars)
    for key in ("comm_bytes", "compression_ratio", "step_time_ms", "comm_error"):
        assert f"batch/{key}" in scalars and f"epoch/{key}" in scalars, key
    assert scalars["batch/comm_bytes"] == [(s, DENSE_BYTES) for s in range(1, 9)]
    assert scalars["epoch/comm_bytes_total"] == [(0, 4 * DENSE_BYTES), (1, 8 * DENSE_BYTES)]
    assert len(scalars["batch/step_time_ms"]) == 7 and len(scalars["epoch/loss"]) == 2
    assert scalars["batch/comm_error"] == [(s, 0.0) for s in range(1, 9)]
    assert all(r["comm_error"] == 0.0 for r in rows)


def test_log_keys_choose_what_reaches_the_progress_bar(tmp_path):
    path = tmp_path / "keys.jsonl"
    keys = ("comm_bytes", "comm_bytes_dense", "comm_error")
    run = _fit("fp16", {"jsonl_path": str(path), "log_keys": keys}, epochs=1)
    assert set(keys) <= set(run.history)
    assert not {"compression_ratio", "step_time_ms", "comm_bytes_total"} & set(run.history)
    assert all("compression_ratio" in r for r in _jsonl(path))   # files keep every key


def test_nan_loss_does_not_crash(tmp_path):
    path = tmp_path / "nan.jsonl"
    run = _fit("none", {"jsonl_path": str(path), "csv_path": str(tmp_path / "nan.csv")},
               epochs=1, nan=True)
    assert np.isnan(run.history["loss"][0])
    assert run.history["comm_bytes"] == [DENSE_BYTES]
    rows = _jsonl(path)                       # strict: NaN would fail to parse
    assert len(rows) == 5 and rows[-1]["loss"] is None
    assert (tmp_path / "nan.csv").exists()


class _Counters:
    """Stands in for the ops: `stats()` returns the next of the given dicts."""

    def __init__(self, *stats):
        self._stats = iter(stats)

    def stats(self):
        return next(self._stats)


def test_batches_without_a_finite_error_are_left_out_of_the_epochs_error():
    """Keras 3 skips a loss-scaled step that overflowed before any all-reduce (the ops
    see no step), and a non-finite gradient gives a NaN error: neither may count as an
    error of 0 (which halved the epoch's) or poison the epoch's mean (NaN)."""
    def at(steps, error):
        return {"steps": steps, "bytes_sent": 10 * steps, "bytes_dense": 40 * steps,
                "comm_error": error}
    meter = _common.Meter(_Counters(at(0, 0.0), at(2, 0.1), at(2, 0.1), at(3, np.nan),
                                    at(4, 0.4)))
    records = [meter.measure(0.01) for _ in range(4)]
    assert [r["steps"] for r in records] == [2, 1, 1, 1]
    assert [r["comm_bytes"] for r in records] == [10, 0, 10, 10]
    assert np.isnan(records[1]["comm_error"]) and np.isnan(records[2]["comm_error"])
    epoch = _common.summarise(records, meter.total_sent())
    assert epoch["comm_error"] == pytest.approx((2 * 0.1 + 0.4) / 3)
    assert epoch["steps"] == 5 and epoch["comm_bytes"] == pytest.approx(40 / 5)
    assert np.isnan(_common.summarise(records[1:3], 0)["comm_error"])


class _Interrupt(tf.keras.callbacks.Callback):
    """Raises at the third batch of the second epoch, as a failing job would."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2 and self.epoch == 1:
            raise RuntimeError("interrupted")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


def test_a_fit_that_raises_keeps_its_rows_and_the_monitor_starts_clean_again(tmp_path):
    """Every row is in the files as written, even when fit raises (Keras then calls no
    on_train_end); the next fit with the same monitor closes what was left open and
    writes whole new files, not rows of the old run over them."""
    ops = gs.CompressedAllReduce("fp16", algorithm="ring")
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    paths = {"jsonl_path": str(tmp_path / "run.jsonl"), "csv_path": str(tmp_path / "run.csv")}
    monitor = CommunicationMonitor(ops, **paths)
    x, y = _data()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[monitor, _Interrupt()])
    # 4 batches and an epoch row, then 3 batches of the second epoch: all on disk.
    assert [(r["kind"], r["epoch"]) for r in _jsonl(paths["jsonl_path"])] == \
        [("batch", 0)] * 4 + [("epoch", 0)] + [("batch", 1)] * 3
    with open(paths["csv_path"], encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == 8
    old = monitor._jsonl
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    assert old.closed
    gc.collect()       # an old handle flushed late would write over the new rows
    assert [(r["kind"], r["epoch"], r["step"]) for r in _jsonl(paths["jsonl_path"])] == \
        [("batch", 0, s) for s in range(1, 5)] + [("epoch", 0, 4)]
    with open(paths["csv_path"], encoding="utf-8") as f:
        assert [r["kind"] for r in csv.DictReader(f)] == ["batch"] * 4 + ["epoch"]


def test_a_strategy_of_one_device_is_said_to_send_nothing():
    """With one device TensorFlow never calls the cross-device ops: the monitor says so
    once, instead of rows of zeros that read as perfect compression."""
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(DEVICES[:1], cross_device_ops=ops)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    x, y = _data()
    with pytest.warns(UserWarning, match=r"no gradients went through CompressedAllReduce\(Float16"
                                         r".*a strategy of one device") as caught:
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                  callbacks=[CommunicationMonitor(ops)])
    assert sum("no gradients went through" in str(w.message) for w in caught) == 1
    assert ops.stats()["steps"] == 0


def test_steps_per_execution_gives_per_step_bytes(tmp_path):
    path = tmp_path / "spe.jsonl"
    run = _fit("fp16", {"jsonl_path": str(path)}, n=80, epochs=1, steps_per_execution=2)
    batches = [r for r in _jsonl(path) if r["kind"] == "batch"]
    assert [r["steps"] for r in batches] == [2, 2, 1]            # 5 steps in executions of 2
    assert [r["step"] for r in batches] == [2, 4, 5]
    assert all(r["comm_bytes"] == EXPECTED["fp16"] for r in batches)
    assert run.history["comm_bytes_total"] == [5 * EXPECTED["fp16"]]
    assert "samples_per_sec" not in run.history, "batch size unknown to fit callbacks"


@pytest.mark.parametrize("tf_config,chief", [
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 0}}, True),
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}, True),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, False),
    ({"cluster": {"worker": ["a:1"], "evaluator": ["c:1"]}, "task": {"type": "evaluator", "index": 0}}, False),
    ({}, True),
])
def test_chief_from_tf_config(monkeypatch, tf_config, chief):
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert is_chief(types.SimpleNamespace(cluster_resolver=resolver)) is chief


def test_mirrored_is_chief_and_only_the_chief_writes(tmp_path):
    assert is_chief(tf.distribute.MirroredStrategy(DEVICES[:2])) and is_chief(None)
    ops = gs.CompressedAllReduce("none", algorithm="ring")
    worker1 = types.SimpleNamespace(
        extended=types.SimpleNamespace(_cross_device_ops=ops),
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(
            task_type="worker", task_id=1))
    files = {"jsonl_path": str(tmp_path / "w1.jsonl"), "csv_path": str(tmp_path / "w1.csv"),
             "tensorboard_dir": str(tmp_path / "tb")}
    run = _fit(ops, dict(files, target=worker1), epochs=1)
    assert not run.monitor.is_chief
    assert run.history["comm_bytes"] == [DENSE_BYTES], "non-chiefs still log to Keras"
    assert os.listdir(tmp_path) == []


def test_rejects_a_folder_for_a_file_and_a_string_for_log_keys(tmp_path):
    ops = gs.CompressedAllReduce("fp16")
    with pytest.raises(ValueError, match=r"jsonl_path='.*' is a folder; give a file path"):
        CommunicationMonitor(ops, jsonl_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"csv_path='.*' is a folder"):
        CommunicationMonitor(ops, csv_path=tmp_path)
    with pytest.raises(ValueError, match=r"jsonl_path='.*' is a folder"):
        StepMonitor(ops, jsonl_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"log_keys must be a list of key names, got the string "
                                         r"'comm_bytes' \(one: \['comm_bytes'\]\)"):
        CommunicationMonitor(ops, log_keys="comm_bytes")
    CommunicationMonitor(ops, tensorboard_dir=str(tmp_path))     # a folder, as it should be


def test_rejects_what_is_not_compressed_all_reduce():
    with pytest.raises(ValueError, match="ReductionToOneDevice"):
        CommunicationMonitor(tf.distribute.MirroredStrategy(
            DEVICES[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    with pytest.raises(ValueError, match="'fp16'"):
        StepMonitor("fp16")


def test_step_monitor_in_custom_loop(tmp_path):
    ops = gs.CompressedAllReduce("fp16", algorithm="ring")
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=ops)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4)])
        opt = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(x, y):
        def fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return strategy.experimental_local_results(strategy.run(fn, (x, y)))[0]

    x, y = _data(16)
    path = tmp_path / "loop.jsonl"
    with StepMonitor(strategy, jsonl_path=str(path)) as monitor:
        for _ in range(3):
            with monitor.step(batch_size=16) as rec:
                rec["loss"] = train_step(x, y)
        summary = monitor.end_epoch()
    assert [r["comm_bytes"] for r in monitor.records] == [EXPECTED["fp16"]] * 3
    assert monitor.records[0]["step_time_ms"] is None
    assert monitor.records[2]["samples_per_sec"] > 0 and monitor.records[2]["loss"] > 0
    assert summary["comm_bytes_total"] == 3 * EXPECTED["fp16"] == ops.stats()["bytes_sent"]
    rows = _jsonl(path)
    assert [r["kind"] for r in rows] == ["batch"] * 3 + ["epoch"]
    assert rows[1]["compression_ratio"] == 2.0


def _env(**extra):
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, **extra)


def test_report_cli_plots_and_summarises_two_runs(runs, tmp_path):
    out = tmp_path / "report.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_gradsync.report", runs["none"].files["jsonl_path"],
         runs["fp16"].files["jsonl_path"], "--out", str(out)],
        env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["run", "steps"]
    none, fp16 = (l.split() for l in lines[2:4])
    assert none[:4] == ["none", "8", "216", "1.00x"]
    assert fp16[:4] == ["fp16", "8", "108", "2.00x"]
    assert float(none[5]) == pytest.approx(runs["none"].history["loss"][-1], abs=1e-4)


def test_report_reads_a_running_jobs_file_and_refuses_the_rest_in_a_line(runs, tmp_path,
                                                                        capsys):
    """A last line cut short (a job still writing, or killed) is skipped; files it
    cannot read, a figure it cannot write and a bad window get one line each, exit 2;
    the summary is printed before the figure is drawn; a file named twice gets two
    names."""
    whole = open(runs["fp16"].files["jsonl_path"], encoding="utf-8").read()
    torn = tmp_path / "torn.jsonl"
    torn.write_text(whole + whole.splitlines()[0][:30])
    assert report.main([str(torn), "--out", str(tmp_path / "r.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:4] == ["torn", "8", "108", "2.00x"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n" + whole)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n" + whole)
    for args, message in [([str(tmp_path / "missing.jsonl")], "report: [Errno 2]"),
                          ([str(bad)], "bad.jsonl:1: not a JSON line"),
                          ([str(listed)], "list.jsonl:1: not a record (a JSON object), got list"),
                          ([str(torn), "--out", str(tmp_path)],
                           f"--out={tmp_path} is a folder; name a file"),
                          ([str(empty)], "empty.jsonl: no batch records"),
                          ([str(torn), "--out", "/no/such/dir/r.png"],
                           "--out=/no/such/dir/r.png: folder '/no/such/dir' does not exist"),
                          ([str(torn), "--smooth", "0"],
                           "--smooth must be a window of 1 or more steps, got 0")]:
        with pytest.raises(SystemExit) as e:
            report.main([*args, "--out", str(tmp_path / "r.png")] if "--out" not in args
                        else args)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main([str(torn), "--out", str(tmp_path / "r.jpgg")])
    out, err = capsys.readouterr()
    assert "torn" in out and "--out=" in err and "jpgg" in err     # the summary came first
    assert report.main([str(torn), str(torn), "--out", str(tmp_path / "r.png")]) == 0
    rows = capsys.readouterr().out.splitlines()[2:4]
    assert "torn (2)" not in rows[0] and "torn (2)" in rows[1]
    # Without an extension matplotlib writes a PNG by that name plus .png: said as written.
    assert report.main([str(torn), "--out", str(tmp_path / "plain")]) == 0
    assert f"figure: {tmp_path / 'plain.png'}" in capsys.readouterr().out
    assert (tmp_path / "plain.png").is_file()


def test_report_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'tf_gradsync\[report\]'"):
        report._pyplot()  # pylint: disable=protected-access


def test_tf_keras_fit_with_monitor_in_subprocess(tmp_path):
    script = """
        import json, sys
        import numpy as np
        import tensorflow as tf
        import tf_keras
        import tf_gradsync as gs
        from tf_gradsync.callbacks import CommunicationMonitor
        assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras"), tf.keras
        devices = gs.logical_cpus(4)
        ops = gs.CompressedAllReduce("none", algorithm="ring")
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(4)])
            model.compile(tf_keras.optimizers.SGD(0.01), "mse", steps_per_execution=2)
        x = np.ones((64, 8), np.float32)
        monitor = CommunicationMonitor(ops, jsonl_path=sys.argv[1], batch_size=16)
        h = model.fit(x, x[:, :4], batch_size=16, epochs=2, verbose=0, callbacks=[monitor])
        print("RESULT", json.dumps(h.history))
    """
    path = tmp_path / "legacy.jsonl"
    stdout = _tf_keras.run(script, str(path), timeout=300)
    history = json.loads(stdout.split("RESULT ")[-1].splitlines()[0])
    assert history["comm_bytes"] == [DENSE_BYTES] * 2
    assert history["comm_bytes_total"] == [4 * DENSE_BYTES, 8 * DENSE_BYTES]
    assert all(v > 0 for v in history["samples_per_sec"])
    batches = [r for r in _jsonl(path) if r["kind"] == "batch"]
    assert [r["steps"] for r in batches] == [2] * 4
