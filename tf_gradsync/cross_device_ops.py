"""`CompressedAllReduce`: compressed, bucketed gradient all-reduce for tf.distribute."""

from __future__ import annotations

import inspect
from typing import Sequence

import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.compression import Compressor, Guard, Warmup, get, with_error_feedback
from tf_gradsync.config import DEFAULT_BUCKET_BYTES, check_settings
from tf_gradsync.pipeline import Pipeline, add_sizes, path_of
from tf_gradsync.state import SyncState
from tf_gradsync.stats import Stats


class CompressedAllReduce(tf.distribute.CrossDeviceOps, tf.Module):
    """Cross-device ops that fuse gradients into buckets, compress and all-reduce them.

    Pass it to `tf.distribute.MirroredStrategy(cross_device_ops=...)`. Gradient
    synchronisation (`batch_reduce`, which both Keras optimizers and
    `ReplicaContext.all_reduce` use) is bucketed and compressed: only payload tensors
    cross device boundaries. Single-value reductions (`reduce`, used for metrics and
    `strategy.reduce`), gathers and broadcasts are exact. IndexedSlices gradients are
    all-gathered as indices and values (not densified; the values in 16 bits under
    fp16/bf16, within a process and across workers).

    Args:
      compression: a registered compressor name (see
        `tf_gradsync.compression.names()`) or a `Compressor` instance.
      bucket_bytes: largest bucket, in bytes of the input dtype; larger tensors get a
        bucket of their own. 4 MiB by default, chosen from measurements (BENCHMARKS.md,
        timeline): smaller buckets start exchanging earlier during backprop.
      algorithm: "auto", "ring", "tree" or "collective" (TF collective ops).
      error_feedback: wrap the compressor in `ErrorFeedback` (a residual per bucket and
        replica, in float32 for 16/32-bit input: 4 bytes per gradient element per
        replica). None (default): the compressor's `default_error_feedback`, on for
        biased compressors and off for unbiased ones, but TernGrad (biased only by its
        clipping of outliers) goes without.
        Compressors with their own memory (PowerSGD, DGC) refuse True.
      timeout_seconds: a collective whose peers do not arrive within this time fails
        instead of hanging (None: wait forever).
      warmup_steps: all-reduce the first this many steps uncompressed (`Warmup`), then
        compress; error-feedback residuals start at zero after the warm-up.
      measure_error: compute each step's relative compression error for `stats()`
        (`comm_error`); it costs a decode of each replica's own payload and two norms
        per bucket where the compressor does not compute them anyway.
      exchange: how payloads that cannot be summed (top-k, sign, int8, ...) travel:
        "gather" (all-gather: each replica sends N-1 payloads and decodes N),
        "two_phase" (each replica's chunk j goes to replica j, which sums and
        re-compresses it with its own error feedback, then the reduced chunks are
        all-gathered: 2(N-1)/N of a payload whatever N) or "auto" (per bucket, the
        cheaper by predicted cost: gather at N = 2, two phases for large buckets
        beyond); only "auto" for compressors whose payloads are summed.
      guard: watch each bucket's compression error and send a bucket in fp16 while
        its mean over a window stays above 0.99, returning when it would fall
        (`tf_gradsync.compression.Guard`; identical on every worker). Not applied
        to lossless compressors. It needs buckets whole: gathered payloads travel
        whole ("auto" gathers), and `exchange="two_phase"` is refused.
      jit_compile: compile the compressors' decodings (unpacking codes, summing the
        gathered payloads, the error feedback's new residual) and the compress of
        sign, onebit and int8 with XLA into fused loops, where they declare it
        (`Compressor.xla_decode`, `xla_compress`): on one core, four gathered int8
        payloads of 25M entries summed in 19 ms instead of 92. Each bucket compiles
        on the first step; buckets under 16,384 entries (where compiling saves
        nothing measurable) and steps run eagerly run them uncompiled. False runs them as
        TensorFlow ops (a device without XLA, debugging).
      sparse_as_dense: densify embedding gradients (IndexedSlices) on each replica and
        bucket and compress them with the dense gradients, as Horovod's
        `sparse_as_dense`. It pays where a step looks up a large share of a table's rows
        (small vocabularies, long sequences): gathered, the rows each replica looked up
        reach every other as they are, N-1 payloads of them; densified, the table's
        whole gradient goes through the compressor. The optimizer then gets dense
        gradients for those tables.
      name: name of the module (for checkpoints).

    Raises:
      ValueError: for an unknown compressor, algorithm or exchange, or any other
        setting outside its range (the message names it and what is allowed).

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("fp16", bucket_bytes=4 * 2**20)
      >>> # Two devices at least (one reduces nothing, and never calls the ops): GPUs, or
      >>> # a CPU split in two before TensorFlow starts.
      >>> strategy = tf.distribute.MirroredStrategy(tf_gradsync.logical_cpus(2),
      ...                                           cross_device_ops=ops)
      >>> # ... model.fit(...) ...
      >>> ops.stats()["compression_ratio"]
      2.0
    """

    def __init__(self, compression: str | Compressor = "none", *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 algorithm: str = "auto", error_feedback: bool | None = None,
                 timeout_seconds: float | None = None, warmup_steps: int = 0,
                 measure_error: bool = True, exchange: str = "auto", guard: bool = False,
                 jit_compile: bool = True, sparse_as_dense: bool = False,
                 name: str | None = None, **compressor_settings):
        if compressor_settings:
            raise TypeError(_unexpected(compression, sorted(compressor_settings)))
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name must be a string or None, got {name!r}")
        tf.distribute.CrossDeviceOps.__init__(self)
        tf.Module.__init__(self, name=name or "compressed_all_reduce")
        check_settings(error_feedback=error_feedback, bucket_bytes=bucket_bytes,
                       algorithm=algorithm, exchange=exchange, timeout_seconds=timeout_seconds,
                       warmup_steps=warmup_steps, measure_error=measure_error, guard=guard,
                       jit_compile=jit_compile, sparse_as_dense=sparse_as_dense)
        # Numpy's booleans pass the checks; Python's are kept.
        if error_feedback is not None:
            error_feedback = bool(error_feedback)
        measure_error, guard, jit_compile = bool(measure_error), bool(guard), bool(jit_compile)
        self._compressor = with_error_feedback(get(compression), error_feedback)
        if guard and self._compressor.accuracy != "lossless":
            self._compressor = Guard(self._compressor)
        if warmup_steps:
            self._compressor = Warmup(self._compressor, int(warmup_steps))
        if exchange != "auto" and self._compressor.summable:
            raise ValueError(f"exchange={exchange!r} is how payloads that cannot be summed "
                             f"travel, but {self._compressor!r}'s are summed (algorithm="
                             f"{algorithm!r}: ring, tree, collective or hierarchical); leave "
                             "exchange='auto'")
        self._algorithm = algorithm
        self._exchange = exchange
        self._bucket_bytes = bucket_bytes
        self._jit_compile = jit_compile
        self._sparse_as_dense = bool(sparse_as_dense)
        # Every variable (compressor state, counters) lives in one tracked SyncState, so
        # checkpointing these ops (directly, or through `track_state(model, ops)`) saves it.
        self._state = SyncState()
        self._stats = Stats(self._state)
        self._pipeline = Pipeline(self._compressor, self._algorithm, bucket_bytes,
                                  self._stats, self._state, float(timeout_seconds or 0),
                                  measure_error, exchange, jit_compile)
        self._exact_ops = None

    def join_cluster(self, num_workers: int, exact_ops: tf.distribute.CrossDeviceOps,
                     worker_index: int = 0) -> None:
        """Called by `tf_gradsync.MultiWorkerMirroredStrategy` when it adopts these ops.

        Args:
          num_workers: workers in the job, each with the same local devices.
          worker_index: this worker's place in the job (the strategy's `worker_index`).
          exact_ops: the strategy's own collective ops, which keep serving everything
            that is not a compressible gradient all-reduce (metrics, integers,
            IndexedSlices, gathers, broadcasts) exactly; IndexedSlices values are
            handed to them in the compressor's `sparse_values_dtype`.
        """
        if self._exact_ops is not None and self._exact_ops is not exact_ops:
            raise ValueError("this CompressedAllReduce already belongs to another strategy")
        self._pipeline.num_workers = num_workers
        self._pipeline.worker_index = worker_index
        self._exact_ops = exact_ops

    @property
    def _num_between_graph_workers(self):
        return self._pipeline.num_workers

    # ------------------------------------------------------------ introspection
    @property
    def compressor(self) -> Compressor:
        return self._compressor

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def exchange(self) -> str:
        return self._exchange

    @property
    def jit_compile(self) -> bool:
        return self._pipeline.jit_compile

    @property
    def sparse_as_dense(self) -> bool:
        return self._sparse_as_dense

    @property
    def timeout_seconds(self) -> float | None:
        return self._pipeline.timeout or None

    def bucket_exchange(self, layout, members: int, across_workers: bool | None = None) -> str:
        """How a bucket laid out as `layout` (a `compression.Layout`) travels among
        `members` replicas: "all-reduce" (summable payloads), "gather" or "two_phase"
        (for `exchange="auto"`, `costmodel.choose_exchange`'s pick: on the network's link
        across workers and among GPUs, on the link between devices among the CPU devices
        of one process).

        Args:
          layout: the bucket's layout.
          members: the replicas it is reduced among.
          across_workers: whether they are on several workers (None: as these ops run,
            in a multi-worker strategy or not).

        Example:
          >>> ops = tf_gradsync.CompressedAllReduce("int8")
          >>> ops.bucket_exchange(tf_gradsync.compression.Layout(((1000, 1000),)), 4,
          ...                     across_workers=True)
          'two_phase'
        """
        if self._compressor.summable:
            return "all-reduce"
        return "two_phase" if self._pipeline.two_phase(self._compressor, layout, members,
                                                       across_workers) else "gather"

    @property
    def bucket_bytes(self) -> int:
        return self._bucket_bytes

    def learning_rate_scale(self, optimizer) -> float:
        """The factor by which to multiply the learning rate that `optimizer` trains
        with uncompressed: 1.0, except for optimizers that divide by a running root mean
        square (Adam and its kin) with compressors whose entries wait K steps between
        sends, sqrt(K), or whose coarse values raise the mean square, 1 / `rms_step`
        (see `Compressor.learning_rate_scale`); `adapt_optimizer` applies it.

        Example:
          >>> ops = tf_gradsync.CompressedAllReduce("topk")
          >>> optimizer = tf.keras.optimizers.Adam(1e-3 * ops.learning_rate_scale("adam"))
        """
        return self._compressor.learning_rate_scale(optimizer)

    def adapt_optimizer(self, optimizer):
        """`optimizer` rebuilt as this compressor trains best with: under Adam and its
        kin `learning_rate_scale` times the learning rate; for payloads whose entries
        wait long between sends no momentum (Adam's `beta_1=0`; SGD's `momentum=0` at
        the rate / (1 - momentum)); unchanged otherwise (see
        `Compressor.adapt_optimizer`).

        Example:
          >>> ops = tf_gradsync.CompressedAllReduce("topk")
          >>> with strategy.scope():
          ...     model.compile(optimizer=ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3)))
        """
        return self._compressor.adapt_optimizer(optimizer)

    def stats(self) -> dict[str, float]:
        """Communication counters (see `tf_gradsync.stats.Stats.as_dict`), and what the
        compressor reports from its state (`Compressor.report`: a guard's
        `guarded_buckets` and `fallback_buckets`)."""
        return {**self._stats.as_dict(),
                **self._compressor.report(self._pipeline.bucket_states())}

    def reset_stats(self) -> None:
        """Zeroes the counters `stats()` reports (bytes per epoch, say); the step counter
        that drives the compressors' schedules runs on."""
        self._stats.reset()

    def start_at_step(self, step: int) -> None:
        """Continues as if `step` synchronisations had happened: compressors leave
        their warm-up (PowerSGD's `start_iter`, DGC's ramp) and per-step random choices
        follow from there. `tf_gradsync.autotune` times its trials in that steady state."""
        self._stats.start_at(step)

    def __repr__(self) -> str:
        # Everything that shapes the exchanges: workers check that theirs agree by it.
        return (f"CompressedAllReduce({self._compressor!r}, bucket_bytes={self._bucket_bytes}, "
                f"algorithm={self._algorithm!r}, exchange={self._exchange!r}, "
                f"jit_compile={self._jit_compile}, sparse_as_dense={self._sparse_as_dense})")

    # ------------------------------------------------------------ CrossDeviceOps
    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if self._exact_ops is not None:
            return self._exact_ops.reduce_implementation(
                reduce_op, per_replica_value, destinations, options)
        (result,) = self._run(reduce_op, [(per_replica_value, destinations)], options, compress=False)
        return result

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        # Sums of activations (a synchronized batch normalization's moments, in its
        # forward and backward passes) reach here as gradients do, and must stay exact.
        compress = not _tf_compat.reducing_activations()
        pairs = list(value_destination_pairs)
        if compress:
            if self._sparse_as_dense:
                pairs = [(_densified(value), dest) for value, dest in pairs]
            pairs = _with_variable_shapes(pairs)
        if self._exact_ops is None:
            return self._run(reduce_op, pairs, options, compress)
        ours, rest = [], []
        for i, (value, dest) in enumerate(pairs):
            v = _tf_compat.to_per_replica(value)
            all_reduce = _tf_compat.devices_of(dest) == tuple(v._devices)  # pylint: disable=protected-access
            compressed = compress and all_reduce and path_of(v) == "compressed"
            (ours if compressed else rest).append(i)
        results = [None] * len(pairs)
        if ours:
            for i, r in zip(ours, self._run(reduce_op, [pairs[i] for i in ours], options, True)):
                results[i] = r
        if rest:
            narrowed = [self._narrow_sparse(pairs[i][0]) if compress else (pairs[i][0], None)
                        for i in rest]
            exact = self._exact_ops.batch_reduce_implementation(
                reduce_op, [(v, pairs[i][1]) for (v, _), i in zip(narrowed, rest)], options)
            if compress:
                self._record_collectives([v for v, _ in narrowed],
                                         [pairs[i][0] for i in rest], part_of_step=bool(ours))
            for i, r, (_, dtype) in zip(rest, exact, narrowed):
                if dtype is not None:      # back in the gradient's dtype
                    parts = [r] if isinstance(r, tf.IndexedSlices) else r.values
                    r = _tf_compat.regroup_mirrored(_cast_slices(parts, dtype))
                results[i] = r
        return results

    def _record_collectives(self, sent_values, plain_values, part_of_step: bool) -> None:
        """Counts what TensorFlow's collectives reduce across workers, from the tensors
        handed to them, as within a process: embedding gradients (IndexedSlices), each
        replica's indices and values in the dtype they travel reaching every other
        replica, as the compressed gathers count theirs; dense values (scalars, integers,
        shapes known only when they run), which its ring all-reduce sends 2(T-1)/T of
        from each of the T replicas. The reference is the same in the gradients' dtype.
        Embedding gradients count a step unless `part_of_step` (the gradients bucketed
        in this call counted it); dense values never do."""
        gathered, plain, ringed, local = [], [], [], 1
        for s_value, p_value in zip(sent_values, plain_values):
            parts = _tf_compat.to_per_replica(s_value).values
            local = len(parts)
            if isinstance(parts[0], tf.IndexedSlices):
                gathered += [_nbytes(t) for s in parts for t in (s.values, s.indices)]
                plain += [_nbytes(t) for s in _tf_compat.to_per_replica(p_value).values
                          for t in (s.values, s.indices)]
            else:
                ringed += [_nbytes(t) for t in parts]
        if not gathered and not ringed:
            return
        total = local * self._pipeline.num_workers
        # Summed over the local replicas: each sends 2(T-1)/T of its own.
        ring = add_sizes(ringed) * 2 * (total - 1) // (total * local)
        self._pipeline.stats.record(add_sizes(gathered) * (total - 1) // local + ring,
                                    add_sizes(plain) * (total - 1) // local + ring,
                                    count_step=bool(gathered) and not part_of_step,
                                    part_of_step=part_of_step)

    def _narrow_sparse(self, value) -> tuple:
        """IndexedSlices values in the compressor's 16-bit dtype (fp16, bf16) before
        TensorFlow's sparse gather across workers, as within a process.

        Returns:
          `(value to hand over, dtype to restore or None when unchanged)`.
        """
        v = _tf_compat.to_per_replica(value)
        first = v.values[0]
        if not isinstance(first, tf.IndexedSlices):
            return value, None
        wire = self._compressor.sparse_values_dtype(first.values.dtype)
        if wire is None:
            return value, None
        return _tf_compat.per_replica(_cast_slices(v.values, wire)), first.values.dtype

    def broadcast_implementation(self, tensor, destinations):
        if self._exact_ops is not None:
            return self._exact_ops.broadcast_implementation(tensor, destinations)
        return _tf_compat.simple_broadcast(tensor, destinations, always_mirrored=True,
                                           canonicalize_devices=self._canonicalize_devices)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        if self._exact_ops is not None:
            return self._exact_ops._gather_implementation(  # pylint: disable=protected-access
                per_replica_value, destinations, axis, options)
        per_replica_value = _tf_compat.to_per_replica(per_replica_value)
        src = per_replica_value._devices  # pylint: disable=protected-access
        out = []
        for d in _tf_compat.devices_of(destinations):
            with tf.device(d):
                parts = [v if s == d else tf.identity(v)
                         for v, s in zip(per_replica_value.values, src)]
                out.append(tf.concat(parts, axis))
        return _tf_compat.regroup_mirrored(out)

    def _run(self, reduce_op, pairs: Sequence, options, compress: bool) -> list:
        timeout = getattr(options, "timeout_seconds", None)
        # Pairs that share sources and destinations are synchronised together (one
        # bucket plan); values on other device sets get their own reduction.
        groups: dict[tuple, list[int]] = {}
        values = []
        for i, (value, dest) in enumerate(pairs):
            value = _tf_compat.to_per_replica(value)
            unplaced = tuple(value._devices)  # pylint: disable=protected-access
            value = _placed(value)
            dests = _tf_compat.devices_of(dest)
            if dests == unplaced:     # reduced onto themselves (Keras 3's all-reduce)
                dests = tuple(value._devices)  # pylint: disable=protected-access
            values.append(value)
            sources = tuple(value._devices)  # pylint: disable=protected-access
            groups.setdefault((sources, dests), []).append(i)
        results: list = [None] * len(pairs)
        for (_, dests), idx in groups.items():
            reduced = self._pipeline.reduce(reduce_op, [values[i] for i in idx], dests,
                                            compress=compress, timeout=timeout)
            for i, per_dest in zip(idx, reduced):
                results[i] = _tf_compat.regroup_mirrored(per_dest)
        return results


def _with_variable_shapes(pairs: list) -> list:
    """`pairs` with each dense gradient whose static shape is partly unknown given the
    shape of the variable it is applied to, checked when it runs, so that it is bucketed
    and compressed like the others instead of reduced exactly beside them.

    Keras traces `fit` with relaxed shapes: over sequences of any length a Dense
    kernel's gradient is [None, 64], and under mixed precision an embedding's gradient
    can arrive densified as [None, 32]. The variable is the destination (tf_keras
    reduces onto it) or the calling optimizer's, in the same order, which every value's
    shape must fit (Keras 3 all-reduces the gradients it then applies)."""
    unknown = [i for i, (value, _) in enumerate(pairs)
               if path_of(_tf_compat.to_per_replica(value)) == "dynamic"]
    if not unknown:
        return pairs
    shapes = [dest.shape if isinstance(dest, tf.Variable) else None for _, dest in pairs]
    if any(shapes[i] is None for i in unknown):
        _, variables = _tf_compat.calling_optimizer()
        if variables is not None and len(variables) == len(pairs) and all(
                _first(value).shape.is_compatible_with(v.shape)
                for (value, _), v in zip(pairs, variables)):
            shapes = [v.shape if s is None else s for s, v in zip(shapes, variables)]
    out = list(pairs)
    for i in unknown:
        value, dest = pairs[i]
        shape = None if shapes[i] is None else tf.TensorShape(shapes[i])
        if shape is None or not shape.is_fully_defined() or not \
                _first(value).shape.is_compatible_with(shape):
            continue
        parts = []
        for t in _tf_compat.to_per_replica(value).values:
            with tf.device(t.device):
                parts.append(tf.ensure_shape(t, shape))
        shaped = _tf_compat.per_replica(parts)
        # A value reduced onto itself (Keras 3) goes onto itself still.
        out[i] = (shaped, shaped if dest is value else dest)
    return out


def _densified(value):
    """An embedding gradient (per-replica IndexedSlices) as each replica's dense
    gradient, summed on its own device; other values as they are. Its leading dimension
    is the table's when it runs (`_with_variable_shapes` then gives the static one)."""
    v = _tf_compat.to_per_replica(value)
    if not isinstance(v.values[0], tf.IndexedSlices) or v.values[0].dense_shape is None:
        return value        # dense already, or of no known size: gathered as it is
    parts = []
    for s in v.values:
        with tf.device(s.values.device):
            dense = tf.math.unsorted_segment_sum(s.values, s.indices, s.dense_shape[0])
            known = tf.get_static_value(s.dense_shape)
            parts.append(dense if known is None else tf.ensure_shape(dense, known))
    return _tf_compat.per_replica(parts)


def _first(value):
    """The first replica's part of a (per-replica) value."""
    return _tf_compat.to_per_replica(value).values[0]


def _placed(value):
    """`value` with each replica's tensor on that replica's device. Per-replica values
    handed to a `tf.function` as arguments (gradients computed in one function and
    applied in another) arrive as placeholders without devices: they are placed on the
    current strategy's devices, in replica order, as identities (no copy on their own
    device). Values that carry their devices, or whose count is not the strategy's,
    are left as they are."""
    devices = tuple(value._devices)  # pylint: disable=protected-access
    if len(devices) < 2 or "" not in devices or not tf.distribute.has_strategy():
        return value
    known = tuple(tf.distribute.get_strategy().extended.worker_devices)
    if len(known) != len(devices):
        return value
    out = []
    for t, d in zip(value.values, known):
        with tf.device(d):
            out.append(tf.IndexedSlices(tf.identity(t.values), tf.identity(t.indices),
                                        t.dense_shape)
                       if isinstance(t, tf.IndexedSlices) else tf.identity(t))
    return _tf_compat.per_replica(out)


def _cast_slices(slices, dtype: tf.DType) -> list:
    """Each IndexedSlices with its values cast to `dtype`, on the values' device."""
    out = []
    for s in slices:
        with tf.device(s.values.device):
            out.append(tf.IndexedSlices(tf.cast(s.values, dtype), s.indices, s.dense_shape))
    return out


def _nbytes(t: tf.Tensor) -> tf.Tensor:
    """Bytes of `t` as it runs (an int64 scalar): embedding gradients' lengths vary."""
    return tf.size(t, out_type=tf.int64) * t.dtype.size


def _unexpected(compression, keys: list[str]) -> str:
    """The error for keyword arguments the constructor does not take, pointing a
    compressor's own settings (`CompressedAllReduce("topk", ratio=0.1)`, a natural slip)
    to the compressor."""
    ops_args = [p for p in inspect.signature(CompressedAllReduce.__init__).parameters
                if p not in ("self", "compressor_settings")]
    message = (f"CompressedAllReduce got unexpected keyword argument(s) {keys}; its "
               f"arguments: {', '.join(ops_args)}")
    try:
        compressor = get(compression)
    except (ValueError, TypeError):     # an unknown compressor: its own error follows
        return message
    own = [k for k in keys if k in inspect.signature(type(compressor).__init__).parameters]
    if own:
        name = compressor.name
        message += (f". {', '.join(own)} set the compressor: CompressedAllReduce("
                    f"tf_gradsync.compression.get({name!r}, "
                    f"{', '.join(f'{k}=...' for k in own)}))")
    return message
