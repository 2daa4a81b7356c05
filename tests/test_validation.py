"""Bad input is rejected with a message naming the bad value and what is allowed; plus
property tests of the bucket planner and of every compressor's round trip, and a scan
of the package source for code that would execute or unpickle input.

Cases already covered elsewhere are not repeated here: tests/test_config.py (preset
keys, names and values), tests/test_compressors.py (compressor argument ranges),
tests/test_cross_device_ops.py (`CompressedAllReduce` arguments), tests/test_launch.py
(launcher flags), tests/test_bucketing.py (`bucket_bytes`).
"""

import ast
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

import tf_gradsync as gs
from tf_gradsync import compression as C
from tf_gradsync import launch
from tf_gradsync.callbacks import CommunicationMonitor, StepMonitor
from tf_gradsync.strategy import check_tf_config
from _compress import roundtrip

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ", ".join(C.names())
NAN, INF = float("nan"), float("inf")
OPS = gs.CompressedAllReduce("none")


def case(label, fn, *needles):
    """One row: `fn()` must raise ValueError whose message contains every needle."""
    return pytest.param(fn, needles, id=label)


# Each row names the bad value and the allowed values or range it expects in the message.
CASES = [
    case("logical-cpus-string", lambda: gs.logical_cpus("2"), "'2'", ">= 1"),
    case("logical-cpus-float", lambda: gs.logical_cpus(2.0), "2.0", "integer"),
    # ------------------------------------------------------------ SyncConfig / presets
    case("config-source", lambda: gs.parse_config(42), "got 42", "a YAML path or a mapping"),
    case("config-bucket-bool", lambda: gs.SyncConfig(bucket_bytes=True),
         "got True", "positive integer"),
    case("config-timeout-inf", lambda: gs.SyncConfig(timeout_seconds=INF),
         "got inf", "positive, finite number of seconds"),
    case("config-timeout-bool", lambda: gs.SyncConfig(timeout_seconds=True),
         "got True", "positive, finite number of seconds"),
    case("config-ef-int", lambda: gs.SyncConfig(error_feedback=1), "got 1", "true, false or null"),
    case("config-options-list", lambda: gs.SyncConfig(compression_options=[("ratio", 1)]),
         "[('ratio', 1)]", "a mapping of argument names"),
    case("config-options-value",
         lambda: gs.SyncConfig(compression="topk", compression_options={"ratio": 2}),
         "got 2", "(0, 1]"),
    case("config-options-name",
         lambda: gs.SyncConfig(compression="qsgd", compression_options={"ratio": 0.1}),
         "['ratio']", "valid arguments: ['levels', 'chunk']"),
    case("config-algorithm", lambda: gs.load_config({"algorithm": "ringg"}),
         "'ringg'", "auto, collective, ring, tree"),
    # ------------------------------------------------------------ CompressedAllReduce
    case("ops-bucket-bool", lambda: gs.CompressedAllReduce(bucket_bytes=True),
         "got True", "positive integer"),
    case("ops-bucket-str", lambda: gs.CompressedAllReduce(bucket_bytes="32MB"),
         "'32MB'", "positive integer"),
    case("ops-algorithm-none", lambda: gs.CompressedAllReduce(algorithm=None),
         "None", "auto, collective, ring, tree"),
    case("ops-exchange", lambda: gs.CompressedAllReduce(exchange="twophase"),
         "'twophase'", "auto, gather, two_phase"),
    case("config-exchange", lambda: gs.load_config({"exchange": 2}), "2",
         "auto, gather, two_phase"),
    case("ops-exchange-summed", lambda: gs.CompressedAllReduce("fp16", exchange="gather"),
         "exchange='gather'", "Float16(prescale=True)'s are summed", "leave exchange='auto'"),
    case("ops-compression", lambda: gs.CompressedAllReduce(compression=None), "None", NAMES),
    case("ops-timeout-nan", lambda: gs.CompressedAllReduce(timeout_seconds=NAN), "nan", "positive"),
    case("ops-timeout-str", lambda: gs.CompressedAllReduce(timeout_seconds="10"), "'10'",
         "positive, finite"),
    case("ops-timeout-bool", lambda: gs.CompressedAllReduce(timeout_seconds=True), "True",
         "positive, finite"),
    case("ops-timeout-inf", lambda: gs.CompressedAllReduce(timeout_seconds=INF), "inf",
         "positive, finite"),
    case("ops-error-feedback-int", lambda: gs.CompressedAllReduce("topk", error_feedback=1),
         "got 1", "True, False or None"),
    case("ops-name", lambda: gs.CompressedAllReduce(name=5), "got 5", "string or None"),
    # ------------------------------------------------------------ compressors
    case("get-unknown", lambda: C.get("zip"), "'zip'", NAMES),
    case("get-not-a-name", lambda: C.get(3), "3", NAMES),
    case("get-unknown-argument", lambda: C.get("topk", k=5), "['k']", "['ratio']"),
    case("get-argument-for-none", lambda: C.get("bf16", ratio=0.1), "['ratio']",
         "valid arguments: none"),
    case("get-wrong-argument", lambda: C.get("fp16", ratio=0.1), "['ratio']",
         "valid arguments: ['prescale']"),
    case("get-instance-with-arguments", lambda: C.get(C.get("topk"), ratio=0.1), "'ratio'",
         "either a registered name with arguments or an instance alone"),
    case("dgc-momentum-nan", lambda: C.get("dgc", momentum=NAN), "nan", "[0, 1)"),
    case("topk-nan", lambda: C.get("topk", ratio=NAN), "nan", "(0, 1]"),
    case("topk-str", lambda: C.get("topk", ratio="0.1"), "'0.1'", "(0, 1]"),
    case("randomk-bool", lambda: C.get("randomk", ratio=True), "True", "(0, 1]"),
    case("randomk-inf", lambda: C.get("randomk", ratio=INF), "inf", "(0, 1]"),
    case("threshold-nan", lambda: C.get("threshold", sample_ratio=NAN), "nan", "(0, 1]"),
    case("qsgd-bool", lambda: C.get("qsgd", levels=True), "True", "[1, 127]"),
    case("qsgd-float", lambda: C.get("qsgd", levels=8.0), "8.0", "[1, 127]"),
    case("powersgd-rank-float", lambda: C.get("powersgd", rank=2.0), "2.0", "[1, inf)"),
    case("powersgd-rate-nan", lambda: C.get("powersgd", min_compression_rate=NAN),
         "nan", "[1, inf)"),
    case("powersgd-warm-start", lambda: C.get("powersgd", warm_start="yes"),
         "'yes'", "True or False"),
    case("dgc-warmup-float", lambda: C.get("dgc", warmup_steps=1.5), "1.5", "[0, inf)"),
    case("dgc-momentum-nan", lambda: C.get("dgc", momentum=NAN), "nan", "[0, 1"),
    case("dgc-sample-zero", lambda: C.get("dgc", sample_ratio=0), "got 0", "(0, 1]"),
    # ------------------------------------------------------------ ErrorFeedback
    case("ef-unknown", lambda: C.ErrorFeedback("zip"), "'zip'", NAMES),
    case("ef-none", lambda: C.ErrorFeedback(None), "None", NAMES),
    case("ef-round-compressor", lambda: C.ErrorFeedback("powersgd"),
         "PowerSGD(", "allowed: single-round"),
    case("ef-off-own-memory", lambda: gs.CompressedAllReduce("powersgd", error_feedback=False),
         "PowerSGD(", "error_feedback=False does not reach; leave it unset"),
    case("ef-on-own-memory", lambda: gs.CompressedAllReduce("dgc", error_feedback=True),
         "DGC(", "error_feedback=True does not reach; leave it unset"),
    case("ef-exact", lambda: gs.CompressedAllReduce("none", error_feedback=True),
         "NoCompression", "no error to feed back; leave error_feedback unset"),
    case("spec-string", lambda: gs.CompressedAllReduce("topk:ratio=0.1"), "'topk:ratio=0.1'",
         "compression.get('topk', key=value, ...)"),
    # ------------------------------------------------------------ plan_buckets
    case("plan-bucket-bool", lambda: gs.plan_buckets([((2,), tf.float32)], True),
         "got True", "positive integer"),
    case("plan-bucket-str", lambda: gs.plan_buckets([((2,), tf.float32)], "64"),
         "'64'", "positive integer"),
    case("plan-specs-none", lambda: gs.plan_buckets(None, 64),
         "got None", "list of (shape, dtype) pairs"),
    case("plan-not-pair", lambda: gs.plan_buckets([(2,)], 64), "(2,)", "(shape, dtype) pair"),
    case("plan-dtype-unknown", lambda: gs.plan_buckets([((2,), "float17")], 64),
         "'float17'", "numeric TensorFlow dtype"),
    case("plan-dtype-string", lambda: gs.plan_buckets([((2,), tf.string)], 64),
         "string", "numeric dtypes"),
    case("plan-shape-negative", lambda: gs.plan_buckets([((-1, 2), tf.float32)], 64),
         "(-1, 2)", "non-negative integers"),
    case("plan-shape-str", lambda: gs.plan_buckets([("ab", tf.float32)], 64),
         "'ab'", "non-negative integers"),
    case("plan-shape-unknown", lambda: gs.plan_buckets([((None, 3), tf.float32)], 64),
         "(None, 3)", "fully defined"),
    # ------------------------------------------------------------ MultiWorkerMirroredStrategy
    case("mwms-ops", lambda: gs.MultiWorkerMirroredStrategy(cross_device_ops="fp16"),
         "'fp16'", "tf_gradsync.CompressedAllReduce or None"),
    case("mwms-resolver", lambda: gs.MultiWorkerMirroredStrategy(cluster_resolver="w:1"),
         "'w:1'", "ClusterResolver or None"),
    case("mwms-options",
         lambda: gs.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 5}),
         "{'timeout_seconds': 5}", "CommunicationOptions or None"),
    case("mwms-startup", lambda: gs.MultiWorkerMirroredStrategy(startup_timeout_seconds=0),
         "got 0", "positive, finite number of seconds or None"),
    # ------------------------------------------------------------ callbacks
    case("monitor-log-keys", lambda: CommunicationMonitor(OPS, log_keys=["bytes", "comm_bytes"]),
         "['bytes']", "comm_bytes, comm_bytes_dense"),
    case("monitor-batch-zero", lambda: CommunicationMonitor(OPS, batch_size=0),
         "got 0", "positive integer or None"),
    case("monitor-batch-str", lambda: CommunicationMonitor(OPS, batch_size="64"),
         "'64'", "positive integer or None"),
    case("monitor-batch-bool", lambda: CommunicationMonitor(OPS, batch_size=True),
         "True", "positive integer or None"),
    case("monitor-csv-path", lambda: CommunicationMonitor(OPS, csv_path=5),
         "got 5", "path (str or os.PathLike)"),
    case("monitor-jsonl-empty", lambda: CommunicationMonitor(OPS, jsonl_path=""),
         "got ''", "non-empty path"),
    case("step-monitor-path", lambda: StepMonitor(OPS, jsonl_path=3.5),
         "3.5", "path (str or os.PathLike)"),
    case("step-monitor-batch", lambda: StepMonitor(OPS).step(batch_size=-8).__enter__(),
         "-8", "positive integer or None"),
    case("monitor-target", lambda: CommunicationMonitor(42), "42", "CompressedAllReduce"),
]


def test_numpy_numbers_are_numbers():
    ops = gs.CompressedAllReduce("fp16", warmup_steps=np.int64(3), bucket_bytes=np.int64(1024),
                                 timeout_seconds=np.float32(5))
    assert ops.compressor.steps == 3 and type(ops.compressor.steps) is int
    assert ops.timeout_seconds == 5.0 and type(ops.timeout_seconds) is float
    ops = gs.CompressedAllReduce("topk", guard=np.True_, jit_compile=np.False_,
                                 error_feedback=np.False_, measure_error=np.True_)
    assert ops.jit_compile is False and ops.compressor.name == "guard"
    assert not isinstance(ops.compressor.inner, C.ErrorFeedback)
    # A compressor's settings too, numbers and flags alike; numpy's booleans stay no number.
    assert C.get("topk", ratio=np.float32(0.05)).ratio == np.float32(0.05)
    assert C.get("powersgd", rank=np.int64(2), warm_start=np.False_).rank == 2
    assert C.get("randomk", scale=np.True_).unbiased
    with pytest.raises(ValueError, match="ratio must be a number.*got np.True_"):
        C.get("topk", ratio=np.True_)


def test_a_compressors_setting_given_to_the_ops_says_where_it_goes():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['ratio'\]; its "
                       r"arguments: compression, bucket_bytes, .*\. ratio set the compressor: "
                       r"CompressedAllReduce\(tf_gradsync.compression.get\('topk', ratio=...\)\)"):
        gs.CompressedAllReduce("topk", ratio=0.1)
    with pytest.raises(TypeError) as err:         # a typo of the ops' own: no such hint
        gs.CompressedAllReduce(C.get("sign"), bucket_byts=1)
    assert "['bucket_byts']; its arguments: compression, bucket_bytes" in str(err.value)
    assert "set the compressor" not in str(err.value)


@pytest.mark.parametrize("fn,needles", CASES)
def test_bad_value_is_named_with_what_is_allowed(fn, needles):
    with pytest.raises(ValueError) as err:
        fn()
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


# ------------------------------------------------------------ presets on disk
def test_a_preset_reads_exponents_as_numbers(tmp_path):
    """YAML 1.1 (PyYAML's) reads `1e-3` without a dot as a string."""
    path = tmp_path / "sci.yaml"
    path.write_text("compression: topk\ncompression_options: {ratio: 1e-3}\n"
                    "timeout_seconds: 6E+1\n")
    ops = gs.load_config(path)
    assert ops.compressor.inner.ratio == 1e-3


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("compression: fp16\n  bucket_bytes: [1\n")
    with pytest.raises(ValueError, match="broken.yaml: not a valid YAML preset"):
        gs.load_config(path)
    path.write_text("- fp16\n- topk\n")
    with pytest.raises(ValueError, match="must be a YAML mapping, got list"):
        gs.load_config(path)


@pytest.mark.parametrize("text,message", [
    ("compression: topk\ncompression_options: {ratio: 5}\n",
     "preset.yaml: compression_options of topk: ratio must be in (0, 1], got 5"),
    ("compression: fp16\nbucket_bytes: 4MiB\n",
     "preset.yaml: bucket_bytes must be a positive integer, got '4MiB'"),
    ("compression: fp16\nbucket_size: 1024\n", "preset.yaml: unknown config keys ['bucket_size']"),
    ("compression: fp16\ncompression: topk\n",
     "preset.yaml: key 'compression' is given twice (line 1)"),
    ("", "preset.yaml: the preset is empty; give at least `compression: NAME`"),
    ("bucket_bytes: 1024\n", "preset.yaml: the preset names no compressor; give "
                             "`compression: NAME` (valid names: adaptive, bf16,"),
    ("compression: none\nerror_feedback: true\n",
     "preset.yaml: NoCompression() sends every value exactly"),
    ("compresion: fp16\n", "preset.yaml: unknown config keys ['compresion']; valid keys: "
                           "compression, "),
    (b"compression: fp16 \xff\n", "preset.yaml: not a UTF-8 text file (invalid start byte "
                                   "at byte 18)"),
])
def test_a_preset_file_names_itself_and_the_key(tmp_path, text, message):
    """Every error of a preset file starts with its path; nothing is silently dropped (a
    key given twice) or assumed (an empty file, a file without a compressor)."""
    path = tmp_path / "preset.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as e:
        gs.load_config(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)


def test_a_folder_is_no_preset(tmp_path):
    with pytest.raises(ValueError, match=f"'{tmp_path}' is a folder; give a preset's YAML file "
                                         "or the name of a shipped preset: adaptive, bf16"):
        gs.load_config(tmp_path)


# ------------------------------------------------------------ TF_CONFIG
EXAMPLE_CLUSTER = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
TF_CONFIGS = [
    ("{bad", ["not valid JSON", "'{bad'", '"cluster"']),
    ("[1, 2]", ["'[1, 2]'", "JSON object with 'cluster' and 'task'"]),
    ('{"task": {"type": "worker", "index": 0}}', ["lacks 'cluster'", '"cluster"']),
    ('{"cluster": {"worker": ["h:1"]}}', ["lacks 'task'", '"task"']),
    ('{"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 2}}',
     ["index 2", "[0, 1]"]),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": -1}}',
     ["index -1", "[0, 0]"]),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}',
     ["index '0'", "[0, 0]"]),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "wroker", "index": 0}}',
     ["'wroker'", "chief, worker, ps, evaluator"]),
    ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "chief", "index": 0}}',
     ["'chief' is not in the cluster", "worker"]),
    ('{"cluster": {"workers": ["h:1"]}, "task": {"type": "worker", "index": 0}}',
     ["'workers'", "chief, worker, ps, evaluator"]),
    ('{"cluster": {"worker": "h:1"}, "task": {"type": "worker", "index": 0}}',
     ["'h:1'", "non-empty list of 'host:port'"]),
    ('{"cluster": {"worker": ["h"]}, "task": {"type": "worker", "index": 0}}',
     ["'h'", "'host:port' with a port in 1..65535"]),
    ('{"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}}',
     ["'h:99999'", "1..65535"]),
    ('{"cluster": {}, "task": {"type": "worker", "index": 0}}',
     ["got {}", "chief, worker, ps, evaluator"]),
    ('{"cluster": {"chief": ["a:1", "b:1"], "worker": ["h:1"]}, "task": {"type": "worker", '
     '"index": 0}}', ["['a:1', 'b:1']", "at most one chief"]),
    ('{"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:1"]}, "task": {"type": "worker", '
     '"index": 0}}', ["chief 0 and worker 1 one address, 'h:1'", "its own port"]),
]


@pytest.mark.parametrize("raw,needles", TF_CONFIGS)
def test_malformed_tf_config(raw, needles):
    with pytest.raises(ValueError) as err:
        check_tf_config(raw)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


@pytest.mark.parametrize("raw", [TF_CONFIGS[0][0], TF_CONFIGS[4][0]])
def test_strategy_checks_tf_config_before_tensorflow(monkeypatch, raw):
    monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(ValueError, match="^TF_CONFIG "):
        gs.MultiWorkerMirroredStrategy()


def test_good_tf_configs_pass():
    assert check_tf_config(None) is None and check_tf_config(" ") is None
    assert check_tf_config("{}") is None
    for cfg in launch.tf_configs(EXAMPLE_CLUSTER["worker"]):
        assert check_tf_config(json.dumps(cfg)) == cfg
    chief = {"cluster": {"chief": ["c:1"], "worker": ["[::1]:2"]},
             "task": {"type": "evaluator", "index": 0}}
    assert check_tf_config(json.dumps(chief)) == chief


# ------------------------------------------------------------ launcher flags
@pytest.mark.parametrize("args,needles", [
    (["--num_workers=abc"], ["'abc'", "int"]),
    (["--num_workers=2", "--port=0"], ["got 0", "1..65534"]),
    (["--num_workers=2", "--grace_seconds=nan"], ["got nan", "finite number > 0"]),
    (["--num_workers=2", "--grace_seconds=inf"], ["got inf", "finite number > 0"]),
    (["--num_workers=2", "--restarts=-1"], ["got -1", ">= 0"]),
    (["--num_workers=2", "--restarts=1.5"], ["'1.5'", "int"]),
    (["--num_workers=2", "--attempt_timeout=0"], ["got 0.0", "finite number > 0"]),
    (["--num_workers=2", "--attempt_timeout=inf"], ["got inf", "finite number > 0"]),
    (["--num_workers=2", "--hosts=a:1,b"], ["'a:1'", "host names or IP addresses without a port"]),
    (["--num_workers=2", "--hosts=a b,c"], ["'a b'", "host names or IP addresses"]),
    (["--num_workers=3", "--hosts=a,,c"], ["'a,,c'", "3 non-empty hosts"]),
])
def test_bad_launcher_flags(args, needles, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.parse_args([*args, "--", "train.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"


def test_launcher_defaults_to_loopback():
    args = launch.parse_args(["--num_workers=3", "--", __file__])
    assert args.hosts == ["127.0.0.1"] * 3 and args.port is None
    assert args.restarts == 0 and args.attempt_timeout is None


# ------------------------------------------------------------ bucket planner properties
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)   # () is a scalar
specs_st = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=10)


def _tensor(shape, dtype, rng):
    values = rng.normal(size=shape) * 1000
    return tf.constant(values.astype(np.int64) if dtype.is_integer else values, dtype)


@settings(max_examples=50, deadline=None)
@given(specs_st, st.integers(1, 512), st.integers(0, 2**32 - 1))
def test_plan_round_trips_bounds_and_is_deterministic(specs, bucket_bytes, seed):
    rng = np.random.default_rng(seed)
    tensors = [_tensor(s, d, rng) for s, d in specs]
    plan = gs.plan_buckets([(t.shape, t.dtype) for t in tensors], bucket_bytes)
    # Every tensor exactly once; one dtype per bucket; the bound holds unless alone.
    assert sorted(s.index for b in plan.buckets for s in b.slots) == list(range(len(specs)))
    for b in plan.buckets:
        assert all(tensors[s.index].dtype == b.dtype for s in b.slots)
        assert b.nbytes <= bucket_bytes or len(b.slots) == 1
    # Same input (rebuilt from plain Python values) -> same plan and fingerprint.
    again = gs.plan_buckets([(list(s), tf.as_dtype(d).name) for s, d in specs], bucket_bytes)
    assert again == plan and again.fingerprint == plan.fingerprint
    for t, u in zip(tensors, plan.unpack(plan.pack(tensors))):
        assert u.dtype == t.dtype and u.shape == t.shape
        np.testing.assert_array_equal(u.numpy(), t.numpy())


# ------------------------------------------------------------ compressor round trips
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
#: Relative error of one rounding to the wire dtype (half an ulp, with margin).
WIRE_RTOL = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _roundtrip(c: C.Compressor, x: tf.Tensor) -> tf.Tensor:
    """What x becomes on one replica, every compressor through the protocol driver."""
    return roundtrip(c, x, seed=(3, 4))


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(C.names()), st.sampled_from(FLOATS), st.integers(1, 300),
       st.floats(1e-3, 1e3), st.integers(0, 2**32 - 1))
def test_compressor_round_trip(name, dtype, n, scale, seed):
    x = tf.constant(np.random.default_rng(seed).normal(size=n) * scale, dtype)
    c = C.get(name)
    y = _roundtrip(c, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    got = tf.cast(y, tf.float64).numpy()
    want = tf.cast(x, tf.float64).numpy()
    if name == "none":
        np.testing.assert_array_equal(got, want)
    elif name in WIRE_RTOL:
        # Subnormals of the wire dtype are spaced 2**-24 (fp16) apart.
        np.testing.assert_allclose(got, want, rtol=WIRE_RTOL[name], atol=2.0**-24)


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_none_round_trips_integers_exactly(dtype):
    x = tf.constant(np.arange(-50, 50) * 12345, dtype)
    np.testing.assert_array_equal(_roundtrip(C.get("none"), x).numpy(), x.numpy())


# ------------------------------------------------------------ nothing executes input
#: Calls that would run or unpickle data. A documented safe use is listed in ALLOWED as
#: (path relative to the repository, qualified name) with the reason.
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "pickle.load", "pickle.loads",
                   "pickle.Unpickler", "marshal.load", "marshal.loads", "yaml.load",
                   "yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all",
                   "shelve.open", "dill.load", "dill.loads", "cloudpickle.load",
                   "cloudpickle.loads", "os.system", "os.popen"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
#: Keyword arguments that switch a safe loader into an unsafe mode.
FORBIDDEN_KEYWORDS = {("allow_pickle", True), ("safe_mode", False), ("shell", True)}
ALLOWED: dict[tuple[str, str], str] = {}


def _qualified(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_qualified(node.value)}.{node.attr}"
    return ""


def _findings(source: str, rel: str) -> list[tuple[str, int, str]]:
    """(file, line, what) for every forbidden import, call or keyword in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [(rel, node.lineno, m) for m in mods
                      if m and m.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.Call):
            name = _qualified(node.func)
            if name in FORBIDDEN_CALLS:
                found.append((rel, node.lineno, name))
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant) \
                        and (kw.arg, kw.value.value) in FORBIDDEN_KEYWORDS:
                    found.append((rel, node.lineno, f"{name}({kw.arg}={kw.value.value})"))
    return [f for f in found if (f[0], f[2]) not in ALLOWED]


def test_package_never_executes_or_unpickles_input():
    files = sorted((ROOT / "tf_gradsync").rglob("*.py"))
    assert len(files) > 20
    findings = [f for path in files
                for f in _findings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert findings == [], "\n".join(f"{p}:{line}: {what}" for p, line, what in findings)


def test_scanner_finds_what_it_looks_for():
    source = ("import pickle\nimport yaml\nyaml.load(s)\neval(x)\nnp.load(f, allow_pickle=True)\n"
              "subprocess.run(c, shell=True)\nre.compile(p)\nyaml.safe_load(s)\n")
    assert sorted(what for _, _, what in _findings(source, "probe.py")) == sorted([
        "pickle", "yaml.load", "eval", "np.load(allow_pickle=True)", "subprocess.run(shell=True)"])
