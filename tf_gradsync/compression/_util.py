"""Helpers shared by the compressors: argument checks, bit packing, sparse selection.

Everything here is built from TensorFlow ops only, so it runs inside `tf.function` on
the device that holds the bucket.
"""

from __future__ import annotations

import math

import tensorflow as tf


def check_number(name: str, value, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False, integer: bool = False) -> None:
    """Raises ValueError unless `low <= value <= high` (`<` on an open end)."""
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    closed_high = high != math.inf and not high_open
    bounds = f"{'(' if low_open else '['}{low}, {high}{']' if closed_high else ')'}"
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{name} must be {kind} in {bounds}, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")


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


def poison(x: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """0 if `x` is all finite, NaN otherwise: add it to a payload scale or values so a
    non-finite gradient still reaches every replica as NaN (like a plain all-reduce)."""
    return tf.where(tf.reduce_all(tf.math.is_finite(x)), tf.constant(0, dtype),
                    tf.constant(math.nan, dtype))


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Packs integer codes in [0, 2**bits) into uint8, 8 // bits per byte, LSB first."""
    per = 8 // bits
    codes = tf.cast(codes, tf.int32)
    pad = -numel(codes) % per
    codes = tf.reshape(tf.pad(codes, [[0, pad]]), [-1, per])
    shifted = tf.bitwise.left_shift(codes, tf.range(0, 8, bits, dtype=tf.int32))
    return tf.cast(tf.reduce_sum(shifted, axis=1), tf.uint8)


def unpack(packed: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Inverse of `pack`: the first `n` int32 codes."""
    wide = tf.cast(packed, tf.int32)[:, None]
    codes = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(wide, tf.range(0, 8, bits, dtype=tf.int32)), (1 << bits) - 1)
    return tf.reshape(codes, [-1])[:n]


def scatter(values: tf.Tensor, indices: tf.Tensor, n: int, dtype: tf.DType) -> tf.Tensor:
    """A dense length-`n` vector with `values` added at `indices` (duplicates add up)."""
    return tf.scatter_nd(indices[:, None], tf.cast(values, dtype), [n])


_TOPK_SEED = (0x746F, 0x706B)   # any fixed seed: the result does not depend on it


def top_k_indices(mag: tf.Tensor, k: int, full: tf.Tensor | bool = False,
                  min_numel: int = 1 << 15) -> tf.Tensor:
    """Exactly `tf.math.top_k(mag, k).indices` (as a set), without ranking a large bucket.

    The `r`-th largest of a random sample of 1% of `mag` (at least 1000 entries), with
    `r` the expected number of sampled top-k entries plus five standard deviations,
    is a threshold that at least k entries almost surely reach. When at least k do,
    the top k of those candidates are the top k of the bucket: every entry at or
    above the k-th largest value is a candidate, and candidates keep their index
    order, so ties resolve as in `tf.math.top_k` (lower index first). There are
    only a few more candidates than k, so the cheaper ranking is of the few to drop.
    Otherwise (or when `full` is true, e.g. for non-finite input) the whole bucket
    is ranked.

    Args:
      mag: 1-D magnitudes, static length n.
      k: number of indices, 1 <= k <= n.
      full: bool scalar tensor (or Python bool): rank the whole bucket.
      min_numel: buckets shorter than this are ranked whole.

    Returns:
      int32 [k] indices, in no particular order.
    """
    n = numel(mag)
    s = max(1000, n // 100)
    expected = s * k / n
    r = math.ceil(expected + 5 * math.sqrt(expected) + 8)
    if n < min_numel or 2 * r > s:
        return tf.math.top_k(mag, k, sorted=False).indices
    pick = tf.random.stateless_uniform([s], _TOPK_SEED, 0, n, dtype=tf.int32)
    thr = tf.math.top_k(tf.gather(mag, pick), r, sorted=True).values[r - 1]
    cand = tf.cast(tf.where(mag >= thr)[:, 0], tf.int32)
    cand_mag = tf.gather(mag, cand)
    extra = tf.size(cand) - k

    def keep_k():
        return tf.gather(cand, tf.math.top_k(cand_mag, k, sorted=False).indices)

    def drop_extra():
        # The `extra` smallest candidates, ties dropped from the highest index first
        # (top_k prefers lower indices, so rank the reversed candidates).
        last = tf.size(cand) - 1
        drop = last - tf.math.top_k(-tf.reverse(cand_mag, [0]), extra, sorted=False).indices
        keep = tf.tensor_scatter_nd_update(tf.ones_like(cand, tf.bool), drop[:, None],
                                           tf.zeros_like(drop, tf.bool))
        return tf.boolean_mask(cand, keep)

    def everything():
        return tf.math.top_k(mag, k, sorted=False).indices

    def among_candidates():
        return tf.cond(extra < k, drop_extra, keep_k)
    enough = (extra >= 0) & tf.logical_not(full)
    return tf.ensure_shape(tf.cond(enough, among_candidates, everything), [k])


def select(mag: tf.Tensor, k, seed: tf.Tensor, sample_ratio: float,
           min_sample: int = 1000) -> tuple[tf.Tensor, tf.Tensor]:
    """Indices of (about) the `k` largest entries of `mag` >= 0, without a full top-k.

    A threshold is the top-2k cut of a random sample (scaled to its size); the
    candidates at or above it are then ranked and cut (or, if too few, padded) to
    exactly `k`. Buckets no larger than the sample get an
    exact top-k. Zeros are never selected.

    Args:
      mag: 1-D magnitudes (float32/float64), static length n.
      k: number of entries to return (Python int or int32 scalar tensor, 1 <= k <= n).
      seed: int64[2] stateless seed.
      sample_ratio: fraction of the bucket sampled (at least `min_sample` entries).
      min_sample: smallest sample.

    Returns:
      `(indices, valid)`: int32 [k] indices and a bool [k] mask; invalid (padding)
      entries have index 0.
    """
    n = numel(mag)
    s = min(n, max(min_sample, math.ceil(sample_ratio * n)))
    k = tf.convert_to_tensor(k, tf.int32)
    if s < n:
        sample = tf.gather(mag, tf.random.stateless_uniform([s], seed, 0, n, dtype=tf.int32))
        # Aim the threshold at about 2k entries so the candidates almost always hold
        # the true top k; ranking 2k candidates is still cheap.
        ks = tf.clip_by_value(tf.cast(tf.math.ceil(tf.cast(k, tf.float64) * 2 * s / n), tf.int32),
                              1, s)
        thr = tf.math.top_k(sample, ks, sorted=True).values[ks - 1]
        cand = tf.cast(tf.where((mag >= thr) & (mag > 0))[:, 0], tf.int32)
        cand_mag = tf.gather(mag, cand)
    else:
        cand, cand_mag = tf.range(n, dtype=tf.int32), mag
    pad_mag = tf.fill([k], tf.constant(-1, mag.dtype))
    top = tf.math.top_k(tf.concat([cand_mag, pad_mag], 0), k, sorted=False)
    valid = top.values > 0
    idx = tf.gather(tf.concat([cand, tf.zeros([k], tf.int32)], 0), top.indices)
    return tf.where(valid, idx, 0), valid
