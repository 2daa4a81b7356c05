"""What-if planner: every compressor and exchange priced for a model, workers and link.

    python -m tf_gradsync.plan --model=ResNet50 --workers=8 --bandwidth=10gbit --compute_s=0.2
    python -m tf_gradsync.plan --params=25000000 --workers=4 --bandwidth=1gbit --calibrate

It prints a table (compressor, exchange, bytes per worker, predicted step seconds,
predicted speed-up over `none`) from the cost model (`tf_gradsync.costmodel`,
docs/cost_model.md); `--json` writes the rows. Several `--workers` and `--bandwidth`
values give a row per combination (and `--png` draws each compressor's best predicted
speed-up against the worker count). `--calibrate` measures each compressor's data path
(a rate and a cost per call), and the compute of `--model` (or of `--params` as one
square Dense layer), on this machine.

Models: a `keras.applications` name (any case: resnet50, MobileNetV2, ...) with random
weights, a saved Keras model's path, or "bert-large" (BERT-large's 335M weights by
shape: 24 blocks of width 1024, vocabulary 30522, without Keras).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import zipfile
from typing import Sequence

from absl import flags

from tf_gradsync.algorithms.cost import (LOCAL_BANDWIDTH, LOCAL_LATENCY_US, local_link as _local,
                                         parse_bandwidth)
from tf_gradsync.config import DEFAULT_BUCKET_BYTES

FLAGS = flags.FlagValues()
flags.DEFINE_integer("params", None, "Model size in weights (one square Dense layer and its "
                     "bias; past 2^30 weights, several of at most 2^30).", flag_values=FLAGS)
flags.DEFINE_string("model", None, "A keras.applications name, a saved Keras model's path or "
                    "bert-large.", flag_values=FLAGS)
flags.DEFINE_list("imports", [], "Modules to import first: those defining --model's custom "
                  "layers, or compressors of your own.", flag_values=FLAGS)
flags.DEFINE_list("workers", ["4"], "Workers N (several: a row per value).", flag_values=FLAGS)
flags.DEFINE_list("bandwidth", ["1gbit"], "Link rate per worker, tc style: kbit, mbit, gbit are "
                  "bits per second, kbps, mbps, gbps BYTES per second (100mbit, 1gbit, 25gbit; "
                  "several: a row per value).", flag_values=FLAGS)
flags.DEFINE_float("latency_us", 50.0, "Latency per message, microseconds.", flag_values=FLAGS)
flags.DEFINE_integer("devices_per_worker", 1, "Devices (GPUs) per worker: summed payloads go "
                     "in the hierarchical exchange, gathered ones among every device.",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_string("local_bandwidth", LOCAL_BANDWIDTH, "Link rate between a worker's devices, "
                    "as --bandwidth (100gbit: about PCIe 3.0 x16; NVLink is several times more).",
                    flag_values=FLAGS)
flags.DEFINE_float("local_latency_us", LOCAL_LATENCY_US, "Latency per message between a "
                   "worker's devices, microseconds.", flag_values=FLAGS)
flags.DEFINE_float("compute_s", None, "Forward + backward seconds per step (or --calibrate).",
                   flag_values=FLAGS)
flags.DEFINE_list("compressors", None, "Compressors (default: every registered one), each a "
                  "name or name:key=value[:key=value...] (topk:ratio=0.001, "
                  "powersgd:rank=8, sign:exchange=two_phase).", flag_values=FLAGS)
flags.DEFINE_bool("calibrate", False, "Measure the compressors' data paths (and compute) here.",
                  flag_values=FLAGS)
flags.DEFINE_integer("batch", 32, "Examples per worker and step: --calibrate's, and the "
                     "embedding lookups priced.",
                     flag_values=FLAGS)
flags.DEFINE_bool("sparse_as_dense", False, "Price embedding tables as dense gradients, "
                  "as CompressedAllReduce(sparse_as_dense=True) sends them.", flag_values=FLAGS)
flags.DEFINE_integer("bucket_bytes", DEFAULT_BUCKET_BYTES, "CompressedAllReduce's bucket_bytes.",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("overlap", 0.0, "Share of compute exchanges hide behind, in [0, 1].",
                   lower_bound=0.0, upper_bound=1.0, flag_values=FLAGS)
flags.DEFINE_float("codec_gbps", None, "One compress + decompress throughput (GB/s of input) "
                   "for every compressor, instead of the defaults or --calibrate.",
                   flag_values=FLAGS)
flags.DEFINE_string("json", None, "Write the rows to this JSON file.", flag_values=FLAGS)
flags.DEFINE_string("png", None, "Draw the best speed-up per compressor against workers.",
                    flag_values=FLAGS)

#: `--params` past this many weights is priced as several square layers of at most
#: this many each: the sparsifiers' int32 indices address 2^31 - 1 entries of a tensor.
MAX_LAYER = 1 << 30
COLUMNS = ["compressor", "exchange", "workers", "devices_per_worker", "bandwidth",
           "bytes_per_worker", "wire_s", "codec_s", "predicted_step_s", "predicted_speedup"]
#: Elements compressed per compressor when calibrating (a 2000 x 2000 matrix).
CALIBRATE_NUMEL = 4_000_000


@dataclasses.dataclass(frozen=True)
class Lookups:
    """An embedding table's gradient per worker and step: `rows` looked-up rows (IndexedSlices,
    duplicates included) of `width` entries of `dtype`, indices of `index_dtype`;
    `per_example` None where the model does not fix its lookups (one per example
    assumed); the table has `table_rows` rows (its whole gradient under
    `sparse_as_dense`) and is weight `position` of the model's trainable weights."""
    name: str
    rows: int
    width: int
    dtype: object
    index_dtype: object
    per_example: int | None
    table_rows: int
    position: int

    @property
    def table(self) -> tuple:
        """The table's `(shape, dtype)`, as a dense gradient's spec."""
        return (self.table_rows, self.width), self.dtype


def gradients_of(model: str | None, params: int | None, batch: int = 32
                 ) -> tuple[list[tuple], list[Lookups]]:
    """`(specs, lookups)`: `(shape, dtype)` of every trainable weight of `--model` or
    `--params` that gets a dense gradient, and each embedding table's lookups for
    `batch` examples per worker (a Keras `Embedding`'s gradient is the rows it looked
    up, gathered as they are: `costmodel.sparse_payload`). bert-large's tables are
    priced dense, as pretraining with the output layer tied to the word embedding sends
    them.

    Raises:
      ValueError: for neither or both, a non-positive count, or an unknown model.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_gradsync import _tf_compat  # pylint: disable=import-outside-toplevel
    if (model is None) == (params is None):
        raise ValueError("give exactly one of --params (a weight count) and --model "
                         f"(a keras.applications name, a saved model's path or bert-large); "
                         f"got params={params!r}, model={model!r}")
    if params is not None:
        if params < 1:
            raise ValueError(f"--params must be a positive weight count, got {params}")
        layers = -(-params // MAX_LAYER)
        width = max(1, int((params / layers) ** 0.5))
        return [((width, width), tf.float32), ((width,), tf.float32)] * layers, []
    if model.lower() == "bert-large":
        return bert_large_specs(), []
    net = load_model(model)
    specs = [(tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype))
             for v in _tf_compat.dense_gradient_weights(net)]
    position = {id(w): i for i, w in enumerate(net.trainable_weights)}
    return specs, [_lookups(layer, batch, position[id(layer.embeddings)])
                   for layer in _tf_compat.keras_embeddings(net)]


def _lookups(layer, batch: int, position: int) -> Lookups:
    """An Embedding's lookups for `batch` examples: its input's size past the batch per
    example, when the model fixes it and calls the layer once (else one, assumed), with
    indices of its input's dtype (int32 unless int64)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_gradsync import _tf_compat  # pylint: disable=import-outside-toplevel
    try:
        ids = layer.input if _tf_compat.keras_calls(layer) <= 1 else None
    except (AttributeError, ValueError, RuntimeError):   # called several times, or never
        ids = None
    dims = None if ids is None else list(ids.shape[1:])
    per_example = (math.prod(dims) if dims is not None
                   and all(isinstance(d, int) and d > 0 for d in dims) else None)
    index = (tf.int64 if ids is not None and getattr(ids.dtype, "name", ids.dtype) == "int64"
             else tf.int32)
    table = layer.embeddings
    return Lookups(layer.name, batch * (per_example or 1), int(table.shape[-1]),
                   tf.as_dtype(table.dtype), index, per_example, int(table.shape[0]), position)


def bert_large_specs(layers: int = 24, width: int = 1024, vocab: int = 30522,
                     positions: int = 512) -> list:
    """BERT-large's trainable weights by shape (335M), in the order a model lists them."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    f = tf.float32
    out = [((vocab, width), f), ((positions, width), f), ((2, width), f), ((width,), f),
           ((width,), f)]
    for _ in range(layers):
        for _ in range(4):              # query, key, value, attention output
            out += [((width, width), f), ((width,), f)]
        out += [((width,), f), ((width,), f), ((width, 4 * width), f), ((4 * width,), f),
                ((4 * width, width), f), ((width,), f), ((width,), f), ((width,), f)]
    return out + [((width, width), f), ((width,), f)]        # pooler


def load_model(name: str):
    """A saved Keras model (a path that exists) or a `keras.applications` model with
    random weights (its name, any case).

    Raises:
      ValueError: for a file Keras cannot load (saying why), a path to no file, or a
        name that is none of these, listing the application names.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras = tf.keras
    if os.path.exists(name):
        if os.path.isfile(name) and name.lower().endswith(".keras"):
            # Keras would say "File not found" of a file that is there. Opened here, as
            # `is_zipfile` takes an unreadable file for no archive.
            try:
                with open(name, "rb") as f:
                    zipped = zipfile.is_zipfile(f)
            except OSError as e:
                raise ValueError(f"--model={name}: cannot be read: {e.strerror}") from e
            if not zipped:
                raise ValueError(f"--model={name}: not a Keras archive (model.save writes "
                                 "a .keras file as a zip archive); the file is damaged or "
                                 "of another kind")
        try:
            return keras.models.load_model(name, compile=False)
        except Exception as e:    # Keras raises OSError, TypeError, ValueError, ... alike
            why = (str(e).strip().splitlines() or [""])[0][:300]
            raise ValueError(f"cannot load the model saved at {name!r}: {type(e).__name__}: "
                             f"{why} (a custom layer's module: --imports=module; a model "
                             "saved by tf_keras: TF_USE_LEGACY_KERAS=1)") from e
    if os.sep in name or name.lower().endswith((".keras", ".h5", ".hdf5")):
        raise ValueError(f"--model={name}: no such file")
    apps = {n.lower(): getattr(keras.applications, n) for n in dir(keras.applications)
            if n[:1].isupper() and callable(getattr(keras.applications, n))}
    if name.lower() not in apps:
        raise ValueError(f"unknown model {name!r}: not a file, bert-large or a "
                         f"keras.applications model; valid names: {', '.join(sorted(apps))}")
    return apps[name.lower()](weights=None)


def calibrate_compute(model: str | None, params: int | None, batch: int, repeats: int = 3) -> float:
    """Median seconds of one forward + backward pass on this machine (one worker)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if model is not None and model.lower() == "bert-large":
        raise ValueError("--calibrate cannot build bert-large (its shapes only); give --compute_s")
    from tf_gradsync.bench import models  # pylint: disable=import-outside-toplevel
    if params is not None:
        work = models.build("dense", batch, params)
    else:
        net = load_model(model)
        shape = [batch, *[d or 224 for d in net.input_shape[1:]]]
        work = models.Workload(
            net, lambda m, x, y: tf.reduce_mean(tf.square(m(x, training=True))),
            (tf.random.uniform(shape), None), batch, "examples")

    @tf.function
    def step():
        return work.gradients()[1]

    from tf_gradsync import costmodel  # pylint: disable=import-outside-toplevel
    return costmodel.median_seconds(step, repeats)[0]


def calibrate_codecs(specs: Sequence[str], numel: int = CALIBRATE_NUMEL
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Each compressor spec's bucket data path (prescale, compress with error feedback,
    decode, sum, compression error) as `CompressedAllReduce` builds it, with this
    process's threads (`costmodel.measure_codec`): `(bytes of float32 input per
    second, seconds per call)`, each by spec."""
    from tf_gradsync import costmodel  # pylint: disable=import-outside-toplevel
    from tf_gradsync.bench import ops_from_spec  # pylint: disable=import-outside-toplevel
    rates, calls = {}, {}
    for s in specs:
        ops = ops_from_spec(s)
        rates[s], calls[s] = costmodel.measure_codec(ops.compressor, numel,
                                                     jit_compile=ops.jit_compile)
    return rates, calls


def plan(specs, compressors: Sequence[str], workers: Sequence[int], bandwidths: Sequence[str],
         compute_s: float, latency_s: float = 50e-6, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         overlap: float = 0.0, throughput: dict[str, float] | None = None,
         call_s: dict[str, float] | None = None, devices: int = 1,
         local_link=None, lookups: Sequence[Lookups] = (),
         sparse_as_dense: bool = False) -> list[dict]:
    """One row per (workers, bandwidth, compressor, exchange), as in `COLUMNS`.

    `predicted_speedup` is `none`'s fastest exchange over this row's step, for the
    same workers and bandwidth. With several `devices` per worker, `bytes_per_worker`
    is what a worker's devices send to the other workers together; one worker's
    devices exchange as members on `local_link`, as one process's devices do (its
    `bytes_per_worker` is then what each device sends).

    Args:
      specs: `(shape, dtype)` of every trainable weight with a dense gradient.
      compressors: registered names, optionally with settings (`topk:ratio=0.001`),
        the ops' too (`sign:exchange=two_phase`, `topk:bucket_bytes=1048576`), which
        take the place of `bucket_bytes` and of the exchanges not pinned.
      workers: worker counts.
      bandwidths: link rates, tc style.
      compute_s: forward + backward seconds per step.
      latency_s: latency per message.
      bucket_bytes: the bucket size the payloads are planned with.
      overlap: see `costmodel.predict`.
      throughput: bytes/s per compressor name (default: `costmodel.THROUGHPUT`).
      call_s: seconds per data path call by name (`calibrate_codecs`; default 0).
      devices: devices per worker, each computing and compressing its own gradients.
      local_link: `algorithms.cost.Link` between a worker's devices (default:
        `LOCAL_LATENCY_US`, `LOCAL_BANDWIDTH`).
      lookups: the embedding tables' lookups per worker and step (`gradients_of`),
        shared among its devices.
      sparse_as_dense: price the tables as dense gradients (`CompressedAllReduce`'s
        setting) but for specs that set it themselves.

    Raises:
      ValueError: for a bad compressor, rate or setting (naming it and the choices).
    """
    from tf_gradsync import costmodel  # pylint: disable=import-outside-toplevel
    from tf_gradsync.algorithms.cost import Link  # pylint: disable=import-outside-toplevel
    from tf_gradsync.bench import ops_from_spec  # pylint: disable=import-outside-toplevel
    if not (isinstance(devices, int) and devices >= 1):
        raise ValueError(f"devices per worker must be an integer >= 1, got {devices!r}")
    local_link = local_link or _local()
    links = [(b, Link(latency_s, parse_bandwidth(b))) for b in bandwidths]
    # A spec's own settings of the ops (`topk:bucket_bytes=...:exchange=two_phase`) are
    # priced as they would run, over the flags'.
    built = {spec: ops_from_spec(spec, bucket_bytes=bucket_bytes,
                                 sparse_as_dense=sparse_as_dense)
             for spec in dict.fromkeys(["none", *compressors])}
    rows = []
    for n in workers:
        payloads = {s: _payloads(ops, specs, lookups, n, devices) for s, ops in built.items()}
        for band, link in links:
            # One worker's devices are the members, on the link between them.
            members, local, wire = (devices, 1, local_link) if n == 1 else (n, devices, link)
            group = []
            for spec, ops in built.items():
                rate = (throughput or {}).get(spec)
                for ex in costmodel.exchanges_for(ops.compressor, local):
                    if ops.exchange not in ("auto", ex):
                        continue       # the spec pins the other exchange
                    p = costmodel.predict(ops.compressor, payloads[spec], ex, members, wire,
                                          compute_s, rate, overlap, local=local,
                                          local_link=local_link, jit_compile=ops.jit_compile,
                                          call_s=(call_s or {}).get(spec, 0.0))
                    group.append({"compressor": spec, "exchange": ex, "workers": n,
                                  "devices_per_worker": devices, "bandwidth": band,
                                  "bytes_per_worker": round(p.bytes_per_worker),
                                  "wire_s": p.wire_s, "codec_s": p.codec_s,
                                  "predicted_step_s": p.step_s})
            base = min(r["predicted_step_s"] for r in group if r["compressor"] == "none")
            for r in group:
                r["predicted_speedup"] = base / r["predicted_step_s"]
            rows += [r for r in group if r["compressor"] != "none" or "none" in compressors]
    return rows


def _payloads(ops, specs, lookups: Sequence[Lookups], workers: int, devices: int) -> list:
    """The payloads `ops` send per step for these dense gradients and tables' lookups
    (or, densified by the ops, their tables)."""
    from tf_gradsync import costmodel  # pylint: disable=import-outside-toplevel
    if ops.sparse_as_dense:     # the tables among the other weights, in the model's order
        ordered = list(specs)
        for t in sorted(lookups, key=lambda t: t.position):
            ordered.insert(t.position, t.table)
        return costmodel.model_payloads(ops.compressor, ordered, ops.bucket_bytes,
                                        workers * devices)
    return (costmodel.model_payloads(ops.compressor, specs, ops.bucket_bytes, workers * devices)
            + [costmodel.sparse_payload(ops.compressor, -(-t.rows // devices), t.width,
                                        t.dtype, t.index_dtype) for t in lookups])


def _positive_ints(name: str, values: Sequence[str]) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--{name} must be integers >= 1, got {','.join(values)}")
    return list(dict.fromkeys(out))


def _check_flags(rest: Sequence[str]) -> None:
    """Raises ValueError naming the first flag whose value makes no plan."""
    if rest:
        raise ValueError(f"unexpected argument(s) {' '.join(rest)}; several values go in one "
                         "flag, comma-separated (--workers=2,8)")
    if not FLAGS.bandwidth:
        raise ValueError("--bandwidth needs at least one rate (e.g. --bandwidth=1gbit)")
    for rate in FLAGS.bandwidth:
        try:
            parse_bandwidth(rate)
        except ValueError as e:
            raise ValueError(f"--bandwidth: {e}") from None
    checks = [("compute_s", FLAGS.compute_s, 0, True), ("latency_us", FLAGS.latency_us, 0, False),
              ("codec_gbps", FLAGS.codec_gbps, 0, True), ("batch", FLAGS.batch, 1, False),
              ("local_latency_us", FLAGS.local_latency_us, 0, False)]
    for name, value, low, above in checks:
        if value is not None and not (math.isfinite(value) and
                                      (value > low if above else value >= low)):
            raise ValueError(f"--{name} must be a finite number {'>' if above else '>='} "
                             f"{low}, got {value}")


def main(argv: Sequence[str]) -> None:
    """The command line: prints the table; exits with a message for bad flags."""
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv[1:]):
        print(__doc__.strip() + "\n\nFlags:\n" + FLAGS.get_help())
        return
    FLAGS.unparse_flags()          # each call starts from the defaults
    try:
        rest = FLAGS(list(argv))[1:]
    except flags.Error as e:
        sys.exit(f"plan: {e}\nSee --help.")
    from tf_gradsync import compression  # pylint: disable=import-outside-toplevel
    from tf_gradsync.algorithms.cost import Link  # pylint: disable=import-outside-toplevel
    from tf_gradsync.bench.__main__ import (  # pylint: disable=import-outside-toplevel
        check_outputs, table, write_json, written)
    try:
        _check_flags(rest)
        check_outputs(json=FLAGS.json, png=FLAGS.png)
        workers = _positive_ints("workers", FLAGS.workers)
        for module in FLAGS.imports:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ValueError(f"--imports={module}: {e}") from e
        names = compression.names() if FLAGS.compressors is None else FLAGS.compressors
        if not names:
            raise ValueError("--compressors is empty; name them (--compressors=fp16,topk), "
                             "or leave the flag out for every registered one")
        from tf_gradsync.bench import check_specs  # pylint: disable=import-outside-toplevel
        check_specs(names)     # before a model is built or anything measured
        specs, lookups = gradients_of(FLAGS.model, FLAGS.params, FLAGS.batch)
        if FLAGS.compute_s is None and not FLAGS.calibrate:
            raise ValueError("give --compute_s (forward + backward seconds per step) or "
                             "--calibrate (measure it here)")
        compute_s = FLAGS.compute_s
        if compute_s is None:
            compute_s = calibrate_compute(FLAGS.model, FLAGS.params, FLAGS.batch)
        throughput = calls = None
        if FLAGS.codec_gbps is not None:
            throughput = {n: FLAGS.codec_gbps * 1e9 for n in ["none", *names]}
        elif FLAGS.calibrate:
            throughput, calls = calibrate_codecs(list(dict.fromkeys(["none", *names])))
        try:
            local_rate = parse_bandwidth(FLAGS.local_bandwidth)
        except ValueError as e:
            raise ValueError(f"--local_bandwidth: {e}") from e
        local_link = Link(FLAGS.local_latency_us * 1e-6, local_rate)
        rows = plan(specs, names, workers, list(dict.fromkeys(FLAGS.bandwidth)), compute_s,
                    FLAGS.latency_us * 1e-6, FLAGS.bucket_bytes, FLAGS.overlap, throughput,
                    calls, FLAGS.devices_per_worker, local_link, lookups,
                    FLAGS.sparse_as_dense)
    except ValueError as e:
        sys.exit(f"plan: {e}")
    params = sum(math.prod(s) for s, _ in specs)
    source = ("defaults" if throughput is None else f"{FLAGS.codec_gbps:g} GB/s"
              if FLAGS.codec_gbps is not None else "measured here")
    print(f"{params:,} weights in {len(specs)} tensors; compute {compute_s:.4g} s per step; "
          f"latency {FLAGS.latency_us:g} us; bucket_bytes {FLAGS.bucket_bytes}; overlap "
          f"{FLAGS.overlap:g}; codec throughput: {source}")
    if lookups and FLAGS.sparse_as_dense:
        print(f"(and {len(lookups)} embedding tables, priced as dense gradients: "
              "--sparse_as_dense)")
    elif lookups:
        print(f"(and {len(lookups)} embedding tables, priced as the rows they look up, but "
              "under a spec's sparse_as_dense=true, as dense gradients:)")
    for t in () if FLAGS.sparse_as_dense else lookups:
        fixed = (f"{t.per_example} per example" if t.per_example else
                 "1 per example assumed: the model does not fix its input length")
        print(f"embedding {t.name} ({t.width} wide): its gradient is the rows looked up, "
              f"gathered as they are: {t.rows:,} per worker and step (--batch {FLAGS.batch}, "
              f"{fixed})")
    if FLAGS.devices_per_worker > 1:
        print(f"{FLAGS.devices_per_worker} devices per worker, {FLAGS.local_bandwidth} and "
              f"{FLAGS.local_latency_us:g} us between them; bytes_per_worker: a worker's "
              "devices together (of one worker: what each device sends to the others)")
    print(table(rows, COLUMNS))
    if FLAGS.json:
        write_json("json", FLAGS.json, rows)
    if FLAGS.png:
        with written("png", FLAGS.png) as tmp:
            draw(rows, tmp)


def draw(rows: Sequence[dict], path: str) -> None:
    """Each compressor's best predicted speed-up over `none` against the worker count,
    one panel per bandwidth (log-log)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    bands = list(dict.fromkeys(r["bandwidth"] for r in rows))
    fig, axes = plt.subplots(1, len(bands), figsize=(4.5 * len(bands), 4), squeeze=False,
                             sharey=True)
    for ax, band in zip(axes[0], bands):
        best: dict[str, dict[int, float]] = {}
        for r in rows:
            if r["bandwidth"] == band:
                s = best.setdefault(r["compressor"], {})
                s[r["workers"]] = max(s.get(r["workers"], 0), r["predicted_speedup"])
        for name, points in sorted(best.items()):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker=".", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_title(band)
        ax.set_xlabel("workers")
    axes[0][0].set_ylabel("predicted speed-up over none")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(sys.argv)
