"""The synchronisation pipeline: the one place where the stages meet.

    per-replica values -> bucket plan -> pack -> compress (with state) -> communicate
    -> decompress (at each destination) -> unpack

Dense floating values take the compressed, bucketed path. IndexedSlices (embedding
gradients) are all-gathered as indices and values, never densified, since they are
already sparse. Non-floating values, and every value when `compress=False`, take the
same bucketed path with the identity compressor, so results are exact.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync import _tf_compat, algorithms
from tf_gradsync.algorithms import Wire
from tf_gradsync.bucketing import Bucket, BucketPlan, plan_buckets
from tf_gradsync.compression import Compressor, Context, NoCompression, RoundCompressor
from tf_gradsync.state import SyncState
from tf_gradsync.stats import Stats

#: Name scope of every op on the data path (pack .. unpack), e.g. for graph checks.
SCOPE = "gradsync"
SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


class Pipeline:
    """Builds the graph of one synchronisation.

    Args:
      compressor: applied to dense floating buckets.
      algorithm: a name from `tf_gradsync.algorithms.names()`.
      bucket_bytes: bucket size bound for the planner.
      stats: counters to update.
      state: where per-bucket, per-replica state variables are created on first use
        and looked up afterwards.
      timeout: seconds after which a collective with a missing peer fails (0: never).
    """

    def __init__(self, compressor: Compressor, algorithm: str, bucket_bytes: int,
                 stats: Stats, state: SyncState, timeout: float = 0):
        self.compressor = compressor
        self.algorithm = algorithm
        self.bucket_bytes = bucket_bytes
        self.stats = stats
        self.state = state
        self.timeout = timeout
        self._plans: dict[tuple, BucketPlan] = {}
        self._exact = NoCompression()
        #: Workers taking part (set by a multi-worker strategy). Each has the same
        #: number of local devices; with more than one, exchanges cross workers.
        self.num_workers = 1

    # ----------------------------------------------------------------- entry point
    def reduce(self, reduce_op, values: Sequence, destinations: Sequence[str],
               compress: bool = True, timeout: float | None = None) -> list[list]:
        """Reduces each PerReplica in `values` to every device in `destinations`.

        Returns:
          For each value, the list of results, one per destination device.
        """
        if isinstance(reduce_op, str) and reduce_op.upper() in ("SUM", "MEAN"):
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
        if reduce_op not in (SUM, MEAN):
            raise ValueError(f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN, got {reduce_op!r}")
        src = tuple(values[0]._devices)  # pylint: disable=protected-access
        for v in values:
            if tuple(v._devices) != src:  # pylint: disable=protected-access
                raise ValueError(f"all values must live on the same devices: {src} vs {v._devices}")  # pylint: disable=protected-access
        dests = tuple(destinations)
        n = len(src)
        if self.num_workers > 1 and (not compress or dests != src):
            raise ValueError("across workers only compressed all-reduces run here; exact "
                             "reductions belong to the strategy's collective ops")
        wire = Wire()
        timeout = self.timeout if timeout is None else timeout
        step = self.stats.step_counter()
        dense_bytes: list[tf.Tensor] = []
        results: list[list | None] = [None] * len(values)

        groups: dict[str, list[int]] = {"compressed": [], "exact": [], "sparse": []}
        for i, v in enumerate(values):
            groups[path_of(v, compress)].append(i)

        with tf.name_scope(SCOPE):
            for kind, compressor in (("compressed", self.compressor), ("exact", self._exact)):
                idx = groups[kind]
                if not idx:
                    continue
                per_device = [[values[i].values[r] for i in idx] for r in range(n)]
                per_dest, dense = self._bucketed(compressor, reduce_op, per_device, src, dests,
                                                 wire, step, timeout)
                dense_bytes.append(dense)
                for j, i in enumerate(idx):
                    results[i] = [per_dest[k][j] for k in range(len(dests))]
            for i in groups["sparse"]:
                results[i], dense = self._gather_slices(reduce_op, values[i].values, src, dests,
                                                        wire)
                dense_bytes.append(dense)

        dense_total = tf.add_n(dense_bytes) if dense_bytes else tf.constant(0, tf.int64)
        self.stats.record(wire.bytes() // n, dense_total // n,
                          count_step=bool(groups["compressed"]))
        return results  # type: ignore[return-value]

    # ----------------------------------------------------------------- stages
    def plan(self, specs: Sequence[tuple[tf.TensorShape, tf.DType]]) -> BucketPlan:
        """The bucket plan for these shapes and dtypes, computed once and cached."""
        key = tuple((tuple(tf.TensorShape(s).as_list()), tf.as_dtype(d)) for s, d in specs)
        if key not in self._plans:
            self._plans[key] = plan_buckets(specs, self.bucket_bytes)
        return self._plans[key]

    def _bucketed(self, compressor: Compressor, reduce_op, per_device: list[list[tf.Tensor]],
                  src: tuple[str, ...], dests: tuple[str, ...], wire: Wire, step: tf.Tensor,
                  timeout: float):
        n = len(src)
        total = n * self.num_workers
        plan = self.plan([(t.shape, t.dtype) for t in per_device[0]])
        flats = []
        for r, d in enumerate(src):
            with tf.device(d), tf.name_scope("pack"):
                flats.append(plan.pack(per_device[r]))
        out_flats: list[list[tf.Tensor]] = [[] for _ in dests]
        dense = []
        # Buckets are built independently: no control edges between them, so each one's
        # exchange starts as soon as its own gradients exist.
        for b in plan.buckets:
            with tf.name_scope(f"bucket_{b.id}"):
                if b.numel == 0:    # only zero-size tensors: nothing to exchange
                    reduced = [tf.zeros([0], b.dtype) for _ in dests]
                else:
                    reduced = self._bucket(compressor, reduce_op, plan, b,
                                           [f[b.id] for f in flats], src, dests, wire, step,
                                           timeout)
            for k, y in enumerate(reduced):
                out_flats[k].append(y)
            # Reference, summed over local replicas: an uncompressed ring all-reduce over
            # all replicas (2(T-1)/T of the bucket each), plus one dense copy per
            # destination outside the ring.
            off_source = sum(d not in src for d in dests)
            dense.append(tf.constant(b.nbytes * 2 * (total - 1) * n // total
                                     + b.nbytes * off_source, tf.int64))
        per_dest = []
        for k, d in enumerate(dests):
            with tf.device(d), tf.name_scope("unpack"):
                per_dest.append(plan.unpack(out_flats[k]))
        return per_dest, tf.add_n(dense)

    def _bucket(self, compressor: Compressor, reduce_op, plan: BucketPlan, bucket: Bucket,
                xs: list[tf.Tensor], src: tuple[str, ...], dests: tuple[str, ...], wire: Wire,
                step: tf.Tensor, timeout: float) -> list[tf.Tensor]:
        n = len(src) * self.num_workers
        seed = tf.stack([tf.cast(step, tf.int64),
                         tf.constant(int(plan.fingerprint, 16) + bucket.id, tf.int64)])
        payloads, metas, ctxs, variants = [], [], [], []
        for r, d in enumerate(src):
            with tf.device(d), tf.name_scope("compress"):
                x = xs[r]
                compressor.check_input(x)
                if compressor.prescale:
                    x = x * tf.cast(1.0 / n, x.dtype)
                ctxs.append(Context(state=self._state_for(compressor, plan, bucket, r, d),
                                    step=step, seed=seed, num_replicas=n))
                first = compressor.first_round if isinstance(compressor, RoundCompressor) \
                    else compressor.compress
                payload, meta = first(x, ctxs[r])
                variants.append(compressor.variant(ctxs[r]))
            payloads.append(list(payload))
            metas.append(meta)
        if isinstance(compressor, RoundCompressor):
            return self._rounds(compressor, reduce_op, payloads, metas, ctxs, src, dests, wire,
                                timeout)
        # A payload whose layout changes at run time: say which one, per device.
        variant = None if variants[0] is None else (variants, compressor.num_variants)
        exchanged = self._exchange(payloads, src, compressor.summable, wire, timeout, variant)
        outputs = []
        for d in dests:
            k = src.index(d) if d in src else 0
            got = exchanged[k]
            if d not in src:   # a destination outside the ring gets the compressed result
                got = ([wire.send(t, d) for t in got] if compressor.summable
                       else [[wire.send(t, d) for t in p] for p in got])
            with tf.device(d), tf.name_scope("decompress"):
                if compressor.summable:
                    y = compressor.decompress(got, metas[k])
                else:
                    # Metadata is identical on every replica (part of the contract), so
                    # the local one also decodes payloads from other workers.
                    parts = [compressor.decompress(p, metas[k]) for p in got]
                    # One reduction over the stacked parts, not add_n: Grappler rewrites
                    # an add_n differently on each device (the local part has another
                    # consumer under error feedback), which changes the summation order
                    # and lets replicas drift apart by a rounding error per step.
                    y = parts[0] if len(parts) == 1 else tf.reduce_sum(tf.stack(parts), 0)
                outputs.append(_finish(y, reduce_op, n, compressor.prescale))
            if d in src:    # the reduced result is identical everywhere: state stays in step
                with tf.device(d), tf.name_scope("observe"):
                    compressor.observe(outputs[-1], ctxs[k])
        return outputs

    def _rounds(self, compressor: RoundCompressor, reduce_op, payloads, carries, ctxs,
                src: tuple[str, ...], dests: tuple[str, ...], wire: Wire, timeout: float):
        """Runs a multi-round compressor: all-reduce each round's payload, then finish."""
        n = len(src) * self.num_workers
        while True:
            reduced = self._exchange(payloads, src, True, wire, timeout)
            nxt = []
            for r, d in enumerate(src):
                with tf.device(d), tf.name_scope("next_round"):
                    payload, carries[r] = compressor.next_round(reduced[r], carries[r], ctxs[r])
                nxt.append(payload)
            if all(p is None for p in nxt):
                break
            payloads = [list(p) for p in nxt]
        finished = []
        for r, d in enumerate(src):
            with tf.device(d), tf.name_scope("finish"):
                finished.append(_finish(compressor.finish(reduced[r], carries[r], ctxs[r]),
                                        reduce_op, n, compressor.prescale))
                compressor.observe(finished[-1], ctxs[r])
        # A destination outside the ring receives the reconstruction: the carry that
        # finishing needs is local to each replica.
        return [finished[src.index(d)] if d in src else wire.send(finished[0], d) for d in dests]

    def _exchange(self, payloads: list[list[tf.Tensor]], devices: tuple[str, ...],
                  summable: bool, wire: Wire, timeout: float, variant=None) -> list:
        """Runs the communication algorithm over one bucket's payloads.

        `variant`: None, or (per-device int32 index, count) of a run-time payload
        layout (`Compressor.variant`); collectives need one instance per layout."""
        if self.num_workers > 1:
            return self._exchange_across_workers(payloads, devices, summable, wire, timeout,
                                                 variant)
        return self._exchange_local(payloads, devices, summable, wire, timeout, self.algorithm,
                                    variant)

    @staticmethod
    def _exchange_local(payloads, devices, summable, wire, timeout, algorithm, variant=None):
        """Among the devices of this process; `algorithm` may be "auto"."""
        n = len(devices)
        if n == 1:
            return [payloads[0]] if summable else [[payloads[0]]]
        static = [t.shape.num_elements() for t in payloads[0]]
        size = (sum(s * t.dtype.size for s, t in zip(static, payloads[0]))
                if None not in static else 1 << 62)
        algo = algorithms.choose(algorithm, size, n)
        kwargs = {"timeout": timeout} if algo is algorithms.collective else {}
        if variant is not None and algo is algorithms.collective:
            kwargs["variant"] = variant
        with tf.name_scope(algo.__name__.rsplit(".", 1)[-1]):
            if summable:
                return algo.all_reduce(payloads, devices, wire, **kwargs)
            return algo.all_gather(payloads, devices, wire, **kwargs)

    def _exchange_across_workers(self, payloads, devices, summable, wire, timeout, variant=None):
        """Hierarchical for summable payloads: reduce among local devices, one compressed
        exchange between workers' first devices, then a local broadcast. Gathered payloads
        go through one all-gather over every device of every worker."""
        n, workers = len(devices), self.num_workers
        if not summable:
            with tf.name_scope("collective"):
                return algorithms.collective.all_gather(
                    payloads, devices, wire, group_size=n * workers, timeout=timeout,
                    role=("all", n, workers), variant=variant)
        # The local stage uses in-process transfers; collectives are for the workers.
        local_algorithm = "auto" if self.algorithm == "collective" else self.algorithm
        local = self._exchange_local(payloads, devices, True, wire, timeout, local_algorithm)
        with tf.name_scope("collective"):
            (leader,) = algorithms.collective.all_reduce(
                [local[0]], devices[:1], wire, group_size=workers, timeout=timeout,
                role=("leaders", workers))
        return [leader] + [[wire.send(t, d) for t in leader] for d in devices[1:]]

    def _gather_slices(self, reduce_op, slices: Sequence[tf.IndexedSlices], src, dests, wire):
        """All-gathers IndexedSlices to each destination (uncompressed, not densified)."""
        n = len(src)
        own = Wire()
        out = []
        for d in dests:
            with tf.device(d):
                vals = [s.values if s_dev == d else own.send(s.values, d) for s, s_dev in zip(slices, src)]
                idx = [s.indices if s_dev == d else own.send(s.indices, d) for s, s_dev in zip(slices, src)]
                v = tf.concat(vals, 0)
                if reduce_op == MEAN:
                    v = v / tf.cast(n, v.dtype)
                out.append(tf.IndexedSlices(v, tf.concat(idx, 0), slices[0].dense_shape))
        # An uncompressed exchange of slices is exactly this gather.
        return out, wire.absorb(own)

    def _state_for(self, compressor: Compressor, plan: BucketPlan, bucket: Bucket,
                   replica: int, device: str) -> dict[str, tf.Variable]:
        specs = compressor.state_spec(bucket.numel, bucket.dtype)
        state = {}
        for name, spec in specs.items():
            key = f"{compressor.name}_{plan.fingerprint}_b{bucket.id}_r{replica}_{name}"
            state[name] = self.state.variable(
                key, lambda spec=spec: spec.initializer(spec.shape, spec.dtype), device)
        return state


def path_of(value, compress: bool = True) -> str:
    """Which path a PerReplica value takes: "compressed", "exact" or "sparse"."""
    first = value.values[0]
    if isinstance(first, tf.IndexedSlices):
        return "sparse"
    return "compressed" if compress and first.dtype.is_floating else "exact"


def _finish(y: tf.Tensor, reduce_op, n: int, prescaled: bool) -> tf.Tensor:
    """Turns the exchanged result into SUM or MEAN."""
    if prescaled and reduce_op == SUM and n > 1:
        return y * tf.cast(n, y.dtype)
    if not prescaled and reduce_op == MEAN and n > 1:
        return y // n if y.dtype.is_integer else y / tf.cast(n, y.dtype)
    return y
