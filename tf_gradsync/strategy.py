"""`MultiWorkerMirroredStrategy` that accepts `CompressedAllReduce`, and works with Keras 3.

TensorFlow's `tf.distribute.MultiWorkerMirroredStrategy` takes no `cross_device_ops` and
insists on its own `CollectiveAllReduce`. This subclass keeps TensorFlow's multi-worker
runtime (cluster resolution, gRPC collectives, health checks) and routes gradient
all-reduces through a `CompressedAllReduce`: the compressed payload crosses workers in
TF collective ops. Everything else (metrics, gathers, broadcasts, integer and
IndexedSlices values) stays with TensorFlow's collective ops, exactly.

It also carries a narrow fix for Keras 3 `model.fit` under multi-worker strategies
(keras-team/keras#20585): Keras calls `strategy.reduce` on a nested batch and with
`axis=0` on scalar metrics; `reduce` here maps over nested structures and reduces
scalars across replicas. Nothing else in Keras or TensorFlow is changed.
"""

from __future__ import annotations

import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.cross_device_ops import CompressedAllReduce


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous multi-worker training with compressed, bucketed gradient all-reduce.

    Args:
      cross_device_ops: a `CompressedAllReduce`, or None to keep TensorFlow's collective
        all-reduce (still with the Keras 3 fix).
      cluster_resolver: as for `tf.distribute.MultiWorkerMirroredStrategy` (default:
        TF_CONFIG).
      communication_options: as for `tf.distribute.MultiWorkerMirroredStrategy`; its
        `timeout_seconds` bounds how long a collective waits for a dead peer.

    Raises:
      ValueError: if `cross_device_ops` is not a `CompressedAllReduce`.

    Example:
      >>> strategy = tf_gradsync.MultiWorkerMirroredStrategy(
      ...     cross_device_ops=tf_gradsync.CompressedAllReduce("fp16"))
      >>> with strategy.scope():
      ...     model = build_and_compile()
      >>> model.fit(dataset, epochs=3)
    """

    def __init__(self, cross_device_ops: CompressedAllReduce | None = None,
                 cluster_resolver=None, communication_options=None):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CompressedAllReduce):
            raise ValueError(f"cross_device_ops must be a tf_gradsync.CompressedAllReduce or "
                             f"None, got {cross_device_ops!r}")
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        if cross_device_ops is not None:
            extended = self.extended
            cross_device_ops.join_cluster(max(extended._num_workers, 1),  # pylint: disable=protected-access
                                          extended._cross_device_ops)  # pylint: disable=protected-access
            extended._cross_device_ops = cross_device_ops  # pylint: disable=protected-access
            _tf_compat.use_merge_call_for_all_reduce(extended)

    @property
    def cross_device_ops(self) -> CompressedAllReduce | None:
        ops = self.extended._cross_device_ops  # pylint: disable=protected-access
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
