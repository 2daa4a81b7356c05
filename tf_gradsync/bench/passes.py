"""Memory traffic of the data path: bytes touched per gradient byte, from the traced graph.

Each mode's all-reduce of one layer's gradients (a [rows, cols] kernel and its bias, one
bucket at the default `bucket_bytes`) is traced on 2 logical CPU devices through
`CompressedAllReduce` in a tf.function, and every op the pipeline adds (its `gradsync/`
scope: packing, prescaling, error feedback, compression, checks, the exchange's
additions, decoding, state updates, unpacking) is charged the bytes of the tensors it reads and writes,
from their static shapes. Ops that move no data are not charged: constants, shape
queries, `Identity`/`Reshape`-like views, reads of a variable's buffer, and transfers
between the devices of one process (a handover, not a copy). Of the modes of a
compressor that picks its layout at run time (adaptive, PowerSGD's warm-up), the
largest branch counts. The total over both replicas is divided by the gradients'
bytes on both replicas: a plain copy of the gradients would count 2 (read and
write).

This is a static count, not a hardware counter: kernels that fuse (Eigen evaluates
an elementwise expression tree in one pass) touch less, ops that allocate and zero
touch more, and tensors of unknown static size (`unknown_ops`) are not counted.
`measure_error=False` shows what measuring `comm_error` costs.
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

import tensorflow as tf
from absl import flags

import tf_gradsync as gs
from tf_gradsync import _tf_compat
from tf_gradsync.bench import ops_from_spec
from tf_gradsync.pipeline import SCOPE

flags.DEFINE_list("passes_shape", ["1024", "1000"], "passes: the kernel's shape (plus a "
                  "bias; together one bucket at the default bucket_bytes).")
flags.register_validator("passes_shape",
                         lambda v: len(v) == 2 and all(s.isdigit() and int(s) > 0 for s in v),
                         "passes: --passes_shape must be a kernel's two dimensions >= 1 "
                         "(e.g. 1024,1000)")
FLAGS = flags.FLAGS

COLUMNS = ["mode", "touched_per_byte", "without_error", "pack_unpack", "unknown_ops"]
PLOT = ("mode", "touched_per_byte", "bytes touched per gradient byte")
REPLICAS = 2
#: Ops that move no data (views, metadata, buffer reads, in-process handovers).
FREE = frozenset({
    "Const", "Identity", "IdentityN", "Reshape", "Shape", "ShapeN", "Size", "Rank", "NoOp",
    "Placeholder", "_Send", "_Recv", "ReadVariableOp", "StopGradient", "Squeeze", "ExpandDims",
    "VarHandleOp", "_Arg", "_Retval", "Snapshot"})
_BRANCHING = ("Case", "StatelessCase", "If", "StatelessIf")


def _bytes(tensors: Iterable[tf.Tensor]) -> tuple[int, int]:
    """(bytes of the tensors with a known static size, count of those without)."""
    total = unknown = 0
    for t in tensors:
        if t.dtype in (tf.resource, tf.variant):
            continue
        n = t.shape.num_elements()
        if n is None:
            unknown += 1
        else:
            total += n * t.dtype.size
    return total, unknown


def touched(graph, scope_only: bool = True) -> tuple[int, int, int]:
    """Bytes the graph's ops read and write: `(all, of packing and unpacking, unknown-size
    tensors)`, over ops in the pipeline's scope (all ops of a branch body)."""
    total = packing = unknown = 0
    for op in graph.get_operations():
        if scope_only and f"{SCOPE}/" not in op.name:
            continue
        if op.type in _BRANCHING:
            bodies = ([b.name for b in op.get_attr("branches")] if "Case" in op.type else
                      [op.get_attr("then_branch").name, op.get_attr("else_branch").name])
            best = max(touched(_tf_compat.function_graph(graph, b), scope_only=False)
                       for b in bodies)
            total, packing, unknown = total + best[0], packing + best[1], unknown + best[2]
            continue
        if op.type in FREE:
            continue
        read, u1 = _bytes(op.inputs)
        written, u2 = _bytes(op.outputs)
        total += read + written
        unknown += u1 + u2
        if f"{SCOPE}/pack" in op.name or f"{SCOPE}/unpack" in op.name:
            packing += read + written
    return total, packing, unknown


def count(spec: str, shape: tuple[int, int], measure_error: bool = True,
          devices: Sequence[str] | None = None) -> dict:
    """One mode's counts (see the module docstring) on two `devices` (default: two
    logical CPU devices): `{"total", "packing"}` per gradient byte and `"unknown"`."""
    ops = ops_from_spec(spec, measure_error=measure_error)
    devices = list(devices or gs.logical_cpus(REPLICAS))[:REPLICAS]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    shapes = [tuple(shape), (shape[1],)]
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, s=s: tf.random.stateless_normal(s, (ctx.replica_id_in_sync_group, 7)))
        for s in shapes]

    @tf.function
    def reduce():
        return ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(v, v) for v in values])

    graph = reduce.get_concrete_function().graph
    total, packing, unknown = touched(graph)
    grad_bytes = REPLICAS * 4 * sum(int(tf.TensorShape(s).num_elements()) for s in shapes)
    return {"total": total / grad_bytes, "packing": packing / grad_bytes, "unknown": unknown}


def run() -> tuple[list[dict], list[str]]:
    """The suite: --compressors (default: every registered one) on --passes_shape."""
    shape = tuple(int(d) for d in FLAGS.passes_shape)
    rows = []
    for mode in FLAGS.compressors or gs.compression.names():
        print(f"[bench] passes {mode}", file=sys.stderr, flush=True)
        on, off = count(mode, shape), count(mode, shape, measure_error=False)
        rows.append({"mode": mode, "touched_per_byte": on["total"],
                     "without_error": off["total"], "pack_unpack": on["packing"],
                     "unknown_ops": on["unknown"]})
    return rows, COLUMNS
