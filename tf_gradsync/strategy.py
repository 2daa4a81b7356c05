"""`MultiWorkerMirroredStrategy` that accepts `CompressedAllReduce`, and works with Keras 3.

TensorFlow's `tf.distribute.MultiWorkerMirroredStrategy` takes no `cross_device_ops` and
insists on its own `CollectiveAllReduce`. This subclass keeps TensorFlow's multi-worker
runtime (cluster resolution, gRPC collectives, health checks) and routes gradient
all-reduces through a `CompressedAllReduce`: the compressed payload crosses workers in
TF collective ops. Everything else (metrics, gathers, broadcasts, integer and
IndexedSlices values) stays with TensorFlow's collective ops, exactly, except that
IndexedSlices values enter them in 16 bits under fp16/bf16.

It also carries a narrow fix for Keras 3 `model.fit` under multi-worker strategies
(keras-team/keras#20585): Keras calls `strategy.reduce` on a nested batch and with
`axis=0` on scalar metrics; `reduce` here maps over nested structures and reduces
scalars across replicas. Nothing else in Keras or TensorFlow is changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.config import check_seconds
from tf_gradsync.cross_device_ops import CompressedAllReduce


# The public name is a factory; the class of what it returns is private.
_COMMUNICATION_OPTIONS = type(tf.distribute.experimental.CommunicationOptions())

#: How long a task waits for the cluster's others to start, by default: ample for tasks
#: scheduled at different times (containers pulling images), a quarter of TensorFlow's
#: silent hour.
STARTUP_TIMEOUT_S = 900.0


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous multi-worker training with compressed, bucketed gradient all-reduce.

    Args:
      cross_device_ops: a `CompressedAllReduce`, or None to keep TensorFlow's collective
        all-reduce (still with the Keras 3 fix).
      cluster_resolver: as for `tf.distribute.MultiWorkerMirroredStrategy` (default:
        TF_CONFIG).
      communication_options: as for `tf.distribute.MultiWorkerMirroredStrategy`; its
        `timeout_seconds` bounds how long a collective waits for a dead peer. Without
        one, the `timeout_seconds` of `cross_device_ops` bounds TensorFlow's own
        collectives too (metrics, values not compressed).
      startup_timeout_seconds: how long each task waits for every task of the cluster
        to start and join (TensorFlow's coordination service; None: TensorFlow's own
        wait, an hour, with no output meanwhile). A worker that never starts fails the
        others then, each naming the wait. Not applied where the coordination service
        was configured already, nor where TensorFlow's coordination config has no
        `cluster_register_with_barrier` (older releases: only the leader would wait).

    Raises:
      ValueError: if `cross_device_ops` is not a `CompressedAllReduce`, an argument has
        the wrong type, (without `cluster_resolver`) the TF_CONFIG environment variable
        is malformed (see `check_tf_config`), or, on every worker, the workers were
        given other ops (one small exact all-reduce checks, with or without ops).
      TimeoutError: when the cluster's tasks did not all join within
        `startup_timeout_seconds`.

    Example:
      >>> strategy = tf_gradsync.MultiWorkerMirroredStrategy(
      ...     cross_device_ops=tf_gradsync.CompressedAllReduce("fp16"))
      >>> with strategy.scope():
      ...     model = build_and_compile()
      >>> model.fit(dataset, epochs=3)
    """

    def __init__(self, cross_device_ops: CompressedAllReduce | None = None,
                 cluster_resolver=None, communication_options=None,
                 startup_timeout_seconds: float | None = STARTUP_TIMEOUT_S):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CompressedAllReduce):
            raise ValueError(f"cross_device_ops must be a tf_gradsync.CompressedAllReduce or "
                             f"None, got {cross_device_ops!r}")
        if cluster_resolver is not None and not isinstance(
                cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
            raise ValueError(f"cluster_resolver must be a tf.distribute.cluster_resolver."
                             f"ClusterResolver or None, got {cluster_resolver!r}")
        if communication_options is not None and not isinstance(communication_options,
                                                                 _COMMUNICATION_OPTIONS):
            raise ValueError(f"communication_options must be a tf.distribute.experimental."
                             f"CommunicationOptions or None, got {communication_options!r}")
        check_seconds("startup_timeout_seconds", startup_timeout_seconds)
        if cluster_resolver is None:
            # TensorFlow reads TF_CONFIG itself, deep inside cluster resolution: check it
            # first so that a typo gives a message about TF_CONFIG, not a stack trace.
            check_tf_config(os.environ.get("TF_CONFIG"))
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        bounded = startup_timeout_seconds is not None and _tf_compat.bound_cluster_startup(
            cluster_resolver, float(startup_timeout_seconds))
        try:
            super().__init__(cluster_resolver=cluster_resolver,
                             communication_options=communication_options)
        except tf.errors.DeadlineExceededError as e:
            if not bounded:
                raise
            raise TimeoutError(
                f"{cluster_resolver.task_type} {cluster_resolver.task_id}: the cluster's "
                f"{_tasks(cluster_resolver)} tasks did not all start and join within "
                f"startup_timeout_seconds={startup_timeout_seconds:g}; start every task with "
                "the same cluster in TF_CONFIG, each reachable at its address (TensorFlow: "
                f"{(e.message.splitlines() or [''])[0]})") from None
        # TensorFlow's collective ops: they keep serving what is not compressed.
        self._exact_ops = _tf_compat.cross_device_ops_of(self)
        if cross_device_ops is not None:
            self.use_cross_device_ops(cross_device_ops)
        elif self.num_workers > 1:
            # A worker without ops beside one with them fails at the first step with
            # TensorFlow's "Collective instance ... expected type" instead.
            self._check_same_everywhere(None)

    def use_cross_device_ops(self, ops: CompressedAllReduce) -> None:
        """Routes gradient all-reduces through `ops` from now on (as if passed to the
        constructor); call it before building any training step (`tf_gradsync.autotune`
        does, after probing the link).

        Every worker must call it with the same ops: it checks that they agree (one small
        exact all-reduce).

        Raises:
          ValueError: if `ops` is not a `CompressedAllReduce`, or, on every worker, if
            the workers' ops differ (another compressor, setting or bucket size).
        """
        if not isinstance(ops, CompressedAllReduce):
            raise ValueError(f"cross_device_ops must be a tf_gradsync.CompressedAllReduce, "
                             f"got {ops!r}")
        if self.num_workers > 1:
            self._check_same_everywhere(ops)
        ops.join_cluster(self.num_workers, self._exact_ops, self.worker_index)
        # Under model.fit a stuck peer also stalls the metrics' collectives, which are
        # TensorFlow's: the ops' timeout bounds them too.
        _tf_compat.bound_collectives(self, ops.timeout_seconds)
        _tf_compat.set_cross_device_ops(self, ops)
        _tf_compat.use_merge_call_for_all_reduce(self.extended)

    def _check_same_everywhere(self, ops: CompressedAllReduce | None) -> None:
        """Raises ValueError on every worker unless all describe `ops` alike (its repr:
        compressor, settings, bucket size, exchange; None: TensorFlow's own collectives).
        Workers of other ops would meet in collectives of other keys or shapes at the
        first step and wait there forever, or fail with TensorFlow's internal messages.
        A digest of 48 bits, in three 16-bit parts, is summed with its squares over the
        replicas through TensorFlow's exact collectives: the parts agree everywhere
        exactly when n * sum(h^2) equals sum(h)^2 (float64 holds these sums exactly up
        to 2^21 replicas)."""
        described = repr(ops) if ops is not None else \
            "no CompressedAllReduce (TensorFlow's own collectives)"
        digest = hashlib.sha256(described.encode()).digest()
        parts = np.array([int.from_bytes(digest[i:i + 2], "big") for i in (0, 2, 4)],
                         np.float64)
        mine = tf.constant(np.concatenate([parts, parts ** 2]))
        values = self.experimental_distribute_values_from_function(lambda _: tf.identity(mine))
        summed = self._exact_ops.reduce(tf.distribute.ReduceOp.SUM, values, values)
        total = self.experimental_local_results(summed)[0].numpy()
        n = self.num_replicas_in_sync
        if np.any(n * total[3:] != total[:3] ** 2):
            raise ValueError(
                f"the workers' CompressedAllReduce differ: worker {self.worker_index} has "
                f"{described}, and another worker something else; every worker must build "
                "the same compressor, settings and bucket_bytes (ops that differ meet in "
                "collectives of other shapes at the first step and wait there), and pass "
                "them the same way: to the constructor on every worker, or to "
                "use_cross_device_ops on every worker")

    @property
    def worker_index(self) -> int:
        """This worker's place in the job, 0 to `num_workers` - 1, as TensorFlow's
        collectives number it: a chief task first, then the workers (Horovod's rank).
        Per-worker files belong under it, not under the TF_CONFIG task index, which a
        chief and worker 0 share."""
        return _tf_compat.worker_position(self)[0]

    @property
    def num_workers(self) -> int:
        """Processes in the job, a chief included (Horovod's size)."""
        return _tf_compat.worker_position(self)[1]

    @property
    def cross_device_ops(self) -> CompressedAllReduce | None:
        ops = _tf_compat.cross_device_ops_of(self)
        return ops if isinstance(ops, CompressedAllReduce) else None

    def reduce(self, reduce_op, value, axis):
        """`Strategy.reduce`, mapped over nested structures; `axis` is ignored for scalars.

        Keras 3 asks for `axis=0` when averaging scalar metrics and passes whole nested
        batches (keras-team/keras#20585); both fail in TensorFlow's implementation.
        """
        def one(v):
            first = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            rank = getattr(getattr(first, "shape", None), "rank", None)
            return super(MultiWorkerMirroredStrategy, self).reduce(
                reduce_op, v, None if rank == 0 else axis)
        return tf.nest.map_structure(one, value)


#: Task types a TF_CONFIG may name (TensorFlow's own set).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = ('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


def check_tf_config(raw: str | None) -> dict[str, Any] | None:
    """Parses and checks the text of a TF_CONFIG environment variable.

    Args:
      raw: the variable's value; None, blank or `{}` mean "no cluster" (one local
        worker), as for TensorFlow.

    Returns:
      The parsed TF_CONFIG, or None when there is no cluster.

    Raises:
      ValueError: for text that is not a JSON object, a missing `cluster` or `task`,
        a cluster that does not map known task types to non-empty lists of "host:port"
        addresses, one address given to two tasks, or a task whose type is unknown or
        absent from the cluster or whose index is out of range. The message names the
        bad value and what is allowed.

    Example:
      >>> check_tf_config('{"cluster": {"worker": ["a:1", "b:1"]}, '
      ...                 '"task": {"type": "worker", "index": 1}}')["task"]["index"]
      1
    """
    if raw is None or not raw.strip():
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {raw!r}; expected e.g. {_EXAMPLE}") \
            from None
    if not isinstance(cfg, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got {raw!r}; "
                         f"e.g. {_EXAMPLE}")
    if not cfg:
        return None
    missing = [k for k in ("cluster", "task") if k not in cfg]
    if missing:
        raise ValueError(f"TF_CONFIG lacks {' and '.join(repr(k) for k in missing)}: {raw!r}; "
                         f"expected e.g. {_EXAMPLE}")
    cluster, task = cfg["cluster"], cfg["task"]
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(f"TF_CONFIG 'cluster' must map task types ({', '.join(TASK_TYPES)}) to "
                         f"lists of 'host:port' addresses, got {cluster!r}")
    seen: dict[str, str] = {}       # address -> the task at it
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise ValueError(f"TF_CONFIG cluster has unknown task type {task_type!r}; "
                             f"valid task types: {', '.join(TASK_TYPES)}")
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(f"TF_CONFIG cluster[{task_type!r}] must be a non-empty list of "
                             f"'host:port' addresses, got {addresses!r}")
        if task_type == "chief" and len(addresses) > 1:
            raise ValueError(f"TF_CONFIG cluster['chief'] has {len(addresses)} addresses "
                             f"{addresses!r}; allowed: at most one chief")
        for i, address in enumerate(addresses):
            _check_address(task_type, address)
            # Two tasks at one address: one fails to start its server, the other waits.
            if address in seen:
                raise ValueError(f"TF_CONFIG cluster gives {seen[address]} and {task_type} {i} "
                                 f"one address, {address!r}; each task needs its own port")
            seen[address] = f"{task_type} {i}"
    if not isinstance(task, dict):
        raise ValueError(f"TF_CONFIG 'task' must be an object with 'type' and 'index', "
                         f"got {task!r}")
    task_type, index = task.get("type"), task.get("index")
    if task_type not in TASK_TYPES:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not valid; valid task types: "
                         f"{', '.join(TASK_TYPES)}")
    if task_type not in cluster and task_type != "evaluator":
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not in the cluster, which has: "
                         f"{', '.join(cluster)}")
    size = len(cluster.get(task_type, [None]))
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise ValueError(f"TF_CONFIG task index {index!r} is not an integer in [0, {size - 1}] "
                         f"({task_type!r} has {size} task(s))")
    return cfg


def _check_address(task_type: str, address) -> None:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"TF_CONFIG cluster[{task_type!r}] has address {address!r}; allowed: "
                         "'host:port' with a port in 1..65535")


def _tasks(cluster_resolver) -> int:
    """How many tasks of the cluster the coordination service waits for."""
    spec = cluster_resolver.cluster_spec()
    return sum(spec.num_tasks(j) for j in _tf_compat.coordinated_jobs(spec))
