"""The synchronisation pipeline: the one place where the stages meet.

    per-replica values -> bucket plan -> pack -> rounds of the compressor (with state),
    each round's payload exchanged -> unpack

Dense floating values take the compressed, bucketed path. IndexedSlices (embedding
gradients) are all-gathered as indices and values, never densified, since they are
already sparse. Non-floating values, and every value when `compress=False`, take the
same bucketed path with the identity compressor, so results are exact. Values whose
static shape is not fully known (a `None` batch dimension inside `tf.function`) cannot
be bucketed, since a bucket's layout is fixed when the graph is built: each is summed
exactly where it is needed, from copies of every replica's tensor.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Iterator, Sequence

import tensorflow as tf
from absl import logging

from tf_gradsync import _tf_compat, algorithms, costmodel
from tf_gradsync.algorithms import Wire
from tf_gradsync.bucketing import Bucket, BucketPlan, plan_buckets
from tf_gradsync.compression import (SCATTER, Compressor, Context, Message, NoCompression,
                                     driver, two_phase, xla)
from tf_gradsync.compression.base import check_adapted_rate, nbytes, replica_id
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
      measure_error: compute each step's compression error for the stats.
      exchange: how payloads that cannot be summed travel: "gather", "two_phase" or
        "auto" (per bucket, by `costmodel.choose_exchange`).
      jit_compile: compile the compressors' codecs with XLA (`Context.jit_compile`).
    """

    def __init__(self, compressor: Compressor, algorithm: str, bucket_bytes: int,
                 stats: Stats, state: SyncState, timeout: float = 0,
                 measure_error: bool = True, exchange: str = "auto", jit_compile: bool = True):
        self.compressor = compressor
        self.jit_compile = jit_compile
        self.exchange = exchange
        self.measure_error = measure_error
        self.algorithm = algorithm
        self.bucket_bytes = bucket_bytes
        self.stats = stats
        self.state = state
        self.timeout = timeout
        self._plans: dict[tuple, BucketPlan] = {}
        # Per traced graph, how many reductions of each plan and owner it has built so far.
        self._ordinals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Per plan, each state slot's (owner, ordinal in its graph), in order of first use.
        self._slots: dict[str, list[tuple[_Owner, int]]] = {}
        # Per plan, the functions that reduced its tensors by hand (no optimizer applies them).
        self._hand_reducers: dict[str, list[str]] = {}
        # Every plan a reduction has taken (`_plan_of_call`), by fingerprint.
        self._built: dict[str, BucketPlan] = {}
        self._exchanges: dict[tuple, str] = {}   # "auto"'s choice per bucket layout
        self._exact = NoCompression()
        #: Workers taking part (set by a multi-worker strategy). Each has the same
        #: number of local devices; with more than one, exchanges cross workers.
        self.num_workers = 1
        #: This worker's index among them (TensorFlow's: a chief first).
        self.worker_index = 0

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
        if len(src) > 1 and "" in src:
            # Values handed to a tf.function as arguments arrive as placeholders without a
            # device; the replicas' collectives would then wait for one another forever.
            raise ValueError(
                f"each replica's value must carry its device, got devices {src}: reduce "
                "per-replica values passed to a function under the strategy whose devices "
                "they came from, or capture them in the function rather than pass them")
        dests = tuple(destinations)
        n = len(src)
        if self.num_workers > 1 and (not compress or dests != src):
            raise ValueError("across workers only compressed all-reduces run here; exact "
                             "reductions belong to the strategy's collective ops")
        timeout = self.timeout if timeout is None else timeout
        step = self.stats.step_counter()
        sent, dense, errors = [], [], []
        results: list[list | None] = [None] * len(values)

        groups: dict[str, list[int]] = {"compressed": [], "exact": [], "sparse": [],
                                        "dynamic": []}
        for i, v in enumerate(values):
            groups[path_of(v, compress)].append(i)
        # The optimizer applying the gradients, for the variables it applies them to (a
        # walk over the reduction's threads' frames, made only for what is bucketed),
        # owns the state they reduce through.
        optimizer, variables = (_tf_compat.calling_optimizer()
                                if groups["compressed"] or groups["exact"] else (None, None))
        owner = _Owner(optimizer, variables)
        if groups["compressed"]:
            if optimizer is not None:
                self.compressor.check_optimizer(optimizer)
                check_adapted_rate(optimizer)
            else:
                self.compressor.optimizer_unseen()
        if compress and groups["sparse"]:
            self.compressor.sparse_unseen()

        with tf.name_scope(SCOPE):
            for kind, compressor in (("compressed", self.compressor), ("exact", self._exact)):
                idx = groups[kind]
                if not idx:
                    continue
                per_device = [[values[i].values[r] for i in idx] for r in range(n)]
                per_dest, bytes_, dense_, errors_ = self._bucketed(
                    compressor, reduce_op, per_device, src, dests, step, timeout, owner)
                sent.append(bytes_)
                dense.append(dense_)
                if kind == "compressed":
                    errors += errors_
                for j, i in enumerate(idx):
                    results[i] = [per_dest[k][j] for k in range(len(dests))]
            for i in groups["sparse"] + groups["dynamic"]:
                wire, plain = Wire(), Wire()
                wire_dtype = self.compressor.sparse_values_dtype(values[i].values[0].dtype) \
                    if compress and i in groups["sparse"] else None
                results[i] = _gather_sum(reduce_op, values[i].values, src, dests, wire, plain,
                                         wire_dtype)
                sent.append(wire.total())
                dense.append(plain.total())

        # A step synchronises gradients: embedding gradients (IndexedSlices) alone are
        # one too (a model of embeddings only), a scalar reduced by hand is not. What is
        # reduced exactly by request (sums of activations, single values) counts no
        # bytes either, as across workers, where TensorFlow's collectives reduce it.
        # Counted once the values exist: a step that never reaches the reduction (Keras's
        # last call of an epoch, which meets the end of the data first) counts nothing.
        # Not after the results: the next reduction of the step reads the counter, and
        # would wait for this one's exchange.
        if compress:
            inputs = [v.values for v in values]
            with tf.control_dependencies(tf.nest.flatten(inputs, expand_composites=True)):
                self.stats.record(add_sizes(sent) // n, add_sizes(dense) // n,
                                  count_step=bool(groups["compressed"] or groups["sparse"]),
                                  errors=errors)
        return results  # type: ignore[return-value]

    # ----------------------------------------------------------------- stages
    def plan(self, specs: Sequence[tuple[tf.TensorShape, tf.DType]]) -> BucketPlan:
        """The bucket plan for these shapes and dtypes, computed once and cached."""
        key = tuple((tuple(tf.TensorShape(s).as_list()), tf.as_dtype(d)) for s, d in specs)
        if key not in self._plans:
            self._plans[key] = plan_buckets(specs, self.bucket_bytes)
        return self._plans[key]

    def _plan_of_call(self, plan: BucketPlan, owner: "_Owner", compressor: Compressor
                      ) -> BucketPlan:
        """`plan` for this reduction's state slot (`BucketPlan.nth`): one slot per owner
        (the optimizer applying the gradients, for the variables it applies them to: heads
        of one shape trained in turn have a slot each) and per n-th reduction of its tensors
        by that owner in the graph being traced. Models of one shape reduce through state of
        their own, not one residual or momentum for all: trained in one step (twin critics,
        an ensemble, a GAN's two halves) or each in its own `fit` or function on the same
        ops. A retraced step keeps its slots. Slots are numbered in order of first use: a
        program that traces its steps in the same order keeps each call's state across
        restarts, and the first keeps the keys of a plan alone.

        In one process, a new owner takes over the slot of an owner no longer alive (a
        model trained and dropped before the next one, one per fold of a
        cross-validation): the ops' state does not grow with each model. A fresh
        optimizer (no step taken) starts it from its initial values; one that has
        taken steps (restored from a checkpoint) keeps what the slot holds, which a
        restore of the compression state wrote. A function still holding the dropped
        owner's step must not run again. Across workers, whose owners may live on
        differently, a new owner always takes a slot of its own, so that every worker
        picks the same. Eagerly, every call is its owner's first."""
        ordinal = 0
        if not tf.executing_eagerly():
            seen = self._ordinals.setdefault(tf.compat.v1.get_default_graph(), {})
            ordinal = seen.get((plan.fingerprint, owner), 0)
            seen[(plan.fingerprint, owner)] = ordinal + 1
            if not owner.mortal and _has_state(compressor, plan):
                self._note_hand_reducer(plan)
        slots = self._slots.setdefault(plan.fingerprint, [])
        if (owner, ordinal) in slots:
            slot = slots.index((owner, ordinal))
        else:
            slot = self._dead_slot(slots) if self.num_workers == 1 else None
            if slot is None:
                self._warn_of_a_resumed_owner(owner, slots, compressor, plan)
                slot = len(slots)
                slots.append((owner, ordinal))
            else:
                slots[slot] = (owner, ordinal)
                if owner.fresh():
                    self.state.reset(_state_prefix(compressor, plan.nth(slot)))
        plan = plan.nth(slot)
        self._built.setdefault(plan.fingerprint, plan)
        return plan

    def _note_hand_reducer(self, plan: BucketPlan) -> None:
        """Warns (once per plan) when tensors of one plan are reduced by hand in a second
        function: without an optimizer to tell them apart they share the state of their
        n-th reduction, which is wrong where they are different models' gradients (a GAN's
        halves of one shape, each in its own step function)."""
        name = _tf_compat.traced_function_name()
        names = self._hand_reducers.setdefault(plan.fingerprint, [])
        if name in names:
            return
        names.append(name)
        if len(names) == 2:
            logging.warning(
                "tf_gradsync: tensors of the same shapes are all-reduced by hand (no optimizer "
                "applies them) in functions %r and %r, which share their compression state "
                "(error-feedback residual, momentum): what one did not send goes out with the "
                "other's. If they are different models' gradients, reduce them in one function "
                "(each reduction in it keeps state of its own) or let each optimizer reduce "
                "its own (apply_gradients without skipping the aggregation).", *names)

    def _warn_of_a_resumed_owner(self, owner: "_Owner", slots: list[tuple["_Owner", int]],
                                 compressor: Compressor, plan: BucketPlan) -> None:
        """Warns when an optimizer new to these ops, which has taken steps (restored
        from a checkpoint, most likely), takes a new slot for which no restored state
        waits, so its compression state starts from initial values: while another
        optimizer holds these tensors' state (what a restore wrote stays with it), or
        when no state was restored for them at all."""
        steps = owner.steps()
        if not steps or not _has_state(compressor, plan):
            return
        optimizer = owner.optimizer()
        if any(o.optimizer() is optimizer for ss in self._slots.values() for o, _ in ss):
            return       # another head of an optimizer these ops know: state of its own
        prefix = _state_prefix(compressor, plan.nth(len(slots)))
        if any(k.startswith(prefix) for k in self.state.waiting()):
            return       # restored state waits for this slot (models resumed in order)
        if any(o.mortal for o, _ in slots):
            drop = ("drop those (del, gc.collect()) before the first step"
                    if self.num_workers == 1 else "resume in a fresh process (across "
                    "workers a new optimizer never takes over another's state)")
            logging.warning(
                "tf_gradsync: an optimizer that has taken %d steps (restored from a "
                "checkpoint?) reduces tensors whose compression state belongs to another "
                "optimizer of this process: this one's state (error feedback, momentum) "
                "starts from initial values, and what a restore wrote stays with the other. "
                "To resume, restore into the model and optimizer that trained, or %s.",
                steps, drop)
        elif self.state.waiting():
            # State was restored, for other tensors, another compressor or bucket plan:
            # checkpointing the ops (the advice below) was done.
            logging.warning(
                "tf_gradsync: an optimizer that has taken %d steps reduces through these "
                "ops for the first time and the compression state restored is not for its "
                "tensors under this compressor and bucket plan (a compressor or bucket_bytes "
                "changed since the checkpoint?): error feedback, momentum and warm-ups start "
                "over.", steps)
        else:
            logging.warning(
                "tf_gradsync: an optimizer that has taken %d steps reduces through these "
                "ops for the first time and no compression state was restored for its "
                "tensors: error feedback, momentum and warm-ups start over. Checkpoint the "
                "ops with the model (tf.train.Checkpoint(..., gradsync=ops), or "
                "gs.track_state(model, ops)) to resume them; a Keras 3 model from "
                "load_model gets its file's state with gs.track_state(model, ops) and then "
                "model.load_weights(path).", steps)

    @staticmethod
    def _dead_slot(slots: list[tuple["_Owner", int]]) -> int | None:
        """The first slot whose owner (an optimizer) is no longer alive, or None."""
        if not any(o.mortal for o, _ in slots):
            return None
        gc.collect()        # Keras models and optimizers hold reference cycles
        return next((i for i, (o, _) in enumerate(slots) if o.dead()), None)

    def _bucketed(self, compressor: Compressor, reduce_op, per_device: list[list[tf.Tensor]],
                  src: tuple[str, ...], dests: tuple[str, ...], step: tf.Tensor, timeout: float,
                  owner: "_Owner"):
        """Reduces one group of dense values bucket by bucket.

        Returns:
          `(per_dest, sent, dense, errors)`: the results per destination, bytes sent by
          all local replicas (int64 tensor), what an uncompressed ring all-reduce of the
          same buckets would send (int), and each bucket's `(error_sq, norm_sq)`.
        """
        n = len(src)
        total = n * self.num_workers
        plan = self._plan_of_call(self.plan([(t.shape, t.dtype) for t in per_device[0]]),
                                  owner, compressor)
        flats = []
        for r, d in enumerate(src):
            with tf.device(d), tf.name_scope("pack"):
                flats.append(plan.pack(per_device[r]))
        out_flats: list[list[tf.Tensor]] = [[] for _ in dests]
        sent, dense, errors = [], 0, []
        # Buckets are built independently: no control edges between them, so each one's
        # exchange starts as soon as its own gradients exist.
        for b in plan.buckets:
            if b.numel == 0:    # only zero-size tensors: nothing to exchange
                for k, d in enumerate(dests):
                    with tf.device(d):
                        # In the reduction's dtype: an integer mean is a float's.
                        out_flats[k].append(driver.finish(tf.zeros([0], b.dtype),
                                                          reduce_op == MEAN, total, False))
                continue
            with tf.name_scope(f"bucket_{b.id}"):
                outcome = self._bucket(compressor, reduce_op, plan, b, [f[b.id] for f in flats],
                                       src, step, timeout)
                wire = Wire()
                for k, d in enumerate(dests):
                    # A destination outside the sources receives the reduced bucket.
                    out_flats[k].append(outcome.results[src.index(d)] if d in src
                                        else wire.send(outcome.results[0], d))
            sent += [outcome.bytes, wire.total()]
            errors.append((outcome.error_sq, outcome.norm_sq))
            # Reference, summed over local replicas: an uncompressed ring all-reduce over
            # all replicas (2(T-1)/T of the bucket each), plus one dense copy per
            # destination outside the ring.
            off_source = sum(d not in src for d in dests)
            dense += b.nbytes * 2 * (total - 1) * n // total + b.nbytes * off_source
        self.state.seal(_state_prefix(compressor, plan))
        per_dest = []
        for k, d in enumerate(dests):
            with tf.device(d), tf.name_scope("unpack"):
                per_dest.append(plan.unpack(out_flats[k]))
        return per_dest, add_sizes(sent), dense, errors

    def _bucket(self, compressor: Compressor, reduce_op, plan: BucketPlan, bucket: Bucket,
                xs: list[tf.Tensor], src: tuple[str, ...], step: tf.Tensor,
                timeout: float) -> driver.Outcome:
        group = algorithms.Group(src, self.num_workers, self.worker_index, timeout)
        n = group.size
        seed = tf.stack([tf.cast(step, tf.int64),
                         tf.constant(int(plan.fingerprint, 16) + bucket.id, tf.int64)])
        layout = bucket.layout
        two = self.two_phase(compressor, layout, n)
        ctxs = []
        for r, d in enumerate(src):
            compressor.check_input(xs[r])
            chunks = two_phase.split(layout, n, group.members[r]) if two else None
            # A step run eagerly (to debug it) would trace and compile each codec anew at
            # every call: its ops run one by one instead, as a small bucket's do.
            ctxs.append(Context(state=self._state_for(compressor, plan, bucket, r, d, chunks),
                                step=step, seed=seed, num_replicas=n, replica=replica_id(d),
                                layout=layout, chunks=chunks,
                                jit_compile=(xla.compiles(self.jit_compile, layout.numel)
                                             and not tf.executing_eagerly())))

        def exchange(messages: Sequence[Message]):
            first, wire = messages[0], Wire()
            payload_bytes = 0 if first.transport == SCATTER else nbytes(first.payload)
            ex = algorithms.for_round(first.transport, first.like, group, self.algorithm,
                                      payload_bytes)
            with tf.name_scope(ex.name):
                got = ex([m.payload for m in messages], first.transport, group, wire,
                         like=first.like)
            return got, wire.static

        # With several modes the rounds run inside one `tf.switch_case`; its collectives
        # take a token of their own so that it need not wait for other buckets' exchanges.
        apart = (algorithms.collective.ordered_apart((plan.fingerprint, bucket.id))
                 if compressor.num_modes > 1 else contextlib.nullcontext())
        # Its collectives' keys follow from what the exchange is, not from the order in
        # which this process traced it (the settings fix the payloads' shapes, and
        # jit_compile the choice between gathering and two phases).
        keyed = algorithms.collective.keyed((plan.fingerprint, bucket.id, repr(compressor),
                                             self.algorithm, self.exchange, self.jit_compile))
        with tf.name_scope("rounds"), apart, keyed:
            return driver.run(compressor, xs, ctxs, exchange, mean=reduce_op == MEAN,
                              devices=src,
                              measure_error=self.measure_error and compressor is self.compressor)

    def two_phase(self, compressor: Compressor, layout, members: int,
                  across_workers: bool | None = None) -> bool:
        """Whether a bucket of `layout`'s gathered payloads travel in two phases among
        `members` replicas, on several workers (`across_workers`, None: whether these
        ops run on several) or on the CPU devices of one process."""
        if (compressor.summable or not compressor.splittable or members < 2
                or layout.numel < members):
            return False
        if self.exchange != "auto":
            return self.exchange == "two_phase"
        across = self.num_workers > 1 if across_workers is None else across_workers
        # CPU devices of one process exchange by copies in memory, at the codec rates the
        # model assumes (measured on CPUs): priced on the link between a worker's
        # devices. GPUs (whose codecs run far faster) are priced as across workers.
        local = not across and not tf.config.list_logical_devices("GPU")
        key = (compressor.name, layout, members, local)
        if key not in self._exchanges:
            link = algorithms.cost.local_link() if local else algorithms.cost.Link()
            self._exchanges[key] = costmodel.choose_exchange(compressor, layout, members,
                                                             self.jit_compile, link)
        return self._exchanges[key] == "two_phase"

    def bucket_states(self) -> Iterator[dict[str, tf.Variable]]:
        """The first replica's state of each bucket the compressor has built so far, by
        `state_spec` name (what `Compressor.report` reads), found as it is iterated:
        `stats()` runs after every batch, and most compressors report nothing."""
        for plan in self._built.values():
            prefix = _state_prefix(self.compressor, plan)
            for b in plan.buckets:
                names = self.compressor.state_spec(b.layout)
                found = {n: self.state.get(f"{prefix}b{b.id}_r0_{n}") for n in names}
                if names and all(v is not None for v in found.values()):
                    yield found

    def _state_for(self, compressor: Compressor, plan: BucketPlan, bucket: Bucket,
                   replica: int, device: str,
                   chunks: two_phase.Chunks | None = None) -> dict[str, tf.Variable]:
        if chunks is None:
            specs, tag = compressor.state_spec(bucket.layout), ""
        else:   # per chunk, and the owner's residual: shapes depend on the chunk count
            specs = two_phase.state_spec(compressor, bucket.layout, chunks)
            tag = f"x{chunks.count}_"
        state = {}
        for name, spec in specs.items():
            key = f"{_state_prefix(compressor, plan)}b{bucket.id}_r{replica}_{tag}{name}"
            state[name] = self.state.variable(
                key, lambda spec=spec: spec.initializer(spec.shape, spec.dtype), device)
        return state


class _Owner:
    """Whose reduction it is: the optimizer applying the gradients, for the variables it
    applies them to (one optimizer may train heads of one shape in turn: each has state
    of its own), held weakly; or no one (values all-reduced by hand), who never dies.
    Equal when the optimizer and the variables are, and while they live (a dead owner
    equals nothing, itself included)."""

    def __init__(self, optimizer, variables: Sequence | None = None):
        self._ref = None if optimizer is None else weakref.ref(optimizer)
        variables = () if optimizer is None or variables is None else tuple(variables)
        self._vars = [r for r in map(_weak, variables) if r is not None]
        self._id = None if optimizer is None else (id(optimizer), tuple(map(id, variables)))

    @property
    def mortal(self) -> bool:
        """An optimizer, which may die; no one never does."""
        return self._ref is not None

    def dead(self) -> bool:
        return self._ref is not None and (self._ref() is None
                                          or any(r() is None for r in self._vars))

    def optimizer(self):
        """The optimizer, or None (no one, or dead)."""
        return None if self._ref is None else self._ref()

    def steps(self) -> int | None:
        """The steps the optimizer has taken (None: no optimizer or no iteration count)."""
        iterations = getattr(self.optimizer(), "iterations", None)
        if iterations is None:
            return None
        with tf.init_scope():
            return int(iterations.numpy())

    def fresh(self) -> bool:
        """Whether the optimizer has taken no step yet (it has no iteration count: no)."""
        return self.steps() == 0

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Owner) and self._id == other._id
                and not self.dead() and not other.dead())

    def __hash__(self) -> int:
        return hash(self._id)


def _has_state(compressor: Compressor, plan: BucketPlan) -> bool:
    """Whether reductions under `plan` may keep state: the compressor's, or in two
    phases (gathered payloads only) the owners' residual of a biased compressor."""
    return (any(compressor.state_spec(b.layout) for b in plan.buckets)
            or (not compressor.summable and two_phase.owner_feedback(compressor)))


def _weak(obj) -> weakref.ref | None:
    """A weak reference to `obj`, or None for an object that takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _state_prefix(compressor: Compressor, plan: BucketPlan) -> str:
    """What the keys of `compressor`'s state under `plan` start with."""
    return f"{compressor.name}_{plan.fingerprint}_"


def path_of(value, compress: bool = True) -> str:
    """Which path a PerReplica value takes: "compressed", "exact", "sparse" or "dynamic".

    A scalar (a loss or a metric reduced by hand) is exact: compressing one number saves
    nothing, and a step's gradients would not be the only call counted as a step."""
    first = value.values[0]
    if isinstance(first, tf.IndexedSlices):
        return "sparse"
    if not first.shape.is_fully_defined():
        return "dynamic"
    compressed = compress and first.dtype.is_floating and first.shape.rank > 0
    return "compressed" if compressed else "exact"


def _gather_sum(reduce_op, tensors: Sequence, src, dests, wire: Wire, plain: Wire,
                values_dtype: tf.DType | None = None) -> list:
    """Every replica's value copied to each destination and summed there: IndexedSlices
    are concatenated (never densified; their values sent as `values_dtype` when given,
    on every replica, so that all hold the same result), dense tensors of any shape
    added. `plain` counts what the same gather would send uncompressed."""
    n = len(src)
    out = []
    sent_values = []
    if isinstance(tensors[0], tf.IndexedSlices):
        for s, s_dev in zip(tensors, src):
            with tf.device(s_dev):
                sent_values.append(s.values if values_dtype is None
                                   else tf.cast(s.values, values_dtype))
    for d in dests:
        with tf.device(d):
            if isinstance(tensors[0], tf.IndexedSlices):
                vals = [tf.cast(v if s_dev == d else wire.send(v, d), s.values.dtype)
                        for s, v, s_dev in zip(tensors, sent_values, src)]
                idx = [s.indices if s_dev == d else wire.send(s.indices, d)
                       for s, s_dev in zip(tensors, src)]
                plain.fed([t for s, s_dev in zip(tensors, src) if s_dev != d
                           for t in (s.values, s.indices)], 1)
                v = tf.concat(vals, 0)
                if reduce_op == MEAN:
                    v = v / tf.cast(n, v.dtype)
                out.append(tf.IndexedSlices(v, tf.concat(idx, 0), tensors[0].dense_shape))
            else:
                y = tf.add_n([t if t_dev == d else wire.send(t, d)
                              for t, t_dev in zip(tensors, src)])
                plain.fed([t for t, t_dev in zip(tensors, src) if t_dev != d], 1)
                out.append(driver.finish(y, reduce_op == MEAN, n, False))
    return out


def add_sizes(terms) -> tf.Tensor:
    """The sum of ints and int64 tensors, as an int64 tensor."""
    static = sum(t for t in terms if isinstance(t, int))
    return tf.add_n([tf.constant(static, tf.int64),
                     *(tf.cast(t, tf.int64) for t in terms if not isinstance(t, int))])
