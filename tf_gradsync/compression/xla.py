"""Codecs compiled by XLA: one fused loop instead of a pass over memory per op.

Decoding a payload is a chain of elementwise ops over the bucket (codes unpacked,
scaled by their block's scale, summed over the replicas' payloads, subtracted from the
error feedback's input). TensorFlow runs each op as a pass with a fresh output
buffer, and sums gathered payloads through a stack of their decodes; XLA fuses the
chain into one loop that writes the bucket once. One core, 25M entries, summing the
gathered payloads of 2 / 4 replicas: sign 110 -> 45 / 140 -> 60 ms, int8 40 -> 16 /
92 -> 19, top-k (4) 104 -> 24 (BENCHMARKS.md, "Compiled codecs").

Compressions compile where that was measured to pay (`Compressor.xla_compress`): sign
26 -> 18 ms, int8 37 -> 26, onebit 48 -> 35 on 25M entries. Elsewhere their statistics
are mostly reductions, which XLA's CPU code runs at a third of TensorFlow's speed (a
sum of squares of 25M entries: 13 ms against 4.7; TernGrad's whole compress 215 -> 305
ms), or selections, which need shapes known only at run time. The error feedback's
norms stay TensorFlow's for the same reason. A compressor with such statistics
compiles the stage that follows them (`stage`): QSGD's and TernGrad's stochastic
rounding, draws included, is one loop (QSGD on 25M entries: 200 -> 25 ms); random-k's
strata and gather are two (12.5M of 25M entries: 57 ms gathered by TensorFlow, 12 by XLA).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import tensorflow as tf

_tracing = threading.local()

#: Buckets of fewer entries than this run their codecs as TensorFlow's ops even where
#: the ops compile (`compiles`): the fused loop saves nothing measurable there, while
#: each compiled stage costs 0.1-0.5 s to compile on a bucket's first step and again at
#: each retrace. One core, a bucket's whole data path: 4K and 64K entries took the same
#: time compiled or not (2.1-2.7 ms for sign, int8, QSGD, top-k, PowerSGD), 256K
#: entries 2.5 ms against 4.4 (QSGD), 2.9 against 6.3 (TernGrad) (BENCHMARKS.md,
#: "Small buckets uncompiled"). The line sits low in that range (16K) so that buckets
#: of models' size, which might gain at some size not measured, keep compiling.
MIN_COMPILED_NUMEL = 1 << 14


def compiles(jit_compile: bool, numel: int) -> bool:
    """Whether `CompressedAllReduce(jit_compile=...)` compiles the codecs of a bucket of
    `numel` entries (`MIN_COMPILED_NUMEL`)."""
    return jit_compile and numel >= MIN_COMPILED_NUMEL


def tracing() -> bool:
    """True while `call` traces: a decoding may then pick the form XLA runs fastest."""
    return getattr(_tracing, "depth", 0) > 0


@contextlib.contextmanager
def summing_payloads():
    """Within it, while tracing (`call`), `Segments.apply` sums its result over the
    leading axes (a gather's payloads, stacked) piece by piece, and returns the sum:
    a loop per piece of the bucket with the sum in it, instead of one over every
    payload's decode followed by a reduction (4 sign payloads of a 9M bucket of 56
    tensors summed, one core: 30 -> 17 ms)."""
    before = getattr(_tracing, "summing", False)
    _tracing.summing = True
    try:
        yield
    finally:
        _tracing.summing = before


def summing() -> bool:
    """Whether `Segments.apply` sums over the leading axes (`summing_payloads`)."""
    return tracing() and getattr(_tracing, "summing", False)


def call(fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)` compiled by XLA as one cluster, on the current device.

    Args:
      fn: builds TensorFlow ops from `args` (nested tensors); it may close over other
        tensors. Its result is a nested structure of tensors.
      *args: nested structures of tensors.

    Returns:
      What `fn` returns, computed by the compiled cluster.

    Example:
      >>> call(lambda x: x * 2 + 1, tf.ones([3])).numpy()
      array([3., 3., 3.], dtype=float32)
    """
    def traced(*a):
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            return fn(*a)
        finally:
            _tracing.depth -= 1
    return tf.function(traced, jit_compile=True, autograph=False)(*args)


def compress(compressor, x: tf.Tensor, ctx):
    """`compressor.compress(x, ctx)`, compiled (`call`) when the context asks
    (`Context.jit_compile`) and the compressor's compress compiles (`xla_compress`:
    its meta then holds no tensors, only Python values)."""
    if not (ctx.jit_compile and compressor.xla_compress):
        return checked(compressor, compressor.compress(x, ctx))
    metas = []

    def payload(v):
        sent, meta = checked(compressor, compressor.compress(v, ctx))
        metas.append(meta)
        return sent
    return call(payload, x), metas[0]


def checked(compressor, returned) -> tuple[tuple, Any]:
    """What `compressor.compress` `returned` as `(payload, meta)`, the payload a tuple of
    tensors, or an error that says what it was (unpacked unchecked, a tensor would fail
    as a symbolic tensor iterated)."""
    def refuse(got):
        raise TypeError(f"{type(compressor).__name__}.compress must return (payload, meta), "
                        f"the payload a tuple of tensors; got {got}")
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        refuse(type(returned).__name__)
    payload, meta = returned
    sequence = isinstance(payload, (tuple, list))    # a tensor is neither
    if not sequence or not all(tf.is_tensor(t) for t in payload):
        refuse([type(t).__name__ for t in payload] if sequence else type(payload).__name__)
    return tuple(payload), meta


def stage(ctx, fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)`, an elementwise stage of a codec, compiled (`call`) when the context
    asks (`Context.jit_compile`), inline when already inside a compiled cluster.

    A compressor whose statistics are reductions (which stay TensorFlow's, see above)
    computes them first and hands them to the stage that reads the bucket again."""
    if ctx.jit_compile and not tracing():
        return call(fn, *args)
    return fn(*args)


def decode(compressor, ctx, fn: Callable[..., tf.Tensor], *args) -> tf.Tensor:
    """`fn(*args)`, one of `compressor`'s decodings, compiled (`stage`) when the context
    asks (`Context.jit_compile`) and the compressor's decodings compile (`xla_decode`)."""
    if compressor.xla_decode:
        return stage(ctx, fn, *args)
    return fn(*args)


__all__ = ["MIN_COMPILED_NUMEL", "call", "compiles", "compress", "decode", "stage", "summing",
           "summing_payloads", "tracing"]
