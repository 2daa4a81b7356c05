"""Selection of a bucket's largest magnitudes without ranking the bucket: a threshold
cut from a sample, the candidates above it, the top k of those."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tf_gradsync.compression._segments import Segments
from tf_gradsync.compression._util import count, inline, numel, work_dtype


_TOPK_SEED = (0x746F, 0x706B)   # any fixed seed: the result does not depend on it

#: Entries per sampled run: a sample reads runs of this many neighbours (a 64-byte cache
#: line of float32) at random, for about the cost of one entry each (25M entries, one
#: core: 250K entries in runs of 16 gathered in 0.6 ms, one by one in 11 ms).
SAMPLE_RUN = 16

#: Segments at least this long are ranked alone (with the sampled fast paths); shorter
#: ones are ranked together, padded to the next power of two.
LARGE = 1 << 15
#: The smallest sample a threshold is cut from.
MIN_SAMPLE = 1000


def sample_size(s: int) -> int:
    """`s` rounded down to whole runs (at least one)."""
    return SAMPLE_RUN * max(1, s // SAMPLE_RUN)


def sample_rows(n: int, s: int, seed) -> tf.Tensor:
    """int32 [s // SAMPLE_RUN]: the runs (rows of SAMPLE_RUN entries of a bucket of `n`
    >= SAMPLE_RUN) that `sample_magnitudes` reads, uniform at random."""
    return tf.random.stateless_uniform([s // SAMPLE_RUN], seed, 0, n // SAMPLE_RUN,
                                       dtype=tf.int32, alg="philox")


def sample_magnitudes(x: tf.Tensor, s: int, seed) -> tf.Tensor:
    """|x| at `s` (a `sample_size`) entries of the 1-D `x`, read in runs (`sample_rows`)."""
    rows = numel(x) // SAMPLE_RUN
    lines = tf.reshape(x[:rows * SAMPLE_RUN], [rows, SAMPLE_RUN])  # a view: no copy
    return tf.abs(tf.reshape(tf.gather(lines, sample_rows(numel(x), s, seed)), [-1]))


def gather_many(x: tf.Tensor, indices: tf.Tensor, capacity: int, stage=inline) -> tf.Tensor:
    """`x` at int32 `indices`, whose count is known only at run time (a threshold's
    candidates), gathered through `stage`.

    A compiling stage runs XLA's gather, whose code per index is a load where
    TensorFlow's copies a slice with its checks (350K of 25M entries, one core: 3.8 ms
    against 12.7). XLA compiles for each length it meets, and a compile in a step costs
    more than the gather saves, so the indices are padded (with index 0) to one static
    `capacity`: one compile per call site, made on the first step. Counts above it
    (rare: `capacity` is set well above the expected count) take TensorFlow's gather."""
    if stage is inline:
        return tf.gather(x, indices)
    count = tf.size(indices)

    def compiled():
        padded = tf.pad(indices, [[0, capacity - count]])
        return stage(tf.gather, x, tf.ensure_shape(padded, [capacity]))[:count]
    return tf.cond(count <= capacity, compiled, lambda: tf.gather(x, indices))


def _capacity(n: int, s: int, r: int) -> int:
    """Room for twice the expected candidates of a threshold cut at rank `r` of a sample
    of `s` of `n` entries (at most `n`)."""
    return min(n, 2 * math.ceil(r * n / s))


def top_k_entries(x: tf.Tensor, k: int, full: tf.Tensor | bool = False,
                  stage=inline) -> tuple[tf.Tensor, tf.Tensor]:
    """Exactly `tf.math.top_k(|x|, k).indices` (as a set) and their signed values,
    without ranking a large bucket.

    A value of a sample of 1% of `x` (at least `MIN_SAMPLE` entries,
    `sample_magnitudes`) is cut so that at least k entries almost surely reach it
    (`_sample_rank`). When at least k do, the top k of those candidates are the top k of
    the bucket: every entry at or above the k-th largest value is a candidate, and
    candidates keep their index order, so ties resolve as in `tf.math.top_k` (lower
    index first; `_top_of_candidates`). Otherwise (or when `full` is true, e.g. for
    non-finite input) the whole bucket is ranked.
    Magnitudes are taken where they are read (the sample, the comparison, the
    candidates), and the comparison runs through `stage` (e.g. compiled by XLA, which
    never writes |x| out: 25M entries, one core, 8 ms against 18 as TensorFlow's ops).
    The values come from the candidates' gather, not from a second one over the bucket.

    Args:
      x: 1-D values, static length n.
      k: number of indices, 1 <= k <= n.
      full: bool scalar tensor (or Python bool): rank the whole bucket.
      stage: `stage(fn, *tensors)` runs `fn` on the tensors (inline by default;
        `Context.stage` compiles it when asked): the comparison and the candidates'
        gather (`gather_many`).

    Returns:
      `(indices, values)`: int32 [k] indices, in no particular order, and x at them.
    """
    n = numel(x)
    s = sample_size(max(MIN_SAMPLE, n // 100))
    r = _sample_rank(s, k, n)

    def everything():
        idx = tf.math.top_k(tf.abs(x), k, sorted=False).indices
        return idx, tf.gather(x, idx)
    if n < LARGE or 2 * r > s:
        return everything()
    thr = _kth_largest(sample_magnitudes(x, s, _TOPK_SEED), r)
    cand = nonzero(stage(_reach, x, thr))
    enough = (tf.size(cand) >= k) & tf.logical_not(full)
    capacity = _capacity(n, s, r)
    idx, values = tf.cond(
        enough, lambda: _top_of_candidates(cand, gather_many(x, cand, capacity, stage), k,
                                           capacity, stage), everything)
    return tf.ensure_shape(idx, [k]), tf.ensure_shape(values, [k])


def nonzero(mask: tf.Tensor) -> tf.Tensor:
    """int32 positions of the true entries of the 1-D bool `mask`, in order.

    TensorFlow's `Where`, in the graph on the bucket's device. numpy's compaction is
    three times faster alone (25M flags, a tenth true, one core: 9 ms against 28) but
    runs under the interpreter lock: beside a busy Python thread (a generator feeding
    the input) top-k's selection took 84 ms against 48 (BENCHMARKS.md)."""
    return tf.cast(tf.where(mask)[:, 0], tf.int32)


def _reach(x: tf.Tensor, threshold: tf.Tensor) -> tf.Tensor:
    """|x| >= threshold."""
    return tf.abs(x) >= threshold


def _sample_rank(s: int, k: int, n: int) -> int:
    """The rank in a sample of `s` of `n` entries whose value at least k entries almost
    surely reach: the expected number of sampled top-k entries plus five standard
    deviations (and 8). The deviation is the one of runs of `SAMPLE_RUN` entries that
    are all in the top k or all out of it (neighbours in a gradient are alike: a dead
    unit's row of a kernel is all zeros), which bounds it for any bucket."""
    expected = s * k / n
    return min(s, math.ceil(expected + 5 * math.sqrt(SAMPLE_RUN * expected) + 8))


def _binned(mag: tf.Tensor, k: int | tf.Tensor, bins: int = 1024
            ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Magnitudes binned between their least and largest (`bins` equal widths), and the
    bin the k-th largest (k <= |mag|) falls in: `(int32 bin of each, that bin, how many
    lie in the bins above it)`. The bin is monotone in the magnitude, so every entry of
    a higher bin is at least as large as every entry of a lower one."""
    # Binned in float32 at least: a 16-bit bin position can round past the last bin
    # (1023 is 1024 in bfloat16), which the counts would then leave out.
    mag = tf.cast(mag, work_dtype(mag.dtype))
    lo = tf.reduce_min(mag)
    scale = bins / (tf.reduce_max(mag) - lo)
    # Equal (or infinite) magnitudes: one bin, everything ranked.
    scale = tf.where(tf.math.is_finite(scale), scale, tf.zeros([], scale.dtype))
    # A NaN or infinite magnitude (a non-finite bucket, which the caller sends as NaN)
    # goes to the top bin: cast to an integer, its NaN position would be out of range.
    pos = (mag - lo) * scale
    b = tf.cast(tf.where(tf.math.is_nan(pos), tf.constant(bins - 1, pos.dtype),
                         tf.minimum(pos, bins - 1)), tf.int32)
    counts = tf.math.bincount(b, minlength=bins, maxlength=bins)
    from_top = tf.cumsum(counts, reverse=True)      # entries in this bin or above
    cut = tf.reduce_sum(tf.cast(from_top >= k, tf.int32)) - 1
    return b, cut, from_top[cut] - counts[cut]


def _kth_largest(mag: tf.Tensor, k: int) -> tf.Tensor:
    """The k-th largest of the magnitudes `mag` (k <= |mag|), as
    `tf.math.top_k(mag, k).values[k - 1]`, ranking only the bin it falls in
    (`_binned`): a sample of 250K magnitudes cut at rank 26K (top-k at 10%) in 1-2 ms
    instead of 11."""
    b, cut, above = _binned(mag, k)
    inside = tf.boolean_mask(mag, tf.equal(b, cut))
    return tf.reduce_min(tf.math.top_k(inside, k - above, sorted=False).values)


def _take(tensors: list[tf.Tensor], positions: tf.Tensor, capacity: int, stage=inline
          ) -> list[tf.Tensor]:
    """Each of the 1-D `tensors` (one length, known only at run time) at the int32
    `positions` (a static length).

    A compiling stage runs XLA's gather, the tensors padded to one static `capacity`
    (one compile per call site, as `gather_many`): 2.5M of 2.8M candidates and their
    values, one core, 4.7 ms against 16 for TensorFlow's. Longer tensors (rare) take
    TensorFlow's gather."""
    def plain():
        return [tf.gather(t, positions) for t in tensors]
    if stage is inline:
        return plain()
    length = tf.size(tensors[0])

    def compiled():
        padded = [tf.ensure_shape(tf.pad(t, [[0, capacity - length]]), [capacity])
                  for t in tensors]
        return stage(lambda p, *ts: [tf.gather(t, p) for t in ts], positions, *padded)
    return tf.cond(length <= capacity, compiled, plain)


def _top_of_candidates(cand: tf.Tensor, values: tf.Tensor, k: int, capacity: int,
                       stage=inline) -> tuple[tf.Tensor, tf.Tensor]:
    """The `k` (<= |cand|) candidates of largest magnitude, ties to the lower index, and
    their values (`values`: x at `cand`), in index order.

    Every candidate in a bin (`_binned`) above the one the k-th largest falls in is
    kept, and only that bin's are ranked, for the rest of k. 25M entries, 1% kept, one
    core: 4-6 ms for 270K-410K candidates, against 11-38 ms for ranking the ones to
    drop. The kept ones are marked and taken in one pass (`_take`, with `capacity` and
    `stage`)."""
    mag = tf.abs(values)
    b, cut, above = _binned(mag, k)
    inside = nonzero(tf.equal(b, cut))
    # top_k prefers lower indices among ties; the bin's candidates are in index order.
    top = tf.gather(inside, tf.math.top_k(tf.gather(mag, inside), k - above,
                                          sorted=False).indices)
    keep = tf.tensor_scatter_nd_update(b > cut, top[:, None], tf.ones_like(top, tf.bool))
    positions = tf.ensure_shape(nonzero(keep), [k])
    idx, kept = _take([cand, values], positions, capacity, stage)
    return idx, kept


def select(x: tf.Tensor, k: int, seed: tf.Tensor, sample_ratio: float,
           stage=inline) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Indices of (about) the `k` largest magnitudes of `x`, without a full top-k.

    A threshold is cut from a random sample (`sample_magnitudes`, scaled to its size)
    so that a few more than k entries almost surely reach it, as in `top_k_entries`;
    the candidates at or above it are then cut to the `k` largest (the top k of the
    bucket) or, if too few, padded to exactly `k`. Buckets no larger than the sample
    get an exact top-k. Zeros are never selected.

    Args:
      x: 1-D values (float32/float64), static length n.
      k: number of entries to return, 1 <= k <= n.
      seed: int64[2] stateless seed.
      sample_ratio: fraction of the bucket sampled (at least `MIN_SAMPLE` entries).
      stage: runs the comparison with the threshold and the candidates' gather, as in
        `top_k_entries`.

    Returns:
      `(indices, valid, values)`: int32 [k] distinct indices, a bool [k] mask and x at
      the indices; invalid (padding) entries hold entries that were not selected, to be
      sent as zeros.
    """
    n = numel(x)
    s = min(n, max(MIN_SAMPLE, math.ceil(sample_ratio * n)))
    if s >= n or n < SAMPLE_RUN:
        # An exact top-k; zeros it takes go as padding (not valid).
        top = tf.math.top_k(tf.abs(x), k, sorted=False)
        return top.indices, top.values > 0, tf.gather(x, top.indices)
    s = sample_size(s)
    r = _sample_rank(s, k, n)
    thr = _kth_largest(sample_magnitudes(x, s, seed), r)
    # At least the smallest normal number: zeros are never candidates.
    tiny = tf.constant(np.finfo(x.dtype.as_numpy_dtype).tiny, x.dtype)
    chosen = stage(_reach, x, tf.maximum(thr, tiny))
    cand = nonzero(chosen)

    def ranked():
        capacity = _capacity(n, s, r)
        idx, values = _top_of_candidates(cand, gather_many(x, cand, capacity, stage), k,
                                         capacity, stage)
        return idx, tf.ones([k], tf.bool), values

    def padded():
        # Every candidate, then the first entries that are not candidates: padding at
        # distinct indices lets a payload decode by placement.
        rest = nonzero(~chosen)
        idx = tf.concat([cand, rest], 0)[:k]
        return idx, tf.range(k) < tf.size(cand), tf.gather(x, idx)
    idx, valid, values = tf.cond(tf.size(cand) >= k, ranked, padded)
    return tf.ensure_shape(idx, [k]), tf.ensure_shape(valid, [k]), tf.ensure_shape(values, [k])


def sampled_largest(x: tf.Tensor, seg: Segments, ratio: float, seed, sample_ratio: float,
                    stage, dtype: tf.DType) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The `counts(ratio, seg)` largest magnitudes of each tensor of `x`, long tensors
    through a sampled threshold (`select`), as threshold and DGC send them.

    Returns:
      `(values in dtype, zero in a slot of padding; int32 indices; bool mask of the
      slots holding a selection)`.
    """
    seed = tf.convert_to_tensor(seed, tf.int64)
    idx, valid, values = top_per_segment(
        x, seg, counts(ratio, seg), lambda m, k: select(m, k, seed, sample_ratio, stage=stage))
    if valid is None:
        valid = tf.ones_like(idx, tf.bool)
    return tf.cast(tf.where(valid, values, tf.zeros([], values.dtype)), dtype), idx, valid


def magnitude_send_interval(ratio: float) -> float:
    """Steps an entry waits between sends when the `ratio` largest go out (top-k,
    threshold, dgc): (1/ratio)^(2/3). The large entries go out about every step and the
    small ones about every 1/ratio steps; where between the two is measured, under Adam
    with its first moment off (`Compressor.adapt_optimizer`), over three seeds of the
    convergence matrix (BENCHMARKS.md): two thirds of the way in log scale (21.5 steps
    at 1%, 4.64x the learning rate) left top-k's worst cell 0.8 points below
    uncompressed training, the geometric middle (10 steps, 3.16x) 1.2 below."""
    return ratio ** (-2 / 3)


def counts(ratio: float, seg: Segments) -> list[int]:
    """k per segment: max(1, ceil(ratio * size)), at most the size."""
    return [count(ratio, s) for s in seg.sizes]


def top_per_segment(x: tf.Tensor, seg: Segments, ks, large):
    """Indices and values of the `ks[t]` largest magnitudes of each segment of `x`.

    Segments whose k is their size are sent whole; short segments are grouped by size
    class (up to the next power of two) and ranked together by one `top_k` per class;
    long ones go through `large(x_segment, k) -> (indices, valid or None, values)` (e.g.
    `top_k_entries` or `select`). Ties go to the lower index, as in `tf.math.top_k`.

    Args:
      x: 1-D values, static length `seg.numel`.
      seg: the segments.
      ks: k per segment, 1 <= k <= size.
      large: selection for long segments.

    Returns:
      `(indices, valid, values)`: int32 [sum(ks)] bucket indices, a bool mask of the
      entries that hold a selection (None when all do), and x at the indices.
    """
    idx_parts, valid_parts, value_parts = [], [], []
    whole = [t for t in range(seg.count) if ks[t] == seg.sizes[t]]
    if whole:
        idx_parts.append(tf.constant(np.concatenate(
            [np.arange(seg.offsets[t], seg.offsets[t] + seg.sizes[t]) for t in whole]), tf.int32))
        valid_parts.append(None)
        value_parts.append(None)
    classes: dict[int, list[int]] = {}
    for t in range(seg.count):
        if ks[t] < seg.sizes[t] < LARGE:
            classes.setdefault(max(1, (seg.sizes[t] - 1).bit_length()), []).append(t)
    for bits, rows in sorted(classes.items()):
        width = 1 << bits
        table = np.full((len(rows), width), seg.numel, np.int32)
        for r, t in enumerate(rows):
            table[r, :seg.sizes[t]] = np.arange(seg.offsets[t], seg.offsets[t] + seg.sizes[t])
        kmax = max(ks[t] for t in rows)
        # Pads (past the bucket's end) rank below every magnitude, and a NaN above them:
        # top_k ranks a NaN below -1, and a row of NaNs (a non-finite step, which the
        # caller sends as NaN) would keep the pads, whose index is out of the bucket.
        mag = tf.abs(tf.gather(x, np.minimum(table, seg.numel - 1)))
        mag = tf.where(table < seg.numel,
                       tf.where(tf.math.is_nan(mag), tf.constant(np.inf, mag.dtype), mag), -1)
        top = tf.math.top_k(mag, kmax, sorted=True).indices
        # Row r keeps its first ks[r] (largest) columns.
        flat = np.concatenate([r * kmax + np.arange(ks[t]) for r, t in enumerate(rows)])
        rows_of = np.concatenate([np.full(ks[t], r) for r, t in enumerate(rows)])
        cols = tf.gather(tf.reshape(top, [-1]), flat)
        idx_parts.append(tf.gather(tf.constant(table.ravel()), rows_of * width + cols))
        valid_parts.append(None)
        value_parts.append(None)
    for t in range(seg.count):
        if ks[t] < seg.sizes[t] >= LARGE:
            lo = seg.offsets[t]
            idx, valid, values = large(x[lo:lo + seg.sizes[t]], ks[t])
            idx_parts.append(idx + lo)
            valid_parts.append(valid)
            value_parts.append(values)
    # The short segments' values are gathered here; the long ones' came with them.
    value_parts = [tf.gather(x, i) if v is None else v for i, v in zip(idx_parts, value_parts)]
    idx, values = ((idx_parts[0], value_parts[0]) if len(idx_parts) == 1
                   else (tf.concat(idx_parts, 0), tf.concat(value_parts, 0)))
    if all(v is None for v in valid_parts):
        return idx, None, values
    valid = [tf.ones([tf.compat.dimension_value(i.shape[0])], tf.bool) if v is None else v
             for i, v in zip(idx_parts, valid_parts)]
    return idx, tf.concat(valid, 0), values
