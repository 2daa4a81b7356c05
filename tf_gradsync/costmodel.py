"""The cost model: predicted seconds of a synchronous data-parallel step.

A step costs its compute, the compressors' CPU work and the exchanges' time on the
link, less what overlaps. Each part comes from something measurable:

* the link: latency per message (alpha) and bandwidth (beta), and each exchange's
  messages and bytes for N workers (`tf_gradsync.algorithms.cost`): ring and
  halving-doubling all-reduce, all-gather, two phases, hierarchical;
* each compressor's payload for each bucket of a model's bucket plan, from the payload
  tensors the compressor itself builds for that bucket's layout (`bucket_rounds`),
  so layer-aware statistics (per-tensor scales, per-matrix PowerSGD factors) count;
* the compressor's throughput on the device (`THROUGHPUT`, or measured with a cost per
  call: `measure_codec`);
* the step's compute and how much of the exchange hides behind backprop (`overlap`).

`predict` combines them for one compressor and exchange; `python -m tf_gradsync.plan`
tabulates it and `tf_gradsync.autotune` picks from it. docs/cost_model.md states the
formulas and their assumptions.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.algorithms.cost import ALL_REDUCES, Link, bytes_sent, exchange_seconds
from tf_gradsync.bucketing import plan_buckets
from tf_gradsync.compression import (GATHER, Compressor, Context, Layout, _util, driver, get,
                                    nbytes, two_phase, xla)

#: Compress + decompress throughput in bytes of float32 input per second on one core:
#: `python -m tf_gradsync.bench micro` on 25M elements on the development machine (see
#: BENCHMARKS.md). `plan --calibrate` and `autotune` measure the machine they run on.
THROUGHPUT = {"none": 10.8e9, "fp16": 5.8e9, "bf16": 5.3e9, "int8": 2.1e9, "qsgd": 0.75e9,
              "terngrad": 0.46e9, "sign": 1.0e9, "onebit": 0.87e9, "powersgd": 1.8e9,
              "topk": 0.93e9, "threshold": 0.67e9, "randomk": 0.24e9, "dgc": 0.91e9,
              "adaptive": 0.5e9}
#: A step far past any compressor's warm-up: timings made there are of its steady state.
STEADY_STEP = 1 << 40
#: Throughput assumed for a compressor missing from `THROUGHPUT` (a user's own).
DEFAULT_THROUGHPUT = 1e9
#: Share of a compress + decompress spent decoding one payload (decoding is assumed to
#: cost as much as encoding); an all-gather decodes N payloads.
DECODE_SHARE = 0.5
#: `measure_codec` times the data path on a bucket and on one this many times shorter.
CALL_SPLIT = 8
#: The share of each further gathered payload when the compressor's decodings compile
#: (`Compressor.xla_decode`; `CompressedAllReduce(jit_compile=True)`, the default): XLA
#: sums the payloads in the loop that writes the bucket. Measured per extra payload over
#: 1, 2, 4 and 8 payloads of 25M entries, one core, in round trips: sign 0.02-0.05, int8
#: 0.01-0.03, top-k 0-0.02, threshold 0.01-0.07, DGC 0-0.01, TernGrad 0.03-0.04, QSGD
#: 0.00-0.01 in padded rows, onebit 0-0.14 (BENCHMARKS.md, "Compiled codecs", "PowerSGD's
#: residual as factors").
DECODE_SHARE_COMPILED = 0.05


@dataclasses.dataclass(frozen=True)
class BucketPayload:
    """What one bucket sends under a compressor, in its steady state.

    Attributes:
      numel: the bucket's elements (0: an embedding gradient, gathered as it is with no
        codec: `sparse_payload`).
      dense_bytes: its size uncompressed (0 for an embedding gradient).
      rounds: per round, `(transport, payload bytes)` of one member (SUM rounds are
        all-reduced, GATHER rounds all-gathered).
      chunks: two phases only: `(whole bucket, chunks summed, re-compressed chunks
        summed)` from `two_phase.payload_bytes`; None for summable payloads.
    """

    numel: int
    dense_bytes: int
    rounds: tuple[tuple[str, int], ...]
    chunks: tuple[int, int, int] | None = None


#: `bucket_rounds` by compressor setting and layout (`_util.by_setting`): the planner
#: would otherwise trace them again for every worker count.
_ROUNDS: dict = {}


def bucket_rounds(compressor: Compressor, layout: Layout) -> tuple[tuple[str, int], ...]:
    """Each round's transport and payload bytes for a bucket of `layout`, in the
    compressor's steady mode (`Compressor.steady_mode`), from the tensors it builds (in a
    scratch graph, run never)."""
    return _util.by_setting(_ROUNDS, compressor, layout,
                            lambda: _traced_rounds(compressor, layout))


def _traced_rounds(compressor: Compressor, layout: Layout) -> tuple[tuple[str, int], ...]:
    out = []

    def exchange(messages):     # one member: its own payload, summed or gathered
        out.append((messages[0].transport, nbytes(messages[0].payload)))
        return driver.local_exchange(messages)

    with tf.Graph().as_default():
        state = {k: tf.Variable(s.initializer(s.shape, s.dtype), name=k)
                 for k, s in compressor.state_spec(layout).items()}
        driver.run_mode(compressor, [tf.zeros([layout.numel], layout.dtype)],
                        [Context(state=state, layout=layout)], exchange,
                        mode=compressor.steady_mode())
    return tuple(out)


def model_payloads(compressor: Compressor | str, specs: Sequence[tuple[Sequence[int], tf.DType]],
                   bucket_bytes: int, workers: int) -> list[BucketPayload]:
    """Every bucket's payload for a model's gradients (`specs`: shape and dtype per
    trainable variable, in the model's order), as `CompressedAllReduce` would plan them,
    among `workers` members (every device of every worker: two phases cut a bucket into
    one chunk per member).

    Raises:
      ValueError: as `plan_buckets` and `compression.get` do.
    """
    compressor = get(compressor)
    out, seen = [], {}
    for bucket in plan_buckets(specs, bucket_bytes).buckets:
        if bucket.layout not in seen:     # models repeat layers: price each layout once
            seen[bucket.layout] = bucket_payload(compressor, bucket.layout, workers)
        out.append(seen[bucket.layout])
    return out


def sparse_payload(compressor: Compressor | str, rows: int, width: int, dtype: tf.DType,
                   index_dtype: tf.DType = tf.int32) -> BucketPayload:
    """An embedding gradient's payload: `rows` looked-up rows of `width` entries per
    member and step (IndexedSlices, duplicates included), all-gathered as they are,
    never through the codec: the values in the compressor's `sparse_values_dtype` (fp16
    and bf16 halve them) and one index of `index_dtype` per row."""
    values = get(compressor).sparse_values_dtype(dtype) or dtype
    return BucketPayload(0, 0, ((GATHER, rows * (width * values.size + index_dtype.size)),))


def bucket_payload(compressor: Compressor, layout: Layout, workers: int) -> BucketPayload:
    """One bucket's payload under `compressor` among `workers` (its chunks' too, where
    they may travel in two phases)."""
    chunks = None
    if (not compressor.summable and compressor.splittable and workers > 1
            and layout.numel >= workers):
        chunks = two_phase.payload_bytes(compressor, layout, workers)
    return BucketPayload(layout.numel, layout.numel * layout.dtype.size,
                         bucket_rounds(compressor, layout), chunks)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One compressor and exchange, priced.

    Attributes:
      compressor: its name.
      exchange: "ring", "tree", "gather", "two_phase" or "hierarchical".
      bytes_per_worker: bytes one worker sends per step.
      wire_s: seconds on the link per step.
      codec_s: seconds of compression and decoding per step.
      compute_s: seconds of compute per step.
      step_s: predicted seconds per step.
    """

    compressor: str
    exchange: str
    bytes_per_worker: float
    wire_s: float
    codec_s: float
    compute_s: float
    step_s: float


def exchanges_for(compressor: Compressor | str, local: int = 1) -> tuple[str, ...]:
    """The exchanges a compressor's payloads can travel in between workers of `local`
    devices each: summed ones in a ring or a tree among workers of one device, in the
    hierarchical exchange among workers of several (what `CompressedAllReduce` runs
    there); gathered ones in a gather or, where they can be cut into chunks
    (`splittable`), two phases."""
    compressor = get(compressor)
    if compressor.summable:
        return ("hierarchical",) if local > 1 else ALL_REDUCES[:2]
    return ("gather", "two_phase") if compressor.splittable else ("gather",)


def predict(compressor: Compressor | str, payloads: Sequence[BucketPayload], exchange: str,
            workers: int, link: Link, compute_s: float, throughput: float | None = None,
            overlap: float = 0.0, cpu_share: float = 1.0, local: int = 1,
            local_link: Link | None = None, jit_compile: bool = True,
            call_s: float = 0.0) -> Prediction:
    """Predicted step of one compressor and exchange.

    step = compute + max(last bucket's exchange, codec + wire - overlap * compute):
    exchanges run one after another; with `overlap` > 0 they may start while
    backprop still runs (a share `overlap` of the compute), except the last bucket,
    which is ready only when backprop ends. `CompressedAllReduce` gets every gradient
    in one call, but each bucket's ops wait only for its own gradients, so several
    buckets do overlap backprop; 0, the default, is the conservative prediction.

    Args:
      compressor: a name or instance (names the row; its payloads are `payloads`).
      payloads: `model_payloads` of this compressor among all N L devices.
      exchange: one of `exchanges_for(compressor, local)`.
      workers: N.
      link: between workers.
      compute_s: seconds of forward and backward per step.
      throughput: compress + decompress bytes of input per second on one core
        (default: `THROUGHPUT`); with `call_s`, the rate beyond that fixed part.
      overlap: share of the compute that exchanges may hide behind, in [0, 1].
      cpu_share: cores per worker when workers share cores (e.g. 0.5: two workers on
        one core); codec time scales by its inverse when below 1.
      local: L, devices per worker (the codec runs on each device at once).
      local_link: between a worker's devices (default: `link`).
      jit_compile: whether the ops compile their decodings (`CompressedAllReduce`'s
        setting): a gather's further payloads then cost `DECODE_SHARE_COMPILED` of a
        round trip each where the compressor's decodings compile, else `DECODE_SHARE`.
        Buckets under `xla.MIN_COMPILED_NUMEL` run uncompiled but are priced by this
        setting too: a codec call of their size costs about the same either way.
      call_s: seconds of one call of the data path on one core whatever its length
        (`measure_codec`): a bucket is one call, except in two phases, where each of
        the N L chunks is encoded by a call of its own.

    Raises:
      ValueError: for an exchange the compressor's payloads cannot travel in, or an
        argument outside its range.
    """
    c = get(compressor)
    valid = exchanges_for(c, local)
    if exchange not in valid:
        raise ValueError(f"{c.name} cannot travel in {exchange!r}; valid: {', '.join(valid)}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    if not cpu_share > 0:
        raise ValueError(f"cpu_share must be > 0, got {cpu_share!r}")
    if not compute_s >= 0:
        raise ValueError(f"compute_s must be >= 0, got {compute_s!r}")
    if not call_s >= 0:
        raise ValueError(f"call_s must be >= 0, got {call_s!r}")
    if workers * local == 1:      # TensorFlow reduces nothing and never calls the ops
        return Prediction(c.name, exchange, 0.0, 0.0, 0.0, compute_s, compute_s)
    rate = throughput or THROUGHPUT.get(c.name, DEFAULT_THROUGHPUT)
    # Each device decodes the payloads of all N L members.
    n, sent, wire, codec, last = workers * local, 0.0, 0.0, 0.0, 0.0
    for b in payloads:
        roundtrip = b.dense_bytes / rate
        if exchange == "two_phase" and b.chunks is not None:
            _, chunk, server = b.chunks
            kind_bytes = [("two_phase", chunk, server)]
            # Chunks encoded, N chunk payloads decoded, the owned chunk re-encoded and
            # N re-encoded chunks decoded: about 1.5 + 0.5/N round trips.
            work = roundtrip * (1 + DECODE_SHARE + DECODE_SHARE / n) + n * call_s
        else:
            # SUM rounds are all-reduced (by `exchange` if it is an all-reduce),
            # GATHER rounds all-gathered (also a two-phase bucket too small to cut).
            reduce = (exchange if exchange in ALL_REDUCES
                      else "hierarchical" if local > 1 else "ring")
            kind_bytes = [("gather" if t == GATHER else reduce, p, None) for t, p in b.rounds]
            gathered = any(t == GATHER for t, _ in b.rounds)
            share = DECODE_SHARE_COMPILED if jit_compile and c.xla_decode else DECODE_SHARE
            work = roundtrip * (1 + (n - 1) * share if gathered else 1) + (
                call_s if b.numel else 0.0)
        w = sum(exchange_seconds(k, workers, p, link, s, local, local_link)
                for k, p, s in kind_bytes)
        sent += sum(bytes_sent(k, workers, p, s, local) for k, p, s in kind_bytes)
        work /= min(cpu_share, 1.0)
        wire, codec, last = wire + w, codec + work, w + work
    exposed = max(last, wire + codec - overlap * compute_s)
    return Prediction(c.name, exchange, sent, wire, codec, compute_s, compute_s + exposed)


def choose_exchange(compressor: Compressor, layout: Layout, members: int,
                    jit_compile: bool = True, link: Link = Link()) -> str:
    """"gather" or "two_phase" for one bucket whose payloads cannot be summed ("gather"
    for a compressor whose payload cannot be cut, `splittable`): the cheaper as
    `predict` prices them, wire and codec, on `link` (by default 50 us per
    message and 1 Gbit/s) at the compressor's default codec rate (`THROUGHPUT`).

    The codec matters as much as the bytes: two phases re-compress each owner's chunk
    and decode the chunks twice, while compiled decodings (`jit_compile`) sum N gathered
    payloads for little more than one. So small payloads (top-k, sign) gather up to 5
    members and go in two phases from 6 to 8 on, and int8's (a quarter of the bucket)
    from 3. At N = 2 both move the same bytes and gathering compresses once.

    Args:
      compressor: the bucket's compressor (as `CompressedAllReduce` wraps it).
      layout: the bucket's layout.
      members: replicas of the reduction, at least 2, at most `layout.numel`.
      jit_compile: whether decodings compile (`CompressedAllReduce`'s setting).
      link: the link priced.
    """
    if not compressor.splittable:
        return "gather"
    payload = bucket_payload(compressor, layout, members)
    rate = THROUGHPUT.get(compressor.codec().name, DEFAULT_THROUGHPUT)
    price = {ex: predict(compressor, [payload], ex, members, link, 0.0, rate,
                         jit_compile=jit_compile).step_s for ex in ("gather", "two_phase")}
    return "two_phase" if price["two_phase"] < price["gather"] else "gather"


def roundtrip_fn(compressor: Compressor, layout: Layout, replicas: int = 1,
                 measure_error: bool = False, jit_compile: bool = True):
    """A tf.function running one compress + decompress of a bucket laid out as `layout`
    (one replica, every round through the protocol driver, state kept between calls);
    it returns the result and the payload bytes sent.

    With `replicas` > 1 and `measure_error` it runs the whole data path a bucket takes
    in a step of that many replicas (prescale, compress with error feedback, decode, the
    compression error), its own payload standing in for the others'. It reduces with
    SUM, as optimizers reduce gradients (Keras's `apply_gradients`): a MEAN would add a
    pass over the result that training steps do not take.
    """
    state = {name: _tf_compat.plain_variable(lambda s=spec: s.initializer(s.shape, s.dtype),
                                             name=name)
             for name, spec in compressor.state_spec(layout).items()}
    step = tf.Variable(STEADY_STEP, dtype=tf.int64)

    def exchange(messages):
        # One replica: each round's sum (or gather) is its own payload.
        received, _ = driver.local_exchange(messages)
        return received, nbytes(messages[0].payload)

    @tf.function
    def run(x):
        ctx = Context(state=state, step=step.read_value(), seed=tf.stack([step, 7]),
                      layout=layout, num_replicas=replicas,
                      jit_compile=xla.compiles(jit_compile, layout.numel))
        outcome = driver.run(compressor, [x], [ctx], exchange, measure_error=measure_error)
        step.assign_add(1)
        if measure_error:     # as the stats read it, so that it is computed
            return outcome.results[0], outcome.bytes, outcome.error_sq, outcome.norm_sq
        return outcome.results[0], outcome.bytes
    return run


def matrix_shape(numel: int) -> tuple[int, int]:
    """The most nearly square [rows, cols] holding `numel` elements, as a weight matrix
    (PowerSGD compresses matrices; every other compressor only sees the element count)."""
    cols = math.isqrt(numel)
    while numel % cols:
        cols -= 1
    return numel // cols, cols


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    """Median wall seconds of `fn()` over `repeats` calls after one untimed call (which
    traces and warms up), waiting for every tensor it returns; also that first result
    (as numpy values)."""
    first = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(_wait, fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times)), first


def _wait(t):
    """Waits for `t` by fetching one entry: the slice runs after whatever made `t`, on a
    GPU's stream too. Fetching all of it would time a copy that training never makes: a
    25M-entry result took 15-19 ms to copy out, on one core, as much as some codecs."""
    if hasattr(t, "numpy"):
        tf.reshape(t, [-1])[:1].numpy()


def measure_throughput(compressor: Compressor | str, numel: int, repeats: int = 5,
                       data_path: bool = True, jit_compile: bool = True) -> dict:
    """Times compress + decompress of `numel` float32 elements (one weight matrix) on
    this machine's current threads: `{"seconds": median, "bytes_per_s": of input,
    "payload_bytes": sent}`.

    Args:
      compressor: a name or instance.
      numel: elements of the matrix.
      repeats: timed calls (after one untimed).
      data_path: time what a step does around the codec too (`roundtrip_fn` with two
        replicas and the error measurement): the throughput the cost model prices a
        step with, and what every calibration uses. False: the codec alone (the micro
        benchmark's figure).
    """
    compressor = get(compressor)
    x = tf.random.stateless_normal([numel], (1, 2))
    layout = Layout((matrix_shape(numel),))
    run = (roundtrip_fn(compressor, layout, replicas=2, measure_error=True,
                        jit_compile=jit_compile)
           if data_path else roundtrip_fn(compressor, layout, jit_compile=jit_compile))
    sec, first = median_seconds(lambda: run(x), repeats)
    return {"seconds": sec, "bytes_per_s": numel * 4 / sec, "payload_bytes": int(first[1])}

def measure_codec(compressor: Compressor | str, numel: int, repeats: int = 3,
                  jit_compile: bool = True) -> tuple[float, float]:
    """The data path's cost on this machine's current threads as `(bytes_per_s,
    call_s)`: timed (`measure_throughput`) on `numel` entries and on `numel //
    CALL_SPLIT`, and fitted as `call_s` per call (at most half the longer call) plus
    bytes of input at `bytes_per_s`.

    A call has costs its length does not change (launching its ops and compiled
    clusters, small reductions and selections): one core, the data path of 125K
    entries took 0.42-1.67 ms against 1.07-6.66 for 1M (BENCHMARKS.md, "Codec calls").
    Two phases make N such calls per bucket where one length-priced call would
    count once (`predict`'s `call_s`).

    Example:
      >>> rate, call = measure_codec("sign", 1 << 20)
    """
    long = measure_throughput(compressor, numel, repeats, jit_compile=jit_compile)["seconds"]
    short = measure_throughput(compressor, max(1, numel // CALL_SPLIT), repeats,
                               jit_compile=jit_compile)["seconds"]
    call = min(max(0.0, (CALL_SPLIT * short - long) / (CALL_SPLIT - 1)), long / 2)
    return numel * 4 / (long - call), call


__all__ = ["BucketPayload", "CALL_SPLIT", "DECODE_SHARE", "DECODE_SHARE_COMPILED",
           "DEFAULT_THROUGHPUT", "Prediction", "STEADY_STEP", "THROUGHPUT", "bucket_payload",
           "bucket_rounds", "choose_exchange", "exchanges_for", "matrix_shape", "measure_codec",
           "measure_throughput", "median_seconds", "model_payloads", "predict", "roundtrip_fn"]
