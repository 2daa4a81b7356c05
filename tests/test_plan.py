"""`python -m tf_gradsync.plan`: rows priced by the cost model, from the command line."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from tf_gradsync import _tf_compat, costmodel, plan
from tf_gradsync.algorithms.cost import Link, parse_bandwidth
from tf_gradsync.bench import ops_from_spec
from tf_gradsync.config import DEFAULT_BUCKET_BYTES

KEYS = {"compressor", "exchange", "bytes_per_worker", "predicted_step_s", "predicted_speedup"}


def _cli(*args, timeout=300, cwd=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tf_gradsync.plan", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def test_rows_are_the_cost_models_predictions():
    specs = plan.gradients_of(None, 1_000_000)[0]
    rows = plan.plan(specs, ["fp16", "topk", "powersgd"], [2, 8], ["100mbit", "10gbit"], 0.05)
    assert len(rows) == 2 * 2 * (2 + 2 + 2)         # (workers, rate) x exchanges
    for r in rows:
        assert KEYS <= set(r)
        link = Link(50e-6, parse_bandwidth(r["bandwidth"]))
        compressor = ops_from_spec(r["compressor"]).compressor
        p = costmodel.predict(compressor, costmodel.model_payloads(compressor, specs, 32 << 20,
                                                                   r["workers"]),
                              r["exchange"], r["workers"], link, 0.05)
        assert r["predicted_step_s"] == pytest.approx(p.step_s)
        assert r["bytes_per_worker"] == round(p.bytes_per_worker)
    slow = [r for r in rows if r["bandwidth"] == "100mbit" and r["workers"] == 8]
    assert max(r["predicted_speedup"] for r in slow) > 10   # 4 MB at 100 Mbit/s, 8 workers
    # Two phases send less than the gather at 8 workers.
    topk = {r["exchange"]: r for r in slow if r["compressor"] == "topk"}
    assert topk["two_phase"]["bytes_per_worker"] < topk["gather"]["bytes_per_worker"]


def test_a_specs_own_ops_settings_are_priced_as_they_run():
    """Settings of the ops in a spec price what those ops would run: a pinned exchange
    is the only row, a bucket size plans the payloads, and a guard (which cannot cut a
    bucket into chunks) travels gathered, its inner compressor's payload and the
    guard's own error terms."""
    specs = plan.gradients_of(None, 1_000_000)[0]
    rows = plan.plan(specs, ["topk", "topk:exchange=two_phase", "topk:bucket_bytes=65536",
                             "topk:guard=true"], [8], ["1gbit"], 0.05)
    by = {(r["compressor"], r["exchange"]): r for r in rows}
    assert set(by) == {("topk", "gather"), ("topk", "two_phase"),
                       ("topk:exchange=two_phase", "two_phase"),
                       ("topk:bucket_bytes=65536", "gather"),
                       ("topk:bucket_bytes=65536", "two_phase"), ("topk:guard=true", "gather")}
    assert by["topk:exchange=two_phase", "two_phase"] == dict(
        by["topk", "two_phase"], compressor="topk:exchange=two_phase")
    link = Link(50e-6, parse_bandwidth("1gbit"))
    for spec, bucket_bytes in (("topk:bucket_bytes=65536", 65536),
                               ("topk:guard=true", DEFAULT_BUCKET_BYTES)):
        compressor = ops_from_spec(spec).compressor
        p = costmodel.predict(compressor, costmodel.model_payloads(compressor, specs,
                                                                   bucket_bytes, 8),
                              "gather", 8, link, 0.05)
        assert by[spec, "gather"]["predicted_step_s"] == pytest.approx(p.step_s)
    # Smaller buckets: more messages, the same entries.
    assert (by["topk:bucket_bytes=65536", "gather"]["predicted_step_s"]
            > by["topk", "gather"]["predicted_step_s"])
    guarded = by["topk:guard=true", "gather"]["bytes_per_worker"]
    assert 0 < guarded - by["topk", "gather"]["bytes_per_worker"] < 100


def test_several_devices_per_worker_price_what_the_job_runs():
    specs = plan.gradients_of(None, 1_000_000)[0]
    local = Link(10e-6, parse_bandwidth("100gbit"))
    rows = plan.plan(specs, ["fp16", "topk"], [1, 2], ["1gbit"], 0.05, devices=4,
                     local_link=local)
    assert all(r["devices_per_worker"] == 4 for r in rows)
    # One worker's devices are the members, on the link between them.
    alone = plan.plan(specs, ["fp16", "topk"], [4], ["100gbit"], 0.05, latency_s=10e-6)
    one = [r for r in rows if r["workers"] == 1]
    assert [(r["compressor"], r["exchange"]) for r in one] == [
        (r["compressor"], r["exchange"]) for r in alone]
    for a, b in zip(one, alone):
        assert a["predicted_step_s"] == pytest.approx(b["predicted_step_s"])
    # Between workers, sums go hierarchically: one ring's bytes per worker.
    two = {(r["compressor"], r["exchange"]): r for r in rows if r["workers"] == 2}
    assert set(two) == {("fp16", "hierarchical"), ("topk", "gather"), ("topk", "two_phase")}
    fp16 = costmodel.model_payloads("fp16", specs, DEFAULT_BUCKET_BYTES, 8)
    assert two["fp16", "hierarchical"]["bytes_per_worker"] == round(
        sum(b.rounds[0][1] for b in fp16))
    with pytest.raises(ValueError, match="devices per worker must be an integer >= 1, got 0"):
        plan.plan(specs, ["fp16"], [2], ["1gbit"], 0.05, devices=0)


def test_calibration_measures_each_data_path_and_its_cost_per_call():
    rates, calls = plan.calibrate_codecs(["none", "sign"], 1 << 16)
    assert rates.keys() == calls.keys() == {"none", "sign"}
    assert all(r > 0 for r in rates.values()) and all(c >= 0 for c in calls.values())
    # Priced per bucket, and per chunk in two phases.
    specs = plan.gradients_of(None, 1_000_000)[0]
    base = plan.plan(specs, ["sign"], [4], ["1gbit"], 0.01, throughput=rates)
    called = plan.plan(specs, ["sign"], [4], ["1gbit"], 0.01, throughput=rates,
                       call_s={"sign": 1e-3})
    payloads = costmodel.model_payloads(ops_from_spec("sign").compressor, specs,
                                        DEFAULT_BUCKET_BYTES, 4)
    per_exchange = {"gather": len(payloads),
                    "two_phase": sum(4 if b.chunks else 1 for b in payloads)}
    assert [r["exchange"] for r in called] == ["gather", "two_phase"]
    for b, c in zip(base, called):
        assert c["codec_s"] - b["codec_s"] == pytest.approx(per_exchange[c["exchange"]] * 1e-3)


def test_bert_large_has_its_335_million_weights():
    n = sum(math.prod(s) for s, _ in plan.bert_large_specs())
    assert 330e6 < n < 340e6


def test_a_saved_model_is_read_by_path(tmp_path):
    model = tf.keras.Sequential([tf.keras.Input((7,)), tf.keras.layers.Dense(3)])
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert plan.gradients_of(path, None)[0] == [((7, 3), tf.float32), ((3,), tf.float32)]


@pytest.mark.parametrize("name,dense", [("none", False), ("fp16", False), ("topk", False),
                                        ("sign", False), ("topk", True)])
def test_embedding_tables_are_priced_as_the_rows_they_gather(devices, tmp_path, name, dense,
                                                             capsys):
    """An Embedding's gradient is the rows it looked up, gathered as they are (fp16
    halves their values), not its table compressed: the planner's bytes per worker for
    a saved model with one equal what a step of `fit` on two replicas sends. With
    `sparse_as_dense` the table is priced, and sent, as a dense gradient."""
    def build():
        ids = tf.keras.Input((10,), dtype="int32")
        rows = tf.keras.layers.Embedding(2000, 8, name="emb")(ids)
        return tf.keras.Model(ids, tf.keras.layers.Dense(4)(tf.keras.layers.Flatten()(rows)))
    path = str(tmp_path / "rec.keras")
    build().save(path)
    specs, lookups = plan.gradients_of(path, None, batch=8)
    assert specs == [((80, 4), tf.float32), ((4,), tf.float32)]
    assert [(t.rows, t.width, t.per_example, t.table_rows, t.position)
            for t in lookups] == [(80, 8, 10, 2000, 0)]
    row = next(r for r in plan.plan(specs, [name], [2], ["1gbit"], 0.01, lookups=lookups,
                                    sparse_as_dense=dense)
               if r["compressor"] == name)
    if dense:    # the command line's flag prices the same
        out = tmp_path / "rows.json"
        plan.main(["plan", f"--model={path}", "--compute_s=0.01", f"--compressors={name}",
                   "--workers=2", "--batch=8", "--sparse_as_dense", f"--json={out}"])
        (flagged,) = [r for r in json.loads(out.read_text())
                      if (r["compressor"], r["exchange"]) == (name, row["exchange"])]
        assert flagged["bytes_per_worker"] == row["bytes_per_worker"]
        printed = capsys.readouterr().out
        assert "1 embedding tables, priced as dense gradients: --sparse_as_dense" in printed
        assert "gathered as they are" not in printed
    ops = ops_from_spec(name, sparse_as_dense=dense)
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    x = tf.random.stateless_uniform([16, 10], (1, 2), 0, 2000, tf.int32)
    model.fit(x, tf.zeros([16, 4]), batch_size=16, epochs=1, verbose=0)
    assert ops.stats()["last_bytes_sent"] == row["bytes_per_worker"]


def test_tied_frozen_and_shared_tables_are_not_priced_as_their_own_lookups():
    """A table tied to an output layer as well (`tie_weights`) gets a dense gradient and
    a frozen one none: neither is a table of looked-up rows. A table looked up by two
    calls has no one input to count its lookups from."""
    class Tied(tf.keras.layers.Embedding):
        tie_weights = True
    a, b = tf.keras.Input((3,), dtype="int32"), tf.keras.Input((5,), dtype="int32")
    shared, tied = tf.keras.layers.Embedding(50, 4), Tied(50, 4)
    frozen = tf.keras.layers.Embedding(50, 4, trainable=False)
    out = tf.keras.layers.Concatenate(axis=1)([shared(a), shared(b), tied(a), frozen(b)])
    model = tf.keras.Model([a, b], out)
    assert _tf_compat.keras_embeddings(model) == [shared]
    assert plan._lookups(shared, 8, 0).per_example is None
    single = tf.keras.layers.Embedding(50, 4)
    tf.keras.Model(a, single(a))
    assert plan._lookups(single, 8, 0).per_example == 3
    assert plan._lookups(single, 8, 0).index_dtype == tf.int32
    wide_ids = tf.keras.Input((2, 3), dtype="int64")
    wide = tf.keras.layers.Embedding(50, 4)
    tf.keras.Model(wide_ids, wide(wide_ids))
    assert (plan._lookups(wide, 8, 0).rows, plan._lookups(wide, 8, 0).index_dtype) == (48, tf.int64)


def test_a_file_keras_cannot_load_is_named_with_why(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not a model")
    with pytest.raises(SystemExit) as e:
        plan.main(["plan", f"--model={bad}", "--compute_s=1"])
    assert f"cannot load the model saved at '{bad}': " in str(e.value)


def test_custom_layers_load_once_their_module_is_imported(tmp_path):
    (tmp_path / "scale_layer.py").write_text(textwrap.dedent("""
        import keras

        @keras.saving.register_keras_serializable(package="planner_test")
        class Scale(keras.layers.Layer):
            def build(self, shape):
                self.w = self.add_weight(shape=(shape[-1],), initializer="ones")
            def call(self, x):
                return x * self.w
        """))
    script = ("import keras, scale_layer\n"
              "m = keras.Sequential([keras.Input((5,)), scale_layer.Scale(),"
              " keras.layers.Dense(2)])\n"
              "m.save('custom.keras')\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                   timeout=300)
    args = ["--model=custom.keras", "--compute_s=0.01", "--compressors=fp16"]
    without = _cli(*args, cwd=tmp_path)
    assert without.returncode == 1
    assert "plan: cannot load the model saved at 'custom.keras': " in without.stderr
    assert "--imports=module" in without.stderr
    loaded = _cli(*args, "--imports=scale_layer", cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "17 weights in 3 tensors" in loaded.stdout       # 5 + 5 * 2 + 2


def test_params_past_a_layer_limit_are_priced_as_several_layers():
    """Past 2^30 weights `--params` is several square layers, so that no tensor is past
    the sparsifiers' int32 indices; below it one layer, as before."""
    assert plan.gradients_of(None, 250_000)[0] == [((500, 500), tf.float32),
                                                   ((500,), tf.float32)]
    specs = plan.gradients_of(None, 3_000_000_000)[0]
    assert len(specs) == 6 and max(math.prod(s) for s, _ in specs) < 2**31 - 1
    assert sum(math.prod(s) for s, _ in specs) == pytest.approx(3e9, rel=1e-4)
    rows = plan.plan(specs, ["topk"], [4], ["1gbit"], 0.1)
    assert rows and all(math.isfinite(r["predicted_step_s"]) for r in rows)


def test_one_device_reduces_nothing():
    """With one worker of one device TensorFlow never calls the ops: every row is the
    compute alone, sending nothing."""
    rows = plan.plan([((1000, 100), tf.float32)], ["fp16", "topk"], [1, 2], ["1gbit"], 0.1)
    for r in rows:
        alone = r["workers"] == 1
        assert (r["predicted_step_s"] == 0.1 and r["predicted_speedup"] == 1.0
                and r["bytes_per_worker"] == 0 and r["codec_s"] == 0) == alone, r
    assert {r["workers"] for r in rows} == {1, 2}


def test_repeated_values_give_one_row_each(tmp_path, capsys):
    out = tmp_path / "rows.json"
    plan.main(["plan", "--params=10000", "--compute_s=0.1", "--compressors=fp16,fp16",
               "--workers=4,4", "--bandwidth=1gbit,1gbit", f"--json={out}"])
    rows = json.loads(out.read_text())
    assert sorted(r["exchange"] for r in rows) == ["ring", "tree"]


def test_the_command_line_prints_and_writes_rows(tmp_path):
    out = tmp_path / "plan.json"
    proc = _cli("--params=250000", "--workers=4", "--bandwidth=1gbit", "--compute_s=0.01",
                "--compressors=none,fp16,sign", f"--json={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| compressor | exchange |" in proc.stdout
    rows = json.loads(out.read_text())
    assert {(r["compressor"], r["exchange"]) for r in rows} == {
        ("none", "ring"), ("none", "tree"), ("fp16", "ring"), ("fp16", "tree"),
        ("sign", "gather"), ("sign", "two_phase")}
    assert all(KEYS <= set(r) for r in rows)
    best_none = max(r["predicted_speedup"] for r in rows if r["compressor"] == "none")
    assert best_none == pytest.approx(1.0)
    proc = _cli("--params=250000", "--workers=4", "--bandwidth=1gbit", "--compute_s=0.01",
                "--compressors=fp16,sign", "--devices_per_worker=8", "--local_bandwidth=2400gbit",
                f"--json={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 devices per worker, 2400gbit and 10 us between them" in proc.stdout
    rows = json.loads(out.read_text())
    assert {(r["compressor"], r["exchange"], r["devices_per_worker"]) for r in rows} == {
        ("fp16", "hierarchical", 8), ("sign", "gather", 8), ("sign", "two_phase", 8)}


@pytest.mark.parametrize("args,message", [
    (["--params=1000"], "give --compute_s"),
    (["--params=1000", "--compute_s=1", "--bandwidth=fast"],
     "--bandwidth: bandwidth 'fast' is not a rate"),
    (["--params=1000", "--compute_s=1", "--overlap=2"], "flag --overlap=2: 2.0 is not a number in the range [0.0, 1.0]"),
    (["--params=1000", "--compute_s=1", "--bucket_bytes=0"], "flag --bucket_bytes=0: 0 is not"),
    (["--model=nosuchnet", "--compute_s=1"], "unknown model 'nosuchnet'"),
    (["--compute_s=1"], "give exactly one of --params"),
    (["--params=1000", "--compute_s=1", "--workers=0"], "--workers must be integers >= 1"),
    (["--params=1000", "--compute_s=1", "--compressors=zip"], "unknown compressor 'zip'"),
    # Which of the list, and before a missing --compute_s.
    (["--params=1000", "--compressors=topk:ratio=1e-2,randomk:ratio=0"],
     "--compressors=randomk:ratio=0: ratio must be"),
    (["--params=1000", "--compute_s=1", "--json=/no/such/folder/rows.json"],
     "--json=/no/such/folder/rows.json: folder '/no/such/folder' does not exist"),
    (["--params=1000", "--compute_s=1", "--json=/tmp"],
     "--json=/tmp is a folder; name a file (e.g. /tmp/rows.json)"),
    (["--params=1000", "--compute_s=1", "--json=/proc/self/rows.json"],
     "--json=/proc/self/rows.json cannot be written"),
    (["--params=1000", "--compute_s=1", "--workers", "2", "8"],
     "unexpected argument(s) 8; several values go in one flag, comma-separated"),
    (["--params=1000", "--compute_s=1", "--bandwidth="], "--bandwidth needs at least one rate"),
    (["--params=1000", "--compute_s=1", "--codec_gbps=0"],
     "--codec_gbps must be a finite number > 0, got 0.0"),
    (["--params=1000", "--compute_s=1", "--codec_gbps=-1"], "--codec_gbps must be"),
    (["--params=1000", "--compute_s=inf"], "--compute_s must be a finite number > 0, got inf"),
    (["--params=1000", "--compute_s=0"], "--compute_s must be a finite number > 0, got 0.0"),
    (["--params=1000", "--compute_s=1", "--compressors="], "--compressors is empty; name them"),
    (["--params=1000", "--compute_s=1", "--compressors=fp16:exchange=gather"],
     "fp16:exchange=gather: exchange='gather' is how payloads that cannot be summed travel, but "
     "Float16(prescale=True)'s are summed"),
    (["--params=1000", "--compute_s=1", "--latency_us=-50"],
     "--latency_us must be a finite number >= 0, got -50.0"),
    (["--params=1000", "--calibrate", "--batch=0"], "--batch must be a finite number >= 1"),
    (["--model=/no/such/model.keras", "--compute_s=1"],
     "--model=/no/such/model.keras: no such file"),
    (["--params=1000", "--compute_s=1", "--imports=no_such_module_here"],
     "--imports=no_such_module_here: No module named 'no_such_module_here'"),
    (["--params=1000", "--compute_s=1", "--devices_per_worker=0"],
     "flag --devices_per_worker=0: 0 is not a positive integer"),
    (["--params=1000", "--compute_s=1", "--devices_per_worker=2", "--local_bandwidth=nvlink"],
     "--local_bandwidth: bandwidth 'nvlink' is not a rate"),
    (["--params=1000", "--compute_s=1", "--local_latency_us=-1"],
     "--local_latency_us must be a finite number >= 0, got -1.0"),
])
def test_bad_flags_say_what_is_wrong(args, message):
    with pytest.raises(SystemExit) as e:
        plan.main(["plan", *args])
    assert message in str(e.value)


def test_a_damaged_keras_file_is_named_as_such(tmp_path):
    """Keras says "File not found" of a .keras file that is there but no archive."""
    bad = tmp_path / "bad.keras"
    bad.write_bytes(b"not a zip archive")
    with pytest.raises(SystemExit) as e:
        plan.main(["plan", f"--model={bad}", "--compute_s=1"])
    assert f"--model={bad}: not a Keras archive" in str(e.value)
