"""Bucket planning, packing and unpacking.

Small gradients are fused into flat buckets so that one transfer (and one compressor
call) serves many tensors, amortising per-message latency; large ones travel alone.
The plan is pure Python and depends only on the tensors' shapes and dtypes, in their
given order, so every replica and every worker derives the same plan independently.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_gradsync.compression.base import Layout
from tf_gradsync.config import check_bucket_bytes


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one input tensor lives inside its bucket."""

    index: int          # position in the caller's list
    shape: tuple[int, ...]
    offset: int         # first element inside the flat bucket
    size: int           # number of elements


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat buffer of one dtype holding several tensors back to back."""

    id: int
    dtype: tf.DType
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return sum(s.size for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.size

    @property
    def layout(self) -> Layout:
        """What a compressor sees of this bucket: its tensors' shapes, in order."""
        return Layout(tuple(s.shape for s in self.slots), self.dtype)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """An ordered set of buckets covering every input tensor exactly once."""

    buckets: tuple[Bucket, ...]
    num_tensors: int
    fingerprint: str    # stable across processes: keys per-bucket state

    def nth(self, ordinal: int) -> "BucketPlan":
        """The same buckets for the `ordinal`-th reduction of these tensors in one step
        (0: this plan): another fingerprint, so its state, seeds and collectives are its
        own."""
        if ordinal == 0:
            return self
        key = f"{self.fingerprint}/{ordinal}".encode()
        return dataclasses.replace(self, fingerprint=hashlib.sha1(key).hexdigest()[:12])

    def pack(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Flattens and concatenates `tensors` into one 1-D tensor per bucket."""
        if len(tensors) != self.num_tensors:
            raise ValueError(f"plan covers {self.num_tensors} tensors, got {len(tensors)}")
        flats = []
        for b in self.buckets:
            parts = [tf.reshape(tensors[s.index], [-1]) for s in b.slots]
            flats.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))
        return flats

    def unpack(self, flats: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Inverse of `pack`: returns the tensors in the caller's original order."""
        out: list[tf.Tensor | None] = [None] * self.num_tensors
        for b, flat in zip(self.buckets, flats):
            parts = [flat] if len(b.slots) == 1 else tf.split(flat, [s.size for s in b.slots])
            for s, part in zip(b.slots, parts):
                out[s.index] = tf.reshape(part, s.shape)
        return out  # type: ignore[return-value]


def plan_buckets(specs: Sequence[tuple[Sequence[int], tf.DType]], bucket_bytes: int) -> BucketPlan:
    """Fuses tensors into dtype-homogeneous buckets of at most `bucket_bytes`.

    Tensors are visited in reverse order, because backpropagation produces the last
    layers' gradients first: their buckets fill first and can be sent while earlier
    gradients are still being computed. A tensor larger than `bucket_bytes` gets a
    bucket of its own.

    Args:
      specs: `(shape, dtype)` per tensor, in the caller's order. Shapes must be fully
        defined.
      bucket_bytes: upper bound on a bucket's size in bytes (> 0).

    Returns:
      A `BucketPlan`, identical for identical `specs` and `bucket_bytes`.

    Raises:
      ValueError: for a `bucket_bytes` that is not a positive integer, a spec that is not
        a `(shape, dtype)` pair, a dtype neither numeric nor bool, or a shape that is not
        fully defined; the message names the bad value and what is allowed.

    Example:
      >>> plan = plan_buckets([((3, 4), tf.float32), ((4,), tf.float32)], 1 << 20)
      >>> [b.numel for b in plan.buckets]
      [16]
    """
    check_bucket_bytes(bucket_bytes)
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise ValueError(f"specs must be a list of (shape, dtype) pairs, got {specs!r}")
    # Buckets are numbered by when they were opened, i.e. by when their first
    # gradient becomes available during backpropagation.
    open_slots: dict[tf.DType, list[Slot]] = {}
    open_bytes: dict[tf.DType, int] = {}
    opened: list[tuple[tf.DType, list[Slot]]] = []
    for index in reversed(range(len(specs))):
        shape, dtype = _check_spec(index, specs[index])
        shape_t = tuple(int(d) for d in shape)
        size = int(np.prod(shape_t, dtype=np.int64))
        nbytes = size * dtype.size
        slots = open_slots.get(dtype)
        if not slots or open_bytes[dtype] + nbytes > bucket_bytes:
            slots = open_slots[dtype] = []
            open_bytes[dtype] = 0
            opened.append((dtype, slots))
        offset = sum(s.size for s in slots)
        slots.append(Slot(index, shape_t, offset, size))
        open_bytes[dtype] += nbytes
    buckets = tuple(Bucket(i, d, tuple(s)) for i, (d, s) in enumerate(opened))
    key = repr((int(bucket_bytes), [(tuple(tf.TensorShape(s).as_list()), tf.as_dtype(d).name)
                                    for s, d in specs])).encode()
    return BucketPlan(buckets, len(specs), hashlib.sha1(key).hexdigest()[:12])


def _check_spec(index: int, spec) -> tuple[tf.TensorShape, tf.DType]:
    """The `(shape, dtype)` of spec `index`, or a ValueError that says what is wrong."""
    try:
        shape, dtype = spec
    except (TypeError, ValueError):
        raise ValueError(f"spec {index} must be a (shape, dtype) pair, got {spec!r}") from None
    try:
        dtype = tf.as_dtype(dtype)
    except TypeError:
        raise ValueError(f"tensor {index} has dtype {dtype!r}; allowed: a numeric TensorFlow "
                         "dtype (e.g. float16, bfloat16, float32, float64, int32, int64)") from None
    if not (dtype.is_floating or dtype.is_integer or dtype.is_complex or dtype == tf.bool):
        raise ValueError(f"tensor {index} has dtype {dtype.name}, which cannot be bucketed; "
                         "allowed: numeric dtypes (floating, integer, complex) and bool")
    try:
        shape = tf.TensorShape(shape)
    except (TypeError, ValueError):
        raise ValueError(f"tensor {index} has shape {shape!r}; allowed: a sequence of "
                         "non-negative integers") from None
    if not shape.is_fully_defined():
        raise ValueError(
            f"tensor {index} has shape {shape}; bucketing needs fully defined shapes "
            "(non-negative integer dimensions)")
    return shape, dtype
