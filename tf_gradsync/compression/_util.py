"""Helpers shared by the compressors: argument checks, work dtypes, finiteness.

Everything in this package's helper modules (`_bits`, `_sparse`, `_segments`,
`_selection`, `_draws`) is built from TensorFlow ops only, so it runs inside
`tf.function` on the device that holds the bucket.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import tensorflow as tf


def check_number(name: str, value, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False, integer: bool = False) -> None:
    """Raises ValueError unless `low <= value <= high` (`<` on an open end). Numpy's
    numbers count (a setting read from an array or a sweep); booleans do not."""
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, numbers.Integral if integer else numbers.Real)
    closed_high = high != math.inf and not high_open
    bounds = f"{'(' if low_open else '['}{low}, {high}{']' if closed_high else ')'}"
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{name} must be {kind} in {bounds}, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")


def check_flag(name: str, value) -> None:
    """Raises ValueError unless `value` is True or False (numpy's too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def by_setting(cache: dict, codec, layout, make):
    """`make()`, kept in `cache` by the codec's type and repr and `layout`: what a codec
    builds for a layout follows from its settings, which its repr names (workers check
    that theirs agree by it), and tracing it costs a second or more. The cache empties
    past 100,000 entries."""
    key = (type(codec), repr(codec), layout)
    if key not in cache:
        if len(cache) > 100_000:
            cache.clear()
        cache[key] = make()
    return cache[key]


def work_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype compressors compute in: float64 for float64 input, float32 otherwise."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def numel(x: tf.Tensor) -> int:
    """Static length of a flat bucket (buckets always have static shapes)."""
    n = x.shape.num_elements()
    if n is None:
        raise ValueError(f"compressors need a static bucket shape, got {x.shape}")
    return n


def count(ratio: float, n: int) -> int:
    """k = max(1, ceil(ratio * n)), at most n (and 0 for an empty bucket)."""
    return min(n, max(1, math.ceil(ratio * n)))


def all_finite(x: tf.Tensor) -> tf.Tensor:
    """bool scalar: whether every entry of `x` is finite, read as whether their sum (in
    float32 at least) is, one read of `x` with nothing written (25M entries, one core:
    4.6 ms against 6.8 for a finiteness mask and its reduction). A sum that overflows
    counts as non-finite: entries near float32's limit are no gradient to keep."""
    return tf.math.is_finite(tf.reduce_sum(tf.cast(x, work_dtype(x.dtype))))


def poison(x: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """0 if `x` is all finite (`all_finite`), NaN otherwise: add it to a payload scale or
    values so a non-finite gradient still reaches every replica as NaN (like a plain
    all-reduce)."""
    return tf.where(all_finite(x), tf.constant(0, dtype), tf.constant(math.nan, dtype))


def scale_dtype(dtype: tf.DType) -> tf.DType:
    """The wire dtype of per-block scales: bfloat16 (float32's range in 2 bytes; error
    feedback absorbs its rounding), float64 for float64 input."""
    return tf.float64 if dtype == tf.float64 else tf.bfloat16


def inline(fn, *args):
    """The stage that runs `fn(*args)` as it is: the default of the helpers that
    take a `stage` (`Context.stage` compiles it when asked)."""
    return fn(*args)
