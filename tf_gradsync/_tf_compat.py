"""Every private TensorFlow import used by tf_gradsync, in one place.

`tf.distribute.CrossDeviceOps` subclasses must build values (`Mirrored`), resolve
destination devices and launch collective ops, none of which TensorFlow exports
publicly. Keeping these imports here means a TensorFlow upgrade touches one file.
"""

from __future__ import annotations

import copy
import sys
import threading
import types
from typing import Sequence

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _xla
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import mirrored_run as _mirrored_run
from tensorflow.python.distribute import values as _values
from tensorflow.python.ops import collective_ops as _collective_ops
from tensorflow.python.ops import control_flow_v2_func_graphs as _control_flow_graphs
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops

#: TF's own broadcast by plain copies.
simple_broadcast = _cross_device_ops.simple_broadcast


def devices_of(destinations) -> tuple[str, ...]:
    """Canonical device strings of a destination (string, variable, tensor or DistributedValues)."""
    return tuple(_cross_device_ops.get_devices_from(destinations))


def to_per_replica(value) -> _values.PerReplica:
    """Wraps a plain tensor into a one-element PerReplica, as TF's own ops do."""
    return _cross_device_ops._make_tensor_into_per_replica(value)  # pylint: disable=protected-access


def per_replica(values: Sequence) -> _values.PerReplica:
    """One value per local replica -> a `PerReplica`."""
    return _values.PerReplica(tuple(values))


def regroup_mirrored(per_device: Sequence) -> object:
    """One value per destination device -> a `Mirrored` (or the value itself for one device)."""
    if len(per_device) == 1:
        return per_device[0]
    return _distribute_utils.regroup(tuple(per_device), wrap_class=_values.Mirrored)


def plain_variable(initial_value, *, name: str, device: str | None = None,
                   trainable: bool = False) -> tf.Variable:
    """Creates an ordinary resource variable even inside a distribution-strategy scope.

    `initial_value` may be a callable, evaluated outside any function being traced.

    State such as byte counters and error-feedback residuals belongs to one device; a
    strategy's variable creator would turn it into a mirrored variable. Constructing the
    concrete class directly bypasses the creator stack, and `init_scope` lifts creation out
    of any `tf.function` being traced, so state may be created lazily at first trace.
    """
    with tf.init_scope():
        with tf.device(device):
            if callable(initial_value):
                initial_value = initial_value()
            return _resource_variable_ops.ResourceVariable(
                    initial_value, name=name, trainable=trainable)


def collective_all_reduce(t: tf.Tensor, group_size: int, group_key: int, instance_key: int,
                          ordering_token, timeout: float = 0) -> tf.Tensor:
    return _collective_ops.all_reduce_v2(
        t, group_size=group_size, group_key=group_key, instance_key=instance_key,
        merge_op="Add", final_op="Id", communication_hint="ring", timeout=timeout,
        ordering_token=ordering_token)


def collective_all_gather(t: tf.Tensor, group_size: int, group_key: int, instance_key: int,
                          ordering_token, timeout: float = 0) -> tf.Tensor:
    return _collective_ops.all_gather_v2(
        t, group_size=group_size, group_key=group_key, instance_key=instance_key,
        communication_hint="ring", timeout=timeout, ordering_token=ordering_token)


def variadic_reduce(operands: Sequence[tf.Tensor], init_values: Sequence[tf.Tensor],
                    axis: int, reducer) -> list[tf.Tensor]:
    """XLA's reduction of several operands in one loop (`reducer`, a concrete function of
    each operand's accumulator then each operand's element, returns the accumulators);
    only inside a function XLA compiles."""
    return list(_xla.variadic_reduce(list(operands), list(init_values),
                                     dimensions_to_reduce=[axis], reducer=reducer))


def cross_device_ops_of(strategy) -> object:
    """The cross-device ops a Mirrored or MultiWorkerMirrored strategy was given (None for
    a strategy that takes none)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def bound_collectives(strategy, seconds: float | None) -> None:
    """Makes the collectives TensorFlow's multi-worker strategy runs itself (metrics,
    losses, what is not compressed) fail after `seconds` without their peers, unless its
    `CommunicationOptions` set a timeout: its ops and its reductions share one options
    object, read as each collective is built."""
    options = getattr(strategy.extended, "_communication_options", None)
    if seconds and options is not None and options.timeout_seconds is None:
        options.timeout_seconds = seconds


def worker_position(strategy) -> tuple[int, int]:
    """`(index, count)`: this worker's place among the job's workers, as TensorFlow numbers
    them for its collectives (a chief first: the chief is 0 and worker i is i + 1, so
    a chief and worker 0 never share an index); `(0, 1)` in one process."""
    extended = strategy.extended
    index = getattr(extended, "_id_in_cluster", 0)  # pylint: disable=protected-access
    count = getattr(extended, "_num_workers", 1)  # pylint: disable=protected-access
    return int(index or 0), max(int(count or 1), 1)


def set_cross_device_ops(strategy, ops) -> None:
    """Makes such a strategy use `ops` for every later reduction."""
    strategy.extended._cross_device_ops = ops  # pylint: disable=protected-access


def use_merge_call_for_all_reduce(extended) -> None:
    """Makes a CollectiveAllReduceExtended send replica-context all-reduces through
    merge_call -> batch_reduce, so that custom cross-device ops see every local replica
    at once (TensorFlow otherwise calls CollectiveAllReduce._all_reduce per replica)."""
    extended.__class__ = _merge_call_subclass(type(extended))


_MERGE_CALL_CLASSES: dict = {}


def _merge_call_subclass(cls):
    if cls not in _MERGE_CALL_CLASSES:
        def _use_merge_call(self):
            return True

        def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
            return _distribute_lib.StrategyExtendedV2._replica_ctx_all_reduce(  # pylint: disable=protected-access
                self, reduce_op, value, options)

        _MERGE_CALL_CLASSES[cls] = type(cls.__name__ + "WithMergeCall", (cls,), {
            "_use_merge_call": _use_merge_call,
            "_replica_ctx_all_reduce": _replica_ctx_all_reduce,
        })
    return _MERGE_CALL_CLASSES[cls]


def _stacks() -> list:
    """The innermost frame of this thread and of the replica threads of a running
    MirroredStrategy: under it a reduction runs on the main thread while the replicas
    whose code asked for it wait on threads of their own. Other threads (a dataset's
    workers, another model's) are no part of the reduction."""
    frames = sys._current_frames()  # pylint: disable=protected-access
    replicas = [t.ident for t in threading.enumerate()
                if isinstance(t, _mirrored_run._MirroredReplicaThread)]  # pylint: disable=protected-access
    return [frames[i] for i in [threading.get_ident()] + replicas if i in frames]


def calling_optimizer() -> tuple:
    """`(optimizer, variables)`: the Keras optimizer applying gradients right now and the
    variables it applies them to (None where its frames do not tell), or `(None, None)`.

    Gradient all-reduces run inside the optimizer's `apply_gradients` (Keras 3 and
    tf_keras alike), whose frames may be on a replica thread (`_stacks`). The pairs of
    gradients and variables (`grads_and_vars`) or the variables alone
    (`trainable_variables`, `var_list`) are in its frames, or, in tf_keras, in the
    helper under them that reduces (`optimizer_utils.all_reduce_sum_gradients`).
    """
    for frame in _stacks():
        optimizer = below = None
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None and _is_keras_optimizer(obj):
                if optimizer is None:
                    optimizer = obj
                variables = below or _applied_variables(frame.f_locals)
                if variables is not None:
                    return optimizer, variables
            elif optimizer is None and below is None:
                below = _applied_variables(frame.f_locals)
            frame = frame.f_back
        if optimizer is not None:
            return optimizer, None
    return None, None


def _applied_variables(names: dict) -> tuple | None:
    """The variables an optimizer's frame applies gradients to, from its locals; None
    if it holds none as a list (an iterator is not read: that would consume it)."""
    pairs = names.get("grads_and_vars")
    if isinstance(pairs, (list, tuple)) and pairs and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        return tuple(v for _, v in pairs)
    for name in ("trainable_variables", "var_list"):
        variables = names.get(name)
        if isinstance(variables, (list, tuple)) and variables:
            return tuple(variables)
    return None


def _nested_codes(code: types.CodeType) -> list[types.CodeType]:
    out = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += [const] + _nested_codes(const)
    return out


#: The gradient functions of `ReplicaContext.all_reduce`: an all-reduce made in one is
#: the gradient of an all-reduce (of activations: a synchronized batch norm's moments).
_ALL_REDUCE_GRADS = frozenset(
    c for c in _nested_codes(_distribute_lib.ReplicaContextBase.all_reduce.__code__)
    if c.co_name == "<lambda>")


def reducing_activations() -> bool:
    """Whether the reduction running now sums activations or their gradients, not
    gradients of weights: the innermost frame that tells, on this thread or a replica
    thread (`_stacks`), is a Keras layer's `call` (a synchronized batch normalization's
    moments) or the gradient of a replica context's all-reduce (the moments'
    gradients), not an optimizer's method.

    Such sums feed the forward and backward passes as they are, so they must be exact,
    and they are no training step."""
    for frame in _stacks():
        while frame is not None:
            if frame.f_code in _ALL_REDUCE_GRADS:
                return True
            obj = frame.f_locals.get("self")
            if obj is not None:
                if _is_keras_optimizer(obj):
                    break
                if frame.f_code.co_name in ("call", "__call__") and _is_keras(obj, "Layer"):
                    return True
            frame = frame.f_back
    return False


def _is_keras_optimizer(obj) -> bool:
    return _is_keras(obj, "Optimizer", "OptimizerV2", "BaseOptimizer")


def _is_keras(obj, *names: str) -> bool:
    """Whether `obj` is an instance of a Keras 3 or tf_keras class of one of `names`."""
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        if cls.__name__ in names and module.split(".")[0] in ("keras", "tf_keras"):
            return True
    return False


def deferred_restores(trackable) -> list[str]:
    """Names of `trackable`'s children that a `tf.train.Checkpoint` restore holds values
    for and that do not exist yet (restored as soon as they are tracked)."""
    return list(trackable._deferred_dependencies)  # pylint: disable=protected-access


def deferred_shapes(trackable, name: str) -> list:
    """The shapes of the values a restore holds for `trackable`'s child `name` (None
    for what is no variable)."""
    positions = trackable._deferred_dependencies.get(name, ())  # pylint: disable=protected-access
    return [p.value_shape() for p in positions]


def keras_embeddings(model) -> list:
    """The built Keras 3 or tf_keras `Embedding` layers inside `model` (nested ones too,
    each once; none in what is no Keras model) whose trainable table gets the rows it
    looked up as its gradient (IndexedSlices). A table tied to an output layer as well
    (`tie_weights`, keras_hub's ReversibleEmbedding) gets a dense gradient: left out."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = flatten(include_self=False, recursive=True) if flatten else ()
    return [layer for layer in layers
            if _is_keras(layer, "Embedding") and getattr(layer, "embeddings", None) is not None
            and layer.trainable and getattr(layer.embeddings, "trainable", True)
            and not getattr(layer, "tie_weights", False)]


def dense_gradient_weights(model) -> list:
    """`model`'s trainable weights less its Embedding tables (`keras_embeddings`), whose
    gradients are the rows looked up, gathered rather than bucketed."""
    tables = {id(layer.embeddings) for layer in keras_embeddings(model)}
    return [w for w in model.trainable_weights if id(w) not in tables]


def keras_calls(layer) -> int:
    """How many times a Keras `layer` was called on symbolic inputs (a shared layer's
    calls, each a node of the graph)."""
    return len(getattr(layer, "_inbound_nodes", ()))  # pylint: disable=protected-access


def keras_saveable_base() -> type:
    """Keras 3's base class of objects its weight files (`save_weights`, `.keras`) walk
    into; `object` where Keras 3 is absent (tf_keras checkpoints track any trackable)."""
    try:
        from keras.src.saving.keras_saveable import KerasSaveable  # pylint: disable=import-outside-toplevel
    except ImportError:
        return object
    return KerasSaveable


def xspace(path: str):
    """The XSpace proto of a `*.xplane.pb` file written by `tf.profiler.experimental`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def function_graph(graph, name: str):
    """The FuncGraph of function `name` called from `graph` (a branch of a Case op)."""
    return graph._get_function(name).graph  # pylint: disable=protected-access


def traced_function_name() -> str | None:
    """The Python name of the `tf.function` being traced (through the graphs of its
    conditionals and loops), or None eagerly."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, _control_flow_graphs.ControlFlowFuncGraph):
        graph = graph.outer_graph
    return getattr(graph, "name", None)


def copy_weight_decay_exclusions(source, target) -> None:
    """Gives Keras optimizer `target` the variables `source` keeps out of weight decay
    (`exclude_from_weight_decay`), which Keras 3 and tf_keras hold outside the
    optimizer's config, so that a rebuilt optimizer would decay them."""
    for name, value in vars(source).items():
        if name.startswith("_exclude_from_weight_decay") and not name.endswith("_cache"):
            setattr(target, name, copy.copy(value))


def optimizer_steps(optimizer) -> int:
    """The steps a Keras optimizer has taken (its iteration counter, read where it runs
    eagerly); 0 where it has none yet (tf_keras' legacy optimizers create it on first
    read, which this avoids)."""
    counter = getattr(optimizer, "_iterations", None)
    if counter is None:
        return 0
    with tf.init_scope():
        return int(counter.numpy())


def coordinated_jobs(cluster_spec) -> list[str]:
    """The jobs of a cluster TensorFlow's coordination service coordinates."""
    return [j for j in ("chief", "worker") if j in cluster_spec.jobs]


def bound_cluster_startup(cluster_resolver, timeout_seconds: float) -> bool:
    """Configures TensorFlow's coordination service as `MultiWorkerMirroredStrategy`
    would (the same leader and jobs), with every task waiting at most `timeout_seconds`
    for all tasks of the cluster to register (TensorFlow's default: an hour, the leader
    silent meanwhile). Leaves a service the user configured alone, and a TensorFlow
    whose coordination config cannot hold every task to the wait (no
    `cluster_register_with_barrier`: older releases) as it is.

    Returns:
      Whether the bound was set.
    """
    # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute import collective_all_reduce_strategy as _cars
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    config_pb2 = _cars.coordination_config_pb2   # where this TensorFlow keeps it
    ctx = context.context()
    spec = cluster_resolver.cluster_spec()
    jobs = coordinated_jobs(spec)
    if (ctx.coordination_service is not None or not jobs
            or cluster_resolver.task_type not in jobs or not tf.executing_eagerly()
            or "cluster_register_with_barrier" not in
            config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name):
        return False
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=[config_pb2.CoordinatedJob(name=j, num_tasks=spec.num_tasks(j))
                          for j in jobs],
        cluster_register_timeout_in_ms=max(1, int(timeout_seconds * 1000)))
    # Without the barrier only the leader's registration is bounded; with it every task
    # waits for all the others at most that long.
    ctx.coordination_service.cluster_register_with_barrier = True
    return True
