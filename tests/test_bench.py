"""The bench: table, JSON and PNG writers, the CLI, and tiny single_host / accuracy runs."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tf_gradsync.bench import figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROWS = [
    {"mode": "stock", "numel": 10, "median_ms": 2.0, "vs_stock": 1.0, "bytes": None},
    {"mode": "none", "numel": 10, "median_ms": 2.2, "vs_stock": 1.1, "bytes": 60},
    {"mode": "none", "numel": 20, "median_ms": 3.0, "vs_stock": 1.5, "bytes": 120},
    {"mode": "topk", "numel": 10, "median_ms": 4.0, "vs_stock": "not reached", "bytes": 8},
]
COLS = ["mode", "numel", "median_ms", "vs_stock", "bytes"]


def bench(*args, timeout=120):
    """Runs `python -m tf_gradsync.bench ARGS` (the suites set up their own devices)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "tf_gradsync.bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("plot", [
    ("mode", "vs_stock", "step / stock"),                       # one panel
    ("mode", "median_ms", "ms", "numel"),                       # grouped by a series column
    (("mode", "median_ms", "ms"), ("mode", "bytes", "bytes")),  # two panels
    None,                                                       # first text / numeric column
])
def test_png_writer(tmp_path, plot):
    from matplotlib import image
    path = str(tmp_path / "fig.png")
    assert figure.write_png(ROWS, COLS, path, plot, title="t") == path
    width, height = png_size(path)
    assert width > 0 and height > 0 and os.path.getsize(path) > 0
    assert image.imread(path).shape[:2] == (height, width)


def test_plot_panels():
    # Fallback: "mode" is the first all-text column, "numel" the first numeric one;
    # "vs_stock" mixes numbers and text and "bytes" has a None, which is allowed.
    assert figure.panels(ROWS, COLS) == [("mode", "numel", "numel")]
    assert figure.panels(ROWS, ["mode", "vs_stock", "bytes"]) == [("mode", "bytes", "bytes")]
    with pytest.raises(ValueError, match="nope"):
        figure.panels(ROWS, COLS, ("mode", "nope", "y"))
    with pytest.raises(ValueError, match="no numeric column"):
        figure.panels([{"mode": "a"}], ["mode"])


def test_unknown_suite_is_a_usage_error():
    out = bench("nope", timeout=60)
    assert out.returncode == 1
    assert "got ['nope']" in out.stderr and "single_host" in out.stderr, out.stderr[-2000:]


def test_help_shows_every_suites_flags_and_exits_0():
    for args in (["--help"], ["micro", "-h"]):
        out = bench(*args, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        for text in ("python -m tf_gradsync.bench <suite>", "--sizes:", "--rate:", "--batch:",
                     "--accuracy_epochs:", "--json:"):
            assert text in out.stdout


def test_an_output_in_a_missing_folder_is_refused_before_the_suite_runs(tmp_path):
    missing = tmp_path / "no" / "rows.json"
    out = bench("micro", f"--json={missing}", "--sizes=1000", "--compressors=none",
                timeout=120)
    assert out.returncode == 1
    assert f"folder {str(missing.parent)!r} does not exist" in out.stderr, out.stderr[-2000:]
    assert "[bench] micro" not in out.stderr     # nothing was measured


def test_an_output_is_written_whole_or_not_at_all(tmp_path):
    """A write that fails (a full disk) leaves the file as it was and exits naming the
    flag; one that succeeds replaces it, with the permissions `open` gives, and leaves
    no temporary file."""
    from tf_gradsync.bench.__main__ import write_json, written
    path = tmp_path / "rows.json"
    path.write_text('[{"old": 1}]')
    with pytest.raises(SystemExit, match=r"--json=.*rows.json could not be written \(No space "
                                         r"left on device\); the table above holds the results"):
        with written("json", str(path)) as tmp:
            with open(tmp, "w") as f:
                f.write('[{"new"')
            raise OSError(28, "No space left on device")
    assert json.loads(path.read_text()) == [{"old": 1}]
    assert os.listdir(tmp_path) == ["rows.json"]
    write_json("json", str(path), [{"new": 2}])
    assert json.loads(path.read_text()) == [{"new": 2}]
    assert os.listdir(tmp_path) == ["rows.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    # A device is written as it is, never replaced by a file.
    with pytest.raises(SystemExit, match=r"--json=/dev/full could not be written"):
        write_json("json", "/dev/full", [{"new": 2}] * 10_000)
    assert not os.path.isfile("/dev/full")


@pytest.mark.parametrize("args,message", [
    (["micro", "--sizes=0"], "--sizes must be element counts >= 1"),
    (["micro", "--repeats=0"], "flag --repeats=0: 0 is not a positive integer"),
    (["micro", "--compressors=fp16,bogus"],
     "--compressors=bogus: unknown compressor 'bogus'; valid names:"),
    (["micro", "--compressors=topk:exchange=gather"], "micro times the compressor alone; "
                                                       "exchange in 'topk:exchange=gather'"),
    (["micro", "--micro_jit_compile=maybe"], "--micro_jit_compile takes true and/or false"),
    (["passes", "--passes_shape=16"], "--passes_shape must be a kernel's two dimensions"),
    (["single_host", "--rounds=0"], "flag --rounds=0: 0 is not a positive integer"),
    (["multiworker", "--batch=0"], "flag --batch=0: 0 is not a positive integer"),
    (["cluster", "--rematch=-1"], "flag --rematch=-1: -1 is not a non-negative integer"),
    (["single_host", "--stock_ops=r1d,bogus"], "--stock_ops has bogus; valid: r1d, default, hier"),
    (["single_host", "--global_batch=6"], "--global_batch=6 does not split over the 4 replicas"),
    (["accuracy", "--models=mlp,nosuch"], "unknown models or optimizers ['nosuch']; valid models:"),
    (["accuracy", "--optimizers=bogus"], "unknown models or optimizers ['bogus']"),
    (["accuracy", "--accuracy_seeds=0,x"], "--accuracy_seeds takes integers; got 0,x"),
    (["accuracy", "--target_accuracy=2"], "--target_accuracy is a test accuracy in (0, 1], got 2"),
])
def test_bad_flags_are_refused_before_anything_is_measured(args, message):
    out = bench(*args, timeout=120)
    assert out.returncode == 1
    assert message in out.stderr, out.stderr[-2000:]
    assert "[bench] micro" not in out.stderr and "Traceback" not in out.stderr


def test_micro_takes_a_compressors_settings():
    from tf_gradsync.bench import micro     # defines absl flags
    row = micro.measure("topk:ratio=0.1", 1000, repeats=1)
    # Labelled as given: two settings of one compressor stay apart in tables and figures.
    assert row["compressor"] == "topk:ratio=0.1" and row["ratio"] == pytest.approx(5, rel=0.01)


def test_a_train_step_under_tensorflows_own_ops_makes_its_slots_first():
    """SGD's momentum slots are made before the step traces: made inside it, under
    MirroredStrategy's own ops, they fed a placeholder nothing fills (the synthetic
    benchmark's stock baseline failed on one host). In a fresh interpreter: TensorFlow's
    own collectives there keep process-wide keys that would clash with other tests'."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf, tf_gradsync as gs
        from tf_gradsync.bench import models
        strategy = tf.distribute.MirroredStrategy(gs.logical_cpus(2))
        with strategy.scope():
            work = models.build("dense", 4, params=4096)
            opt = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        before = [v.numpy().copy() for v in work.model.trainable_variables]
        step = work.train_step(strategy, opt)
        losses = [float(step()), float(step())]
        moved = any(not np.array_equal(b, v.numpy())
                    for b, v in zip(before, work.model.trainable_variables))
        print("RESULT", all(np.isfinite(losses)), moved)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2"),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True True" in out.stdout


def test_examples_refuse_bad_flags_before_training():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3")
    for script, args, message in [
            ("train_digits.py", ["--batch_size=6"], "--batch_size must be a multiple of "
                                                    "--devices"),
            ("train_digits.py", ["--learning_rate=-1"], "--learning_rate must be > 0"),
            ("train_digits.py", ["--config=/no/such.yaml"], "--config: no such file"),
            ("custom_loop_digits.py", ["--batch_size=2000"], "at most 1437, the training images"),
            ("monitor_digits.py", ["--devices=3"], "--batch_size must be a multiple of "),
            ("monitor_digits.py", ["--epochs=0"], "flag --epochs=0: 0 is not a positive"),
            ("synthetic_benchmark.py", ["--steps=0"], "flag --steps=0: 0 is not a positive"),
            # Compressors named, set and checked against the optimizer before training.
            ("train_digits.py", ["--compression=topkk"],
             "--compression=topkk: unknown compressor 'topkk'; valid names: adaptive"),
            ("train_digits.py", ["--compression=topk:rato=1"],
             "compressor 'topk' got unknown arguments ['rato']; valid arguments: ['ratio']"),
            ("train_digits.py", ["--config=configs/dgc.yaml"],
             "the optimizer Adam applies beta_1=0.9 again"),
            ("monitor_digits.py", ["--compression=dgc"], "this example trains with Adam"),
            ("custom_loop_digits.py", ["--compression=zz"], "--compression=zz: unknown"),
            ("multiworker_digits.py", ["--compression_options={ratio:0.1}"],
             "--compression_options must be a JSON object"),
            ("multiworker_digits.py", ["--compression=topk", '--compression_options={"r": 1}'],
             "compressor 'topk' got unknown arguments ['r']"),
            ("multiworker_digits.py", ["--compression=dgc"], "model.fit trains with Adam")]:
        out = subprocess.run([sys.executable, os.path.join(root, "examples", script), *args],
                             env=env, capture_output=True, text=True, timeout=120, cwd=root)
        assert out.returncode == 1 and message in out.stderr, (script, out.stderr[-2000:])


def test_examples_take_a_compressor_with_its_settings():
    import train_digits  # examples/train_digits.py
    import tf_gradsync as gs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ops = train_digits.compressed_ops("topk:ratio=0.05:bucket_bytes=65536")
    assert ops.bucket_bytes == 65536 and "TopK(ratio=0.05)" in repr(ops.compressor)
    preset = os.path.join(root, "configs", "fp16.yaml")
    assert repr(train_digits.compressed_ops(config=preset).compressor) == repr(
        gs.load_config(preset).compressor)


def test_table_format():
    # Imported here, not at module level: the bench's modules define absl flags.
    from tf_gradsync.bench.__main__ import table
    assert table(ROWS[:2], ["mode", "median_ms", "bytes"]).splitlines() == [
        "| mode | median_ms | bytes |", "|---|---|---|",
        "| stock | 2 |  |", "| none | 2.2 | 60 |"]


def test_single_host_tiny_run(tmp_path):
    out = bench("single_host", "--stock_ops=r1d", "--compressors=none", "--width=32",
                "--layers=1", "--global_batch=8", "--rounds=1", "--steps_per_round=2",
                f"--json={tmp_path / 'r.json'}", f"--png={tmp_path / 'r.png'}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["mode"] for r in rows] == ["stock_r1d", "none"]
    # Dense(32) on 32 inputs, then Dense(10): weights and biases.
    params = 32 * 32 + 32 + 32 * 10 + 10
    assert all(r["params"] == params for r in rows)
    # `none` sends one float32 bucket with halving-doubling over 4 devices (the bucket
    # is below 256 KiB): 2(N-1)/N of it per replica.
    n = 4
    assert rows[1]["bytes_per_step"] == 2 * (n - 1) * params * 4 // n
    assert rows[1]["ratio"] == 1.0
    assert rows[0]["bytes_per_step"] is None and rows[0]["vs_r1d"] == 1.0
    assert rows[1]["vs_r1d"] == pytest.approx(rows[1]["median_ms"] / rows[0]["median_ms"])
    assert "| none | 1386 |" in out.stdout
    assert png_size(tmp_path / "r.png")[0] > 0


def test_time_to_target():
    from tf_gradsync import bench
    from tf_gradsync.bench import accuracy
    assert accuracy.time_to_target([0.5, 0.95, 0.97], [2.0, 3.0, 4.0], 0.95) == (2, 3.0)
    assert accuracy.time_to_target([0.5, 0.9], [2.0, 3.0], 0.95) == ("not reached",) * 2
    assert bench.ops_from_spec("topk:ratio=0.25").compressor.inner.ratio == 0.25
    plain = bench.ops_from_spec("sign:error_feedback=false:block=8").compressor
    assert plain.name == "sign" and plain.block == 8
    assert not bench.ops_from_spec("powersgd:error_feedback=false").compressor.error_feedback
    with pytest.raises(ValueError, match="rank16"):
        bench.ops_from_spec("powersgd:rank16")


def test_a_spec_takes_exponents_and_a_key_once():
    """`1e-3` is a number (YAML 1.1 wants a dot); a key given twice is refused (the last
    one won)."""
    from tf_gradsync import bench
    assert bench.split_spec("topk:ratio=1e-3:k=1E+2") == ("topk", {"ratio": 1e-3, "k": 100.0}, {})
    assert bench.ops_from_spec("topk:ratio=2.5e-2").compressor.inner.ratio == 0.025
    with pytest.raises(ValueError, match=r"ratio is given twice in 'topk:ratio=0.1:ratio=0.2'"):
        bench.split_spec("topk:ratio=0.1:ratio=0.2")


def test_recipe_overrides():
    from tf_gradsync.bench import accuracy
    assert accuracy.recipe_of("sgdm") == accuracy.RECIPES["sgdm"] == ("sgd", 0.05, 0.9)
    assert accuracy.recipe_of("sgdm:lr=0.025") == ("sgd", 0.025, 0.9)
    assert accuracy.recipe_of("sgd:lr=0.5:momentum=0.5") == ("sgd", 0.5, 0.5)
    assert accuracy.recipe_of("adam:momentum=0") == ("adam", 1e-3, 0.0)   # beta_1
    with pytest.raises(ValueError, match="'rmsprop'.*valid: adam, sgdm, sgd"):
        accuracy.recipe_of("rmsprop")
    with pytest.raises(ValueError, match="'beta=0.9'.*lr=X or momentum=Y"):
        accuracy.recipe_of("adam:beta=0.9")
    with pytest.raises(ValueError, match="'lr=-1'"):
        accuracy.recipe_of("sgd:lr=-1")
    with pytest.raises(ValueError, match="'lr=fast'"):
        accuracy.compare(["none"], ["/cpu:0"], 1, 0.0, recipes=["sgd:lr=fast"])


def test_accuracy_tiny_run(devices):
    from tf_gradsync.bench import accuracy
    rows = accuracy.compare(["stock", "fp16"], devices, epochs=2, target=0.0, models=["mlp"],
                            recipes=["adam"])
    for r in rows:
        assert set(accuracy.COLUMNS) <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["accuracies"]) == 2
        assert r["accuracy"] == r["accuracies"][-1]
        # Target 0 is reached after the first epoch.
        assert r["epochs_to_target"] == 1 and 0 < r["seconds_to_target"] <= r["train_s"]
        assert r["vs_none_pts"] is None
    stock, fp16 = rows
    assert stock["vs_stock_pts"] == 0.0
    assert fp16["vs_stock_pts"] == pytest.approx(100 * (fp16["accuracy"] - stock["accuracy"]))
    # 17,226 float32 parameters as float16 over 4 replicas: 2(N-1)/N x 2 bytes each.
    assert stock["bytes_per_step"] is None
    assert fp16["bytes_per_step"] == 2 * 3 * 17_226 * 2 // 4 and fp16["ratio"] == 2.0
    assert stock["comm_error"] is None and 0 < fp16["comm_error"] < 1e-3   # float16 rounding
    assert (fp16["model"], fp16["optimizer"], fp16["note"]) == ("mlp", "adam", "")
    with pytest.raises(ValueError, match="'vgg'.*valid models: mlp, cnn, resnet"):
        accuracy.compare(["none"], devices, 1, 0.0, models=["vgg"])


# resnet50 (a 25M-weight graph, 40 s here) runs in the cluster benchmark instead.
@pytest.mark.parametrize("name", ["dense", "mlp", "transformer"])
def test_bench_models_train_a_step_through_the_ops(devices, name):
    import tensorflow as tf
    import tf_gradsync as gs
    from tf_gradsync.bench import models
    ops = gs.CompressedAllReduce("fp16")
    strategy = tf.distribute.MirroredStrategy(devices[:2], cross_device_ops=ops)
    sizes = {"dense": {"params": 400}, "mlp": {"params": 400},
             "transformer": {"seq_len": 8, "vocab": 50},
             "resnet50": {"image_size": 32}}
    with strategy.scope():
        work = models.build(name, 2, **sizes[name])
        opt = tf.keras.optimizers.SGD(0.01)
    before = [w.copy() for w in work.model.get_weights()]
    loss = float(work.train_step(strategy, opt)())
    assert np.isfinite(loss)
    assert any(not np.array_equal(a, b) for a, b in zip(before, work.model.get_weights()))
    assert ops.stats()["steps"] == 1 and ops.stats()["compression_ratio"] == pytest.approx(
        2.0, rel=0.01)
    assert work.unit == {"dense": "examples", "mlp": "examples", "transformer": "tokens",
                         "resnet50": "images"}[name]
    if name == "mlp":   # four square layers of 10 x 10
        assert [w.shape for w in work.model.trainable_weights] == [(10, 10), (10,)] * 4


def test_accuracy_cell_refused_by_the_compressor(devices):
    """dgc refuses Adam (its first moment compounds with dgc's momentum): the cell says
    so instead of training; under SGD with momentum the momentum moves into dgc."""
    from tf_gradsync.bench import accuracy, digits
    data = digits.load_data(0)
    row = accuracy.train_cell("mlp", "adam", "dgc", devices, data, 1, 0.5)
    assert row["accuracy"] is None and row["note"].startswith("refused: dgc applies momentum")
    row = accuracy.train_cell("mlp", "sgdm", "dgc", devices, data, 2, 0.5)
    assert row["accuracy"] > 0.5 and row["note"] == "momentum 0 (adapt_optimizer)"
    plain = accuracy.train_cell("mlp", "sgdm", "dgc", devices, data, 2, 0.5, adapt=False)
    assert plain["note"].startswith("optimizer momentum 0")
    assert plain["accuracies"] == row["accuracies"]       # the same optimizer either way
    table = accuracy.matrix_table([dict(row, mode="none", vs_none_pts=0.0), dict(
        accuracy._refused("mlp", "sgdm", "dgc", "no: because"), vs_none_pts=None)])
    assert "| dgc | refused |" in table


def test_timeline_tiny_run(tmp_path):
    out = bench("timeline", "--compressors=none:bucket_bytes=1,none", "--width=32",
                "--layers=2", "--global_batch=8", "--timeline_steps=2",
                f"--json={tmp_path / 't.json'}", f"--timeline_png={tmp_path / 't.png'}",
                timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [r["mode"] for r in rows] == ["none:bucket_bytes=1", "none"]
    # Two hidden Dense layers and the head: six tensors, one bucket each, or one bucket.
    assert [r["buckets"] for r in rows] == [6, 1]
    for r in rows:
        assert 0 < r["backprop_end_ms"] <= r["step_ms"]
        assert 0 < r["exchange_ms"] <= r["step_ms"] and 0 <= r["hidden_ms"] <= r["exchange_ms"]
        assert 0 <= r["hidden_share"] <= 1 and r["first_exchange_ms"] < r["step_ms"]
    assert png_size(tmp_path / "t.png")[1] > 0


def test_timeline_kinds_and_overlap_arithmetic():
    from tf_gradsync.bench import timeline as T
    assert T.kind_of("gradient_tape/replica_1/dense/MatMul/MatMul_1:MatMul") == "backward"
    assert T.kind_of("sgd_1/gradsync/bucket_12/rounds/ring/add:AddV2") == "bucket 12"
    assert T.kind_of("sgd_1/gradsync/pack/concat:ConcatV2") == "pack/unpack"
    assert T.kind_of("sgd_1/update_0_4/AssignSubVariableOp:AssignSubVariableOp") == "update"
    assert T.kind_of("replica_1/sequential/dense/Relu:_FusedMatMul") == "forward"
    assert T.kind_of("ExecutorState::Process") is None and T.kind_of("step") is None
    assert T.kind_of("EagerLocalExecute: __inference_step_713") is None
    assert T.union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert T.union_length([(0, 2), (1, 3), (5, 6)], until=1.5) == 1.5
    ops = [T.Op(0.0, 1.0, "forward", "f"), T.Op(1.0, 4.0, "backward", "b"),
           T.Op(2.0, 3.0, "bucket 0", "x"), T.Op(2.5, 5.0, "bucket 1", "y")]
    s = T.summarize(ops)
    assert s == {"step": 5.0, "backprop_end": 4.0, "first_exchange": 2.0, "exchange": 3.0,
                 "hidden": 2.0}


def test_passes_counts_the_data_path_from_the_graph(devices):
    """none: a concat and a split per replica to pack and unpack (4 bytes per byte), the
    tree's split, half-chunk add and concat; exact, so no error terms. fp16 adds casts
    and the error measurement, which `measure_error=False` removes."""
    from tf_gradsync.bench import passes as P
    def count(spec, **kwargs):
        return P.count(spec, (64, 30), devices=devices[:2], **kwargs)
    none = count("none")
    assert none["packing"] == pytest.approx(4.0, rel=0.01)
    assert none["total"] == pytest.approx(none["packing"] + 5.5, rel=0.01)
    assert count("none", measure_error=False) == none
    fp16, fp16_off = count("fp16"), count("fp16", measure_error=False)
    assert fp16["total"] > fp16_off["total"] > none["total"]
    assert fp16["unknown"] == 0


@pytest.mark.parametrize("spec", ["powersgd:start_iter=0", "dgc"])
def test_passes_the_error_costs_one_read_of_what_was_compressed(devices, spec):
    """The error's norm is one read (a byte per byte of gradient), and the reset after
    a non-finite step costs nothing apart: without the error, PowerSGD reads finiteness
    from its factors, not M's norm; with it, DGC reads it from v's norm, not v's sum."""
    from tf_gradsync.bench import passes as P
    on, off = (P.count(spec, (64, 30), devices=devices[:2], measure_error=m)
               for m in (True, False))
    assert on["total"] - off["total"] == pytest.approx(1.0, abs=0.05)


def test_mean_over_seeds():
    from tf_gradsync.bench import accuracy
    runs = [{"seed": s, "accuracy": c[-1], "accuracies": c, "at_epoch": t, "train_s": t[-1],
             "bytes_per_step": b, "ratio": 4.0, "comm_error": e, "epochs_to_target": None}
            for s, c, t, b, e in ((0, [0.80, 0.90, 0.96], [1.0, 2.0, 3.0], 100, 0.1),
                                  (1, [0.90, 0.96, 0.98], [2.0, 3.0, 5.0], 100, 0.3))]
    row = accuracy.mean_row(runs, target=0.95)
    assert row["accuracy"] == pytest.approx(0.97) and row["seed_accuracies"] == [0.96, 0.98]
    assert row["accuracies"] == pytest.approx([0.85, 0.93, 0.97])
    assert row["accuracy_std"] == pytest.approx(0.01) and row["seeds"] == [0, 1]
    # Time to target from the mean curve: 0.95 is first reached at epoch 3, at 4.0 s.
    assert (row["epochs_to_target"], row["seconds_to_target"]) == (3, 4.0)
    assert row["comm_error"] == pytest.approx(0.2) and "seed" not in row
    assert accuracy.mean_row(runs[:1], 0.95) is runs[0]


def test_the_accuracy_suites_digits_come_with_the_package(monkeypatch):
    """The suite's data and models are the package's own (it runs where the package is
    installed, without the examples); without scikit-learn the error says what to
    install."""
    from tf_gradsync.bench import accuracy, digits
    assert os.path.dirname(digits.__file__) == os.path.dirname(accuracy.__file__)
    assert accuracy.digits is digits
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)   # import fails
    with pytest.raises(ImportError, match=r"scikit-learn.*tf_gradsync\[bench\]"):
        digits.load_data(0)


def test_accuracy_seeds(devices):
    from tf_gradsync.bench import accuracy, digits
    data = digits.load_data(accuracy.SEED)
    one = [accuracy.train_cell("mlp", "sgd", "none", devices, data, 1, 0.0, seed=s)
           for s in (0, 1)]
    assert one[0]["accuracy"] != one[1]["accuracy"]     # the seed sets the initial weights
    both = accuracy.compare(["none"], devices, 1, 0.0, recipes=["sgd"], seeds=(0, 1))[0]
    assert both["seed_accuracies"] == [r["accuracy"] for r in one]
    assert both["accuracy"] == pytest.approx(np.mean(both["seed_accuracies"]))


@pytest.mark.parametrize("name", ["sign", "topk", "fp16"])
def test_micro_times_codecs_compiled_and_not_on_the_same_payload(name):
    from tf_gradsync.bench import micro
    rows = [micro.measure(name, 1 << 14, 1, jit) for jit in (True, False)]
    rows.append(micro.measure(name, 1 << 14, 1, True, data_path=True))
    assert [(r["jit_compile"], r["data_path"]) for r in rows] == [
        (True, False), (False, False), (True, True)]
    assert rows[0]["payload_bytes"] == rows[1]["payload_bytes"] == rows[2]["payload_bytes"] > 0
    assert all(r["gb_per_s"] > 0 and r["ratio"] == (1 << 16) / r["payload_bytes"]
               and r["ms"] == r["seconds"] * 1e3 for r in rows)


def test_micro_tiny_run_has_the_copy_it_is_compared_with(tmp_path):
    out = bench("micro", "--compressors=sign,topk", "--sizes=4096", "--repeats=1",
                f"--json={tmp_path / 'm.json'}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "m.json").read_text())
    assert [r["compressor"] for r in rows] == ["copy", "sign", "topk"]
    copy = rows[0]["gb_per_s"]
    assert copy > 0 and rows[0]["of_copy"] == 1.0
    assert all(r["of_copy"] == pytest.approx(r["gb_per_s"] / copy) for r in rows[1:])


@pytest.mark.parametrize("keep", [True, False])
def test_keep_freed_buffers_keeps_a_freed_buffer_in_the_process(keep):
    """With `keep_freed_buffers`, glibc keeps a freed 128 MB buffer (reused by the next
    allocation); by default it hands it back to the kernel."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from tf_gradsync.bench import keep_freed_buffers
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        if sys.argv[1] == "1":
            assert keep_freed_buffers()
        a = np.ones(1 << 24)
        before = rss()
        del a
        print(before - rss())
        """)
    out = subprocess.run([sys.executable, "-c", code, "1" if keep else "0"], check=True,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.getcwd())).stdout
    returned = int(out.split()[-1])
    if keep:
        assert returned < (8 << 20)
    else:
        assert returned > (100 << 20)
