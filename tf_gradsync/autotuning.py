"""Autotune: measure the link, the compressors and the step, then let the cost model
choose the compressor, `bucket_bytes` and exchange.

`autotune(strategy, model, compute=...)` probes the strategy's real link with exact
all-reduces of several sizes (fitting latency and bandwidth) and one all-to-all of tiny
parts (the fixed cost of two phases' rounds), times each candidate
compressor's compress + decompress on this machine and the step's compute, averages
every measurement over the workers (so each worker reaches the same decision), prices
every candidate with `tf_gradsync.costmodel`, then times the few it predicts fastest on
the real job (trials: gradient-sized tensors reduced through each, or with
`make_step` the job's own step) and returns (and installs) the fastest measured
`CompressedAllReduce` within the accuracy class asked for. The model narrows the field;
the trials decide, because what the model leaves out (workers sharing cores, the
runtime's cost per collective round, how much of the exchange hides behind backprop)
can change the order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tf_gradsync import _tf_compat, algorithms, compression, costmodel
from tf_gradsync.algorithms.cost import ALL_REDUCES, Link
from tf_gradsync.bucketing import plan_buckets
from tf_gradsync.compression.base import SCATTER
from tf_gradsync.config import DEFAULT_BUCKET_BYTES
from tf_gradsync.cross_device_ops import CompressedAllReduce

#: Accuracy classes, each including the ones before it (see `Compressor.accuracy`).
CLASSES = ("lossless", "balanced", "aggressive")
#: Candidate bucket sizes.
BUCKET_SIZES = (4 * 2**20, 32 * 2**20, 128 * 2**20)
#: Bytes of the probing all-reduces.
PROBE_BYTES = (2**12, 2**16, 2**20, 2**23)
#: Turns of each finalist in a run-off (see `autotune`'s `runoff`).
RUNOFF_ROUNDS = 3
#: The devices' legs of a hierarchical exchange, as `decide` prices them: free, since
#: the link between workers is fitted to probes that include them (`fit_link`).
_WITHIN_LINK = Link(0.0, float("inf"))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What autotune chose, and what it expects.

    Attributes:
      compressor: the chosen compressor: its name, or the instance that `autotune`'s
        `compressors` listed.
      exchange: "ring", "tree", "hierarchical", "gather" or "two_phase" (see
        `costmodel`).
      bucket_bytes: the chosen bucket size.
      predicted_step_s: its predicted step.
      predicted_speedup: uncompressed training's best predicted step over it.
      link: the link it was priced on.
      compute_s: the step's compute it was priced with.
      candidates: every priced `(compressor, exchange, bucket_bytes, step_s)`.
      trials: the candidates timed on the job, `(compressor, exchange, bucket_bytes,
        predicted step_s, measured step_s)`, in the order timed (empty when none were
        timed: one replica, or `trials=0`); a candidate the step's optimizer cannot
        train with (`compression.OptimizerRefused`) measures infinity.
      runoff: the two fastest trials when they were timed again in turns, with the
        run-off's step in place of the trial's (empty when there was none).
      measured_step_s: the chosen candidate's measured step (compute plus the timed
        reduction, or the timed step with `make_step`; the run-off's when there was
        one), or None without trials.
      guard: whether the ops watch their compression error (`CompressedAllReduce`'s
        `guard`): True, False, or None for compressors of the "aggressive" class
        only (see `autotune`); never in two phases, where no replica holds a whole
        bucket.
    """

    compressor: Any         # a name, or an instance from `compressors`
    exchange: str
    bucket_bytes: int
    predicted_step_s: float
    predicted_speedup: float
    link: Link
    compute_s: float
    candidates: tuple = ()
    trials: tuple = ()
    runoff: tuple = ()
    measured_step_s: float | None = None
    guard: bool | None = False

    def ops(self, **kwargs) -> CompressedAllReduce:
        """The `CompressedAllReduce` of this decision (`kwargs`: its other arguments)."""
        exchange = self.exchange if self.exchange in ("gather", "two_phase") else "auto"
        guard = (self.guard if self.guard is not None
                 else compression.get(self.compressor).accuracy == CLASSES[-1])
        return CompressedAllReduce(self.compressor, bucket_bytes=self.bucket_bytes,
                                   exchange=exchange, guard=guard and exchange != "two_phase",
                                   **kwargs)


def candidates(accuracy: str) -> list[str]:
    """Registered compressors whose `accuracy` is within the class `accuracy`.

    Raises:
      ValueError: for an unknown class.
    """
    if accuracy not in CLASSES:
        raise ValueError(f"unknown accuracy class {accuracy!r}; valid: {', '.join(CLASSES)}")
    allowed = CLASSES[:CLASSES.index(accuracy) + 1]
    return [n for n in compression.names() if compression.get(n).accuracy in allowed]


def decide(specs: Sequence[tuple[Sequence[int], tf.DType]], workers: int, link: Link,
           compute_s: float, compressors: Sequence[str],
           throughput: dict[str, float] | None = None,
           bucket_sizes: Sequence[int] = BUCKET_SIZES, overlap: float = 0.0,
           cpu_share: float = 1.0, call_s: dict[str, float] | None = None,
           local: int = 1) -> Decision:
    """The fastest predicted `(compressor, exchange, bucket_bytes)` among `compressors`.

    Pure: the same arguments give the same decision on every worker. Ties go to the
    compressor listed first, then the smaller bucket.

    Args:
      specs: `(shape, dtype)` per trainable weight.
      workers: replicas of the reduction; with `local` > 1, the workers (of `local`
        replicas each).
      link: the link between them (between workers, their devices' legs included:
        `autotune` fits it to the exchange its devices run, see `fit_link`).
      compute_s: forward + backward seconds per step.
      compressors: candidate names (`none` is priced as the reference in any case).
      throughput: compress + decompress bytes/s per name (default: the cost model's).
      call_s: seconds per data path call by name (`costmodel.measure_codec`; default 0).
      bucket_sizes: candidate `bucket_bytes`.
      overlap, cpu_share: see `costmodel.predict`.
      local: devices per worker; summed payloads are then priced in the hierarchical
        exchange, gathered ones among every device.
    """
    priced, reference = [], float("inf")
    for bucket_bytes in bucket_sizes:
        for name in dict.fromkeys(["none", *compressors]):
            c = CompressedAllReduce(name, bucket_bytes=bucket_bytes).compressor
            payloads = costmodel.model_payloads(c, specs, bucket_bytes, workers * local)
            rate = (throughput or {}).get(name)
            for exchange in costmodel.exchanges_for(c, local):
                p = costmodel.predict(c, payloads, exchange, workers, link, compute_s, rate,
                                      overlap, cpu_share, local, _WITHIN_LINK,
                                      call_s=(call_s or {}).get(name, 0.0))
                if name == "none":
                    reference = min(reference, p.step_s)
                if name in compressors:
                    priced.append((name, exchange, bucket_bytes, float(p.step_s)))
    if not priced:
        raise ValueError("no candidate compressor to choose from")
    order = {n: i for i, n in enumerate(compressors)}
    best = min(priced, key=lambda r: (round(r[3], 9), order[r[0]], r[2]))
    return Decision(best[0], best[1], best[2], best[3], reference / best[3], link, compute_s,
                    tuple(priced))


def fit_link(sizes: Sequence[float], seconds: Sequence[float], members: int,
             all_to_all_s: float | None = None, local: int = 1) -> Link:
    """Latency and bandwidth from timed ring all-reduces of `sizes` bytes, and the cost
    of an all-to-all round from a timed all-to-all of tiny parts (`all_to_all_s`, see
    `probe_all_to_all`; None leaves `Link.round_s` unset).

    A ring all-reduce of S bytes among N members takes 2(N-1) latencies and moves
    2(N-1)/N S bytes: a line in S, drawn here through the smallest all-reduce (nearly
    all latency) and the largest (nearly all bandwidth). Real links bend that line:
    large transfers run below the rate small ones see (the transport's CPU work), so a
    least-squares line through every size let the largest one's shortfall set the
    latency. Measured with 4 workers sharing 2 cores at 100 Mbit/s: 4 KiB and 64 KiB
    took 13 ms (2.2 ms a message), 8 MiB ran at 85% of the link, and least squares
    fitted 0.17 ms a message, under-predicting PowerSGD's many small exchanges by 45%.
    One size gives all of its time to bandwidth; where noise leaves the largest no
    slower than the smallest, the bandwidth is the steepest seen. A latency below a
    microsecond is clamped to one.

    With `local` > 1 devices per worker, `members` workers and the all-reduces
    hierarchical (`CompressedAllReduce`'s): their legs among a worker's devices are
    fitted into the workers' link (and priced nowhere else, `decide`), and the
    all-to-all ran among all `members * local` devices.
    """
    s, t = np.asarray(sizes, float), np.asarray(seconds, float)
    n = max(members, 2)
    moved = 2 * (n - 1) / n
    small, large = int(np.argmin(s)), int(np.argmax(s))
    if s[large] > s[small] and t[large] > t[small]:
        per_byte = (t[large] - t[small]) / (moved * (s[large] - s[small]))
    else:
        per_byte = float(min(t / (moved * s)))
    latency = max((t[small] - moved * s[small] * per_byte) / (2 * (n - 1)), 1e-6)
    rounds = (None if all_to_all_s is None
              else all_to_all_s / algorithms.cost.all_to_all_rounds(max(members * local, 2)))
    return Link(float(latency), float(1.0 / per_byte), rounds)


def probe_link(strategy: tf.distribute.Strategy, sizes: Sequence[int] = PROBE_BYTES,
               repeats: int = 5) -> list[float]:
    """Median seconds of an exact all-reduce of each of `sizes` bytes (float32) through
    `strategy`'s cross-device ops, on this worker."""
    out = []
    for size in sizes:
        numel = max(1, size // 4)

        @tf.function
        def step(numel=numel):
            def fn():
                # Made on each replica's device: what is timed is the exchange.
                x = tf.ones([numel], tf.float32)
                return tf.distribute.get_replica_context().all_reduce("SUM", x)
            return strategy.experimental_local_results(strategy.run(fn))[0]
        out.append(costmodel.median_seconds(step, repeats)[0])
    return out


def probe_all_to_all(strategy: tf.distribute.Strategy, repeats: int = 5,
                     timeout: float = 0) -> float:
    """Median seconds of one all-to-all of one-word parts among `strategy`'s replicas,
    run as two phases run theirs (`algorithms.pairwise`: rounds of two-member
    collectives): what its rounds cost beyond their bytes. Every worker must call it
    (with the same `repeats`); `timeout` bounds the wait for a missing peer."""
    devices = tuple(strategy.extended.worker_devices)
    worker, workers = _tf_compat.worker_position(strategy)
    group = algorithms.Group(devices, workers, worker, timeout)
    if group.size < 2:
        return 0.0

    @tf.function
    def step():
        parts = []
        for d in devices:
            with tf.device(d):
                parts.append([(tf.fill([1], float(m)),) for m in range(group.size)])
        got = algorithms.TWO_PHASE(parts, SCATTER, group, algorithms.Wire())
        return [p[-1][0] for p in got]
    return costmodel.median_seconds(step, repeats)[0]


#: One summing function per strategy, traced once for any number of values (a new
#: function per call made TensorFlow warn the user of retracing).
_TOTALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mean_over_workers(strategy: tf.distribute.Strategy, values: Sequence[float]) -> list[float]:
    """Every worker's `values` averaged (exactly): every worker gets the same numbers."""
    total = _TOTALS.get(strategy)
    if total is None:
        owner = weakref.ref(strategy)          # the entry must not keep its key alive

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def total(v):
            s = owner()
            return s.reduce("SUM", s.run(lambda: tf.identity(v)), axis=None)
        _TOTALS[strategy] = total
    summed = total(tf.constant(values, tf.float32)).numpy()
    return [float(x) / strategy.num_replicas_in_sync for x in summed]


def _specs(weights, sparse_as_dense: bool = False) -> list[tuple[tuple[int, ...], tf.DType]]:
    if hasattr(weights, "trainable_weights"):
        weights = (weights.trainable_weights if sparse_as_dense
                   else _tf_compat.dense_gradient_weights(weights))
    out = []
    for w in weights:
        if isinstance(w, tuple) and len(w) == 2:
            out.append((tuple(int(d) for d in w[0]), tf.as_dtype(w[1])))
        else:
            out.append((tuple(int(d) for d in w.shape), tf.as_dtype(w.dtype)))
    return out


def autotune(strategy: tf.distribute.Strategy, weights, *, compute: float | Callable[[], Any],
             accuracy: str = "balanced", compressors: Sequence[str] | None = None,
             bucket_sizes: Sequence[int] = BUCKET_SIZES, probe_bytes: Sequence[int] = PROBE_BYTES,
             calibrate_numel: int = 2**20, overlap: float = 0.0, trials: int = 4,
             trial_steps: int = 5, runoff: float = 0.1,
             make_step: Callable[[CompressedAllReduce], Callable[[], Any]] | None = None,
             guard: bool | None = None, install: bool = True, verbose: bool = True,
             **ops_kwargs) -> CompressedAllReduce:
    """Measures, decides (`decide`) and returns a ready `CompressedAllReduce`.

    Call it after creating the strategy and before building the model's training
    step: it probes the link through the strategy's exact cross-device ops, so these
    must not compress yet (TensorFlow's own, or a `CompressedAllReduce("none")`). With
    `install` (default) the chosen ops replace the strategy's (a
    `tf_gradsync.MultiWorkerMirroredStrategy` or a `tf.distribute.MirroredStrategy`).

    Args:
      strategy: the strategy training will run under.
      weights: a Keras model (its trainable weights less its Embedding tables, whose
        gradients are the rows looked up, gathered uncompressed: left out of the
        pricing, with fp16's and bf16's halving of their values and their share of the
        step; with `sparse_as_dense=True` in `ops_kwargs` the tables too), a list of
        variables or of `(shape, dtype)` pairs.
      compute: forward + backward seconds per step, or a function running one such
        step (without gradient synchronisation), timed here.
      accuracy: "lossless" (none, fp16, bf16), "balanced" (adds the compressors within
        about a point of uncompressed training on every measured recipe) or
        "aggressive" (every compressor); see `Compressor.accuracy`.
      compressors: the candidates instead of the class's (names or instances).
      bucket_sizes: candidate `bucket_bytes`.
      probe_bytes: sizes of the probing all-reduces.
      calibrate_numel: elements each candidate compresses when timed (and an eighth
        of it, for the cost of a call whatever its length: `costmodel.measure_codec`).
      overlap: see `costmodel.predict` (0, the conservative default, assumes no
        exchange hides behind backprop).
      trials: how many candidates (each compressor and exchange at the default
        `bucket_bytes` where it is among `bucket_sizes`, else at its best predicted
        size) to time on the job before choosing: the fastest predicted of each
        kind of exchange, then the fastest predicted of the rest; the fastest of them
        is then timed at each other bucket size that groups the tensors differently.
        0 or 1 takes the prediction as it is.
      trial_steps: timed reductions per trial (after one that traces), in the
        compressor's steady state (past its warm-up).
      runoff: when the two fastest trials are within this fraction of each other,
        they are timed again, in turns (`RUNOFF_ROUNDS` of `trial_steps` each), and
        the faster there is chosen: a few steps timed minutes apart can order two
        close candidates by what else the machines did then. 0 turns it off.
      make_step: builds a step function of the job from the trial's
        `CompressedAllReduce`: one that runs forward, backward, the gradients'
        reduction through the strategy and, best, the optimizer's update with the
        optimizer the job will use with those ops (`ops.adapt_optimizer(...)`: an
        adapted optimizer may drop its momentum, and with it a pass over the model
        each step). It is called once per trial, after the trial's ops are
        installed, and must build a new function each time (e.g. a new
        `tf.function`), so that what it traces uses them; the trials then time that
        step instead of a reduction of gradient-sized tensors added to `compute`.
        This is what the job will run: the exchanges overlapping backprop, the
        codecs sharing cores with it, and the update. The trials train: the
        variables of `weights` (a model's, trainable or not) are restored after
        each; optimizers built by `make_step` are the caller's to discard.
      guard: whether the chosen ops watch each bucket's compression error and send a
        bucket that loses almost everything in fp16 (`CompressedAllReduce`'s
        `guard`; never when they exchange in two phases). None (default): where the
        pick is of the "aggressive" class, whose compressors can lose a recipe's
        accuracy at settings users reach for. The others stay within about a point
        of uncompressed training, and their error can approach the guard's bound in
        healthy training: PowerSGD's on the digits residual network under SGD with
        momentum rose to 0.995 by its 14th epoch, at 0.997 test accuracy, and the
        guard would have sent it in fp16 from there. The trials time the ops as
        chosen; the cost model prices them unguarded (the guard adds 8 bytes per
        bucket, riding on a round, and a few scalar ops).
      install: make the strategy use the result.
      verbose: print the decision (and each trial) as well as logging it (absl's INFO,
        which scripts outside `absl.app` do not show).
      **ops_kwargs: further `CompressedAllReduce` arguments (e.g. `timeout_seconds`).

    Returns:
      The chosen `CompressedAllReduce`; its `decision` attribute is the `Decision`.

    Raises:
      ValueError: for an unknown accuracy class or compressor, `weights` with none to
        train, a strategy whose ops already compress or that takes no cross-device
        ops (with `install`), a `compute` that is neither a finite number nor
        callable, `trials`, `trial_steps`, `runoff`, `bucket_sizes`, `probe_bytes` or
        `ops_kwargs` that `CompressedAllReduce` refuses, or a `make_step` that is not
        callable or that returns the same function twice; all before anything is
        measured but the last.

    Example:
      >>> strategy = tf_gradsync.MultiWorkerMirroredStrategy()
      >>> with strategy.scope():
      ...     model = build_model()
      >>> ops = tf_gradsync.autotune(strategy, model, compute=0.25)
      >>> with strategy.scope():   # DGC refuses an optimizer with momentum of its own
      ...     opt = ops.adapt_optimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
      >>> model.compile(optimizer=opt, ...); model.fit(...)
    """
    for arg, value, low in (("trials", trials, 0), ("trial_steps", trial_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
    if isinstance(runoff, bool) or not isinstance(runoff, numbers.Real) or not runoff >= 0:
        raise ValueError(f"runoff must be a fraction >= 0, got {runoff!r}")
    if make_step is not None and not callable(make_step):
        raise ValueError(f"make_step must build a step function, got {make_step!r}")
    if guard is not None and not isinstance(guard, (bool, np.bool_)):
        raise ValueError(f"guard must be True, False or None, got {guard!r}")
    # Numpy's numbers pass the checks; the decision keeps Python's.
    trials, trial_steps, runoff = int(trials), int(trial_steps), float(runoff)
    guard = None if guard is None else bool(guard)
    if isinstance(compressors, str):
        raise ValueError(f"compressors must be a list of names, got the string {compressors!r}"
                         f" (one: [{compressors!r}])")
    allowed = candidates(accuracy)            # a clear error for an unknown class
    names = list(compressors) if compressors is not None else allowed
    for n in names:
        compression.get(n)                     # a clear error for an unknown name
    for b in bucket_sizes:                     # and for sizes or arguments the ops refuse
        try:
            CompressedAllReduce("none", bucket_bytes=b, **ops_kwargs)
        except TypeError as e:                 # an argument it does not have
            raise ValueError(f"autotune: {e}") from None
    if len({b for b in probe_bytes if _positive_int(b)}) < 2 or not all(
            _positive_int(b) for b in probe_bytes):
        raise ValueError(f"probe_bytes must be two or more sizes in bytes (integers >= 1), "
                         f"got {probe_bytes!r}")
    if not bucket_sizes:
        raise ValueError("bucket_sizes must hold one or more sizes in bytes, got none")
    if install or (trials > 1 and strategy.num_replicas_in_sync > 1):    # trials install too
        _check_installable(strategy)
    current = _tf_compat.cross_device_ops_of(strategy)
    if isinstance(current, CompressedAllReduce) and current.compressor.name != "none":
        raise ValueError(f"autotune probes the link with exact all-reduces, but the strategy "
                         f"already uses {current!r}; create it without cross_device_ops or "
                         "with CompressedAllReduce('none')")
    specs = _specs(weights, bool(ops_kwargs.get("sparse_as_dense")))
    if not specs:
        raise ValueError(f"autotune needs the weights the gradients are of, got none in "
                         f"{type(weights).__name__}; build the model first (a keras.Input or "
                         "model.build(shape))")
    if callable(compute):
        compute_s = costmodel.median_seconds(compute, 3)[0]
    elif (isinstance(compute, numbers.Real) and not isinstance(compute, bool)
          and math.isfinite(compute) and compute >= 0):
        compute_s = float(compute)
    else:
        raise ValueError(f"compute must be seconds per step (finite, >= 0) or a function "
                         f"running one step, got {compute!r}")
    workers, local = _members(strategy)
    # The all-reduces' seconds, then the all-to-all's.
    probe = ([*probe_link(strategy, probe_bytes),
              probe_all_to_all(strategy, timeout=ops_kwargs.get("timeout_seconds") or 0)]
             if strategy.num_replicas_in_sync > 1 else [])
    priced = list(dict.fromkeys(["none", *names]))
    codecs = [x for n in priced for x in
              costmodel.measure_codec(CompressedAllReduce(n).compressor, calibrate_numel)]
    measured = _mean_over_workers(strategy, [*probe, compute_s, *codecs])
    probe, compute_s = measured[:len(probe)], measured[len(probe)]
    codecs = measured[len(probe) + 1:]
    throughput, calls = dict(zip(priced, codecs[0::2])), dict(zip(priced, codecs[1::2]))
    # The probes ran hierarchically through CompressedAllReduce("none"); TensorFlow's own
    # collectives all-reduce among every device at once.
    flat = local > 1 and not isinstance(current, CompressedAllReduce)
    link = (fit_link(probe_bytes, probe[:-1], workers * local if flat else workers, probe[-1],
                     1 if flat else local) if probe else Link())
    decision = dataclasses.replace(
        decide(specs, workers, link, compute_s, names, throughput, bucket_sizes, overlap,
               call_s=calls, local=local), guard=guard)
    if trials > 1 and probe:
        decision = _try(strategy, specs, decision, trials, trial_steps, current, ops_kwargs,
                        make_step, weights, runoff)
    ops = decision.ops(**ops_kwargs)
    ops.decision = decision
    lines = [f"tf_gradsync.autotune trial: {name}, exchange {exchange}, bucket_bytes "
             f"{bucket_bytes}: predicted {predicted:.4g} s, " + (
                 f"measured {measured:.4g} s per step" if math.isfinite(measured)
                 else "refused by the step's optimizer")
             for name, exchange, bucket_bytes, predicted, measured in decision.trials]
    lines += [f"tf_gradsync.autotune run-off: {name}, exchange {exchange}, bucket_bytes "
              f"{bucket_bytes}: measured {measured:.4g} s per step"
              for name, exchange, bucket_bytes, _, measured in decision.runoff]
    lines.append(
        f"tf_gradsync.autotune: {ops.compressor!r}, exchange {decision.exchange}, bucket_bytes "
        f"{decision.bucket_bytes}: predicted {decision.predicted_step_s:.4g} s per step, "
        f"{decision.predicted_speedup:.2f}x uncompressed (link {link.latency_s * 1e6:.3g} us, "
        f"{link.bytes_per_s * 8e-9:.4g} Gbit/s, all-to-all rounds "
        f"{link.round_seconds * 1e6:.3g} us; compute {compute_s:.4g} s; "
        f"{strategy.num_replicas_in_sync} replicas); train with the optimizer "
        "ops.adapt_optimizer(optimizer) returns")
    for line in lines:
        logging.info("%s", line)
        if verbose:
            print(line, flush=True)
    if install:
        _install(strategy, ops)
    return ops


def _try(strategy: tf.distribute.Strategy, specs, decision: Decision, trials: int, steps: int,
         exact, ops_kwargs: dict, make_step=None, weights=(), runoff: float = 0.0) -> Decision:
    """Times candidates on the job and returns the decision for the fastest measured one
    (ties: the faster predicted).

    First `trials` candidates, each compressor at most once per kind of exchange
    (all-reduce, gather, two phases) and at the default bucket size where it is a
    candidate: the fastest predicted of each kind, then the fastest predicted of the
    rest. Then the winner at each other bucket size that cuts the model differently:
    the model prices fewer, larger buckets as cheaper, but leaves out the copies that
    fuse several tensors into one and the overlap of buckets. Then, when the two
    fastest are within `runoff` of each other, a run-off between them. A compressor the
    step's optimizer refuses (`compression.OptimizerRefused`) measures infinity, and its
    trials go to the next candidates of other compressors.

    Each candidate runs the step `make_step` builds or, without it, reduces the same
    gradient-sized tensors (normal noise, different on every replica) through the
    strategy, as a training step's gradients are: the buckets, codecs, collectives and
    the waiting for peers that the cost model can only estimate. A reduction's median
    is added to the measured compute. Timings are averaged over the workers through
    `exact` (the strategy's ops before autotune), so every worker makes the same
    choices.
    """
    priced = sorted(decision.candidates, key=lambda r: r[3])
    best = {}
    for row in priced:
        # Each compressor once per kind of exchange (a ring and a tree are priced
        # apart, but `Decision.ops` leaves the all-reduce's algorithm to the ops),
        # ranked by its fastest price and timed at the default bucket size where that
        # is a candidate: the model leaves out how buckets overlap backprop and one
        # another, so it favours the largest, which the job's trials found 0-25%
        # slower than 4 MiB (BENCHMARKS.md, "A run-off between close trials").
        key = (row[0], _kind(row[1]))
        if key not in best or (row[2] == DEFAULT_BUCKET_BYTES
                               and best[key][2] != DEFAULT_BUCKET_BYTES):
            best[key] = row                    # keeps the key's place in the ranking
    ranked = list(best.values())
    # The fastest predicted of each kind of exchange first, then the fastest of the
    # rest: the model's errors are shared within a kind (the same collective rounds,
    # the same codec work per round), so a miss there must not crowd out the others.
    kinds = {}
    for row in ranked:
        kinds.setdefault(_kind(row[1]), row)
    first = list(kinds.values())[:trials]
    tried = sorted(first + [r for r in ranked if r not in first][:trials - len(first)],
                   key=ranked.index)
    if make_step is None:
        offset, step = decision.compute_s, _reduction(strategy, specs)
    else:
        offset, step = 0.0, make_step
    # Trials that train move the weights: they go back to where the job left them.
    saved = [(v, tf.identity(v)) for v in _variables(weights)] if make_step else []
    # The two fastest trials' ops and built steps, kept for a run-off (each holds
    # state as large as the gradients, an optimizer's slots with `make_step`).
    built_of = {}

    def restored(measure):
        """The seconds `measure()` gives, averaged over the workers; the strategy's
        ops and the weights restored after (also when it fails)."""
        try:
            seconds = measure()
        finally:
            # The mean must be exact: back to the ops the link was probed with.
            _tf_compat.set_cross_device_ops(strategy, exact)
            for v, value in saved:
                v.assign(value)
        return [offset + s for s in _mean_over_workers(strategy, seconds)]

    def trial(row):
        name, exchange, bucket_bytes, _ = row

        def measure():
            ops = dataclasses.replace(decision, compressor=name, exchange=exchange,
                                      bucket_bytes=bucket_bytes).ops(**ops_kwargs)
            _install(strategy, ops)
            try:
                built = step(ops)
                # A function traced before would go on using the ops it was traced
                # with, and every trial would time the same candidate.
                if any(built is b for _, b in built_of.values()):
                    raise ValueError(f"make_step returned the same step function twice "
                                     f"({built!r}); it must build a new one on each call")
                built_of[row[:3]] = ops, built
                return [_time_step(ops, built, steps)]
            except compression.OptimizerRefused:
                # The job's optimizer cannot train with this candidate (dgc under Adam):
                # it is out, on every worker alike (the refusal reads the optimizer
                # alone, before any collective of the step).
                return [math.inf]
        timed = (*row, *restored(measure))
        # Every worker keeps the same two: the times are the workers' mean.
        finalists = {r[:3] for r in sorted([*rows, timed], key=_measured)[:2]}
        for key in set(built_of) - finalists:
            del built_of[key]
        return timed

    rows, refused = [], set()
    spare = [r for r in ranked if r not in tried]
    queue = list(tried)
    while queue:
        row = queue.pop(0)
        # Refused once, by the optimizer, is refused whatever the exchange.
        rows.append((*row, math.inf) if row[0] in refused else trial(row))
        if math.isinf(rows[-1][4]):
            refused.add(row[0])
            # Its trial goes to the next candidate of another compressor.
            queue += [r for r in spare if r[0] not in refused][:1]
            spare = [r for r in spare if r not in queue]
    if all(math.isinf(r[4]) for r in rows):
        raise ValueError(f"the step's optimizer cannot train with any compressor tried "
                         f"({', '.join(sorted(refused))}); name others in compressors= or "
                         "build the step with an optimizer they take")
    name, exchange, bucket_bytes = min(rows, key=_measured)[:3]
    plans = {_cuts(specs, bucket_bytes)}
    for row in priced:
        cuts = _cuts(specs, row[2]) if row[:2] == (name, exchange) else None
        if cuts is not None and cuts not in plans:
            plans.add(cuts)
            rows.append(trial(row))
    final = sorted(rows, key=_measured)[:2]
    again = ()
    if runoff > 0 and len(final) == 2 and final[1][4] <= final[0][4] * (1 + runoff):
        # In turns, so that whatever slows the machines for a while slows both.
        def turns():
            times = [[], []]
            for _ in range(RUNOFF_ROUNDS):
                for i, row in enumerate(final):
                    ops, built = built_of[row[:3]]
                    _install(strategy, ops)
                    times[i].append(costmodel.median_seconds(built, steps)[0])
            return [float(np.median(t)) for t in times]
        again = tuple((*row[:4], s) for row, s in zip(final, restored(turns)))
    built_of.clear()
    name, exchange, bucket_bytes, predicted, step_s = min(again or rows, key=_measured)
    return dataclasses.replace(decision, compressor=name, exchange=exchange,
                               bucket_bytes=bucket_bytes, predicted_step_s=predicted,
                               predicted_speedup=decision.predicted_speedup
                               * decision.predicted_step_s / predicted,
                               trials=tuple(rows), runoff=again,
                               measured_step_s=step_s)


def _members(strategy: tf.distribute.Strategy) -> tuple[int, int]:
    """`(members, devices per member)` the link is priced between: workers of several
    devices each, which exchange hierarchically; else every replica, one device each
    (one process's devices, or one device per worker)."""
    replicas = strategy.num_replicas_in_sync
    _, workers = _tf_compat.worker_position(strategy)
    if workers > 1 and replicas > workers:
        return workers, replicas // workers
    return replicas, 1


def _measured(row) -> tuple:
    """Sorts timed rows fastest first (ties: the faster predicted, as priced first)."""
    return round(row[4], 9), row[3]


def _cuts(specs, bucket_bytes: int) -> tuple:
    """Which tensors go together under `bucket_bytes`."""
    return tuple(b.layout for b in plan_buckets(specs, bucket_bytes).buckets)


def _kind(exchange: str) -> str:
    """"all-reduce" for the exchanges of summable payloads, else the exchange."""
    return "all-reduce" if exchange in ALL_REDUCES else exchange


def _variables(weights) -> list:
    """The variables of `weights`: a model's (trainable or not), a list's, or none for
    `(shape, dtype)` pairs."""
    weights = getattr(weights, "variables", weights)
    return [w for w in weights if hasattr(w, "assign")]


def _reduction(strategy: tf.distribute.Strategy, specs
               ) -> Callable[[CompressedAllReduce], Callable[[], Any]]:
    """Builds steps that all-reduce gradient-sized tensors through the strategy (each
    built step traces anew, under the ops installed then)."""
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.random.stateless_normal(shape, (ctx.replica_id_in_sync_group, i),
                                                dtype=dtype)
                     if dtype.is_floating else tf.zeros(shape, dtype)
                     for i, (shape, dtype) in enumerate(specs)])

    def build(ops):  # pylint: disable=unused-argument  # traced under the installed ops
        @tf.function
        def reduce():
            def fn(v):
                # Placed on the replica's device (an argument has none inside the
                # function, and a reduction needs its destination); an identity copies
                # nothing.
                v = [tf.identity(t) for t in v]
                out = tf.distribute.get_replica_context().all_reduce("SUM", v)
                # One entry of each result: waiting for it waits for the whole
                # reduction, without copying the gradients out.
                return tf.add_n([tf.cast(tf.reshape(t, [-1])[0], tf.float32) for t in out])
            # No optimizer applies these: a compressor's warning of one it cannot see
            # (`Compressor.optimizer_unseen`) is not about the job.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return strategy.experimental_local_results(strategy.run(fn, args=(values,)))
        return reduce
    return build


def _time_step(ops: CompressedAllReduce, step: Callable[[], Any], steps: int) -> float:
    """Median seconds of `steps` calls of `step` (after one that traces), with `ops` past
    their compressor's warm-up."""
    step()
    ops.start_at_step(costmodel.STEADY_STEP)
    return costmodel.median_seconds(step, steps)[0]


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _check_installable(strategy: tf.distribute.Strategy) -> None:
    if not (hasattr(strategy, "use_cross_device_ops")
            or isinstance(strategy, tf.distribute.MirroredStrategy)):
        raise ValueError(f"cannot install cross-device ops into {type(strategy).__name__}; "
                         "use tf.distribute.MirroredStrategy or "
                         "tf_gradsync.MultiWorkerMirroredStrategy, or pass install=False")


def _install(strategy: tf.distribute.Strategy, ops: CompressedAllReduce) -> None:
    use = getattr(strategy, "use_cross_device_ops", None)
    if use is not None:                        # tf_gradsync.MultiWorkerMirroredStrategy
        use(ops)
    else:
        _tf_compat.set_cross_device_ops(strategy, ops)


__all__ = ["BUCKET_SIZES", "CLASSES", "Decision", "autotune", "candidates", "decide",
           "fit_link", "probe_all_to_all", "probe_link"]
