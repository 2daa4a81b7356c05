"""Helpers shared by the compressors: argument checks, bit packing, sparse selection.

Everything here is built from TensorFlow ops only, so it runs inside `tf.function` on
the device that holds the bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_gradsync.compression import xla


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


#: The unsigned word holding a byte's codes, one code per byte, by codes per byte.
_WORDS = {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Packs integer codes in [0, 2**bits) into uint8, 8 // bits per byte, LSB first."""
    per = 8 // bits
    codes = tf.cast(codes, tf.uint8)
    pad = -numel(codes) % per
    if pad:
        codes = tf.pad(codes, [[0, pad]])
    if per == 1:
        return codes
    if sys.byteorder == "little":
        # The `per` code bytes of an output byte read as one word, code i at bit 8 i; one
        # multiply adds a copy of code i at bit 8 (per - 1) + bits i for each i, into the
        # top byte, and every other copy lands in a field of its own below it or past
        # the word's end (no carries). One pass over the codes instead of a multiply and
        # a reduction over bytes: 25M one-bit codes in 15 ms instead of 73, two-bit 15
        # instead of 99.
        word = _WORDS[per]
        top = 8 * (per - 1)
        spread = sum(1 << (top - (8 - bits) * i) for i in range(per))
        w = tf.bitcast(tf.reshape(codes, [-1, per]), word) * tf.constant(spread, word)
        return tf.cast(tf.bitwise.right_shift(w, tf.constant(top, word)), tf.uint8)
    # In uint8 throughout: the codes' bit fields do not overlap, so the weighted sum of a
    # byte's codes stays below 256, and no int32 copy of the bucket is made.
    weights = tf.constant([1 << (bits * i) for i in range(per)], tf.uint8)
    return tf.reduce_sum(tf.reshape(codes, [-1, per]) * weights, axis=1)


def unpack(packed: tf.Tensor, bits: int, n: int, values=None, dtype: tf.DType = tf.int32
           ) -> tf.Tensor:
    """Inverse of `pack`: the first `n` codes, or `values[code]` when given.

    One lookup per byte in a table of its 8 // bits codes (or their values), instead of
    shifting and masking a widened copy of the bucket once per code.

    Args:
      packed: uint8 bytes from `pack` (leading axes, e.g. one per replica, are kept:
        `[..., bytes]` gives `[..., n]`).
      bits: bits per code.
      n: codes to return.
      values: optional, what each code in [0, 2**bits) stands for.
      dtype: the result's dtype (int32 codes by default).
    """
    per = 8 // bits
    if xla.tracing():
        # XLA fuses shifts and selects into its loop and runs a table lookup as a
        # gather: four sign payloads of 25M entries decoded and summed in 18 ms
        # against 56 with the table.
        codes = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(tf.cast(packed, tf.int32)[..., None],
                                   tf.constant(bits * np.arange(per), tf.int32)),
            (1 << bits) - 1)
        if values is None:
            looked = tf.cast(codes, dtype)
        else:
            looked = tf.fill(tf.shape(codes), tf.constant(values[0], dtype))
            for code, value in enumerate(values[1:], 1):
                looked = tf.where(codes == code, tf.constant(value, dtype), looked)
        flat = tf.reshape(looked, [*packed.shape[:-1], -1])
        return flat if flat.shape[-1] == n else flat[..., :n]
    byte = np.arange(256)[:, None]
    table = (byte >> (bits * np.arange(per))[None, :]) & ((1 << bits) - 1)
    if values is not None:
        table = np.asarray(values)[table]
    looked = tf.gather(tf.constant(table, dtype), tf.cast(packed, tf.int32))
    flat = tf.reshape(looked, [*packed.shape[:-1], -1])
    return flat if flat.shape[-1] == n else flat[..., :n]


def scatter(values: tf.Tensor, indices: tf.Tensor, n: int, dtype: tf.DType) -> tf.Tensor:
    """A dense length-`n` vector with `values` added at `indices` (duplicates add up).

    A segment sum, not `scatter_nd`: on a CPU it is seven times faster (2.5M values into
    5M entries on one core: 13 ms against 88 ms)."""
    return tf.math.unsorted_segment_sum(tf.cast(values, dtype), indices, n)


def place(values: tf.Tensor, indices: tf.Tensor, n: int, dtype: tf.DType) -> tf.Tensor:
    """A dense length-`n` vector holding `values` at `indices`, which must be distinct,
    and zeros elsewhere (an index out of range is an error).

    Not a scatter that adds: a sparse-to-dense placement costs little more than the
    zeros (250K values into 25M entries, one core: 15 ms against 63 for `scatter`)."""
    return tf.raw_ops.SparseToDense(sparse_indices=indices, output_shape=[n],
                                    sparse_values=tf.cast(values, dtype),
                                    default_value=tf.zeros([], dtype), validate_indices=False)


def sum_sparse(parts: Sequence[Sequence[tf.Tensor]], n: int, dtype: tf.DType) -> tf.Tensor:
    """The sum of sparse payloads `(values, indices)`, each part's indices distinct, as a
    dense length-`n` vector.

    One or two parts are placed (`place`) and added (two parts of 250K values into 25M
    entries, one core: 28 ms against 102 for one scatter of both). More parts are one
    scatter of every part's values, in the parts' order, instead of a dense decode per
    part and a sum over them (4 parts: 105 ms against 377). A CPU's scatter adds in
    input order, so every replica gets the same sum. A GPU's adds with atomics in no
    fixed order: two addends of an entry sum the same either way, three or more can
    round differently on each device, so with a GPU each part is placed alone and the
    parts summed. Compiled by XLA (`xla.tracing`), one scatter of two parts beats two
    placements (25 against 44 ms) and places one as fast.
    """
    if len(parts) == 1 or (len(parts) == 2 and not xla.tracing()):
        dense = [place(p[0], p[1], n, dtype) for p in parts]
        return dense[0] if len(dense) == 1 else dense[0] + dense[1]
    if tf.config.list_logical_devices("GPU"):
        return tf.reduce_sum(tf.stack([place(p[0], p[1], n, dtype) for p in parts]), 0)
    return scatter(tf.concat([p[0] for p in parts], 0), tf.concat([p[1] for p in parts], 0),
                   n, dtype)


class SparseDecoding:
    """Decoding of sparse payloads `(values, int32 indices)` with distinct indices and
    meta `(bucket length, dtype)`, shared by the compressors that send them (a mixin
    before `Compressor` in their bases). Their selections need shapes known only at
    run time; their decodings compile with XLA."""

    xla_decode = True

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Places the values into zeros of the bucket's length and dtype (`place`)."""
        n, dtype = meta
        return place(payload[0], payload[1], n, dtype)

    def combine(self, received, meta) -> tf.Tensor:
        """Every replica's values summed into one dense bucket (`sum_sparse`)."""
        return sum_sparse(received, *meta)

    def decode_chunks(self, payloads, metas, chunks) -> tf.Tensor:
        """Every chunk's values placed at once into the whole bucket (their indices
        moved by the chunk's offset), instead of a placement per chunk and a copy of
        each into a concatenation: 4 top-k chunks of a 25M bucket, one core, 16-17 ms
        against 25-26."""
        values = tf.concat([p[0] for p in payloads], 0)
        indices = tf.concat([p[1] + o for p, o in zip(payloads, chunks.offsets)], 0)
        return place(values, indices, sum(m[0] for m in metas), metas[0][1])


_TOPK_SEED = (0x746F, 0x706B)   # any fixed seed: the result does not depend on it

#: Entries per sampled run: a sample reads runs of this many neighbours (a 64-byte cache
#: line of float32) at random, for about the cost of one entry each (25M entries, one
#: core: 250K entries in runs of 16 gathered in 0.6 ms, one by one in 11 ms).
SAMPLE_RUN = 16


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


def _inline(fn, *args):
    return fn(*args)


def gather_many(x: tf.Tensor, indices: tf.Tensor, capacity: int, stage=_inline) -> tf.Tensor:
    """`x` at int32 `indices`, whose count is known only at run time (a threshold's
    candidates), gathered through `stage`.

    A compiling stage runs XLA's gather, whose code per index is a load where
    TensorFlow's copies a slice with its checks (350K of 25M entries, one core: 3.8 ms
    against 12.7). XLA compiles for each length it meets, and a compile in a step costs
    more than the gather saves, so the indices are padded (with index 0) to one static
    `capacity`: one compile per call site, made on the first step. Counts above it
    (rare: `capacity` is set well above the expected count) take TensorFlow's gather."""
    if stage is _inline:
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
                  min_numel: int = 1 << 15, stage=_inline) -> tuple[tf.Tensor, tf.Tensor]:
    """Exactly `tf.math.top_k(|x|, k).indices` (as a set) and their signed values,
    without ranking a large bucket.

    A value of a sample of 1% of `x` (at least 1000 entries, `sample_magnitudes`) is cut
    so that at least k entries almost surely reach it (`_sample_rank`). When at least k
    do, the top k of those candidates are the top k of the bucket: every entry at or
    above the k-th largest value is a candidate, and candidates keep their index order,
    so ties resolve as in `tf.math.top_k` (lower index first; `_top_of_candidates`).
    Otherwise (or when `full` is true, e.g. for non-finite input) the whole bucket is
    ranked.
    Magnitudes are taken where they are read (the sample, the comparison, the
    candidates), and the comparison runs through `stage` (e.g. compiled by XLA, which
    never writes |x| out: 25M entries, one core, 8 ms against 18 as TensorFlow's ops).
    The values come from the candidates' gather, not from a second one over the bucket.

    Args:
      x: 1-D values, static length n.
      k: number of indices, 1 <= k <= n.
      full: bool scalar tensor (or Python bool): rank the whole bucket.
      min_numel: buckets shorter than this are ranked whole.
      stage: `stage(fn, *tensors)` runs `fn` on the tensors (inline by default;
        `Context.stage` compiles it when asked): the comparison and the candidates'
        gather (`gather_many`).

    Returns:
      `(indices, values)`: int32 [k] indices, in no particular order, and x at them.
    """
    n = numel(x)
    s = sample_size(max(1000, n // 100))
    r = _sample_rank(s, k, n)

    def everything():
        idx = tf.math.top_k(tf.abs(x), k, sorted=False).indices
        return idx, tf.gather(x, idx)
    if n < min_numel or 2 * r > s:
        return everything()
    thr = tf.math.top_k(sample_magnitudes(x, s, _TOPK_SEED), r, sorted=True).values[r - 1]
    cand = tf.cast(tf.where(stage(_reach, x, thr))[:, 0], tf.int32)
    enough = (tf.size(cand) >= k) & tf.logical_not(full)
    idx, values = tf.cond(
        enough, lambda: _top_of_candidates(cand, gather_many(x, cand, _capacity(n, s, r), stage),
                                           k), everything)
    return tf.ensure_shape(idx, [k]), tf.ensure_shape(values, [k])


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


def _top_of_candidates(cand: tf.Tensor, values: tf.Tensor, k: int, bins: int = 1024
                       ) -> tuple[tf.Tensor, tf.Tensor]:
    """The `k` (<= |cand|) candidates of largest magnitude, ties to the lower index, and
    their values (`values`: x at `cand`).

    The magnitudes are binned between their least and largest (`bins` equal widths):
    every candidate in a bin above the one the k-th largest falls in is kept, and only
    that bin's are ranked, for the rest of k. 25M entries, 1% kept, one core: 4-6 ms for
    270K-410K candidates, against 11-38 ms for ranking the ones to drop."""
    mag = tf.abs(values)
    lo = tf.reduce_min(mag)
    scale = bins / (tf.reduce_max(mag) - lo)
    # Equal (or infinite) magnitudes: one bin, everything ranked.
    scale = tf.where(tf.math.is_finite(scale), scale, tf.zeros([], scale.dtype))
    b = tf.cast(tf.minimum((mag - lo) * scale, bins - 1), tf.int32)
    counts = tf.math.bincount(b, minlength=bins, maxlength=bins)
    from_top = tf.cumsum(counts, reverse=True)      # candidates in this bin or above
    cut = tf.reduce_sum(tf.cast(from_top >= k, tf.int32)) - 1
    above = b > cut
    inside = tf.equal(b, cut)
    cut_values = tf.boolean_mask(values, inside)
    # top_k prefers lower indices among ties; the bin's candidates are in index order.
    top = tf.math.top_k(tf.abs(cut_values), k - (from_top[cut] - counts[cut]),
                        sorted=False).indices
    return (tf.concat([tf.boolean_mask(cand, above), tf.gather(tf.boolean_mask(cand, inside),
                                                                top)], 0),
            tf.concat([tf.boolean_mask(values, above), tf.gather(cut_values, top)], 0))


def select(x: tf.Tensor, k: int, seed: tf.Tensor, sample_ratio: float,
           min_sample: int = 1000, stage=_inline) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
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
      sample_ratio: fraction of the bucket sampled (at least `min_sample` entries).
      min_sample: smallest sample.
      stage: runs the comparison with the threshold and the candidates' gather, as in
        `top_k_entries`.

    Returns:
      `(indices, valid, values)`: int32 [k] distinct indices, a bool [k] mask and x at
      the indices; invalid (padding) entries hold entries that were not selected, to be
      sent as zeros.
    """
    n = numel(x)
    s = min(n, max(min_sample, math.ceil(sample_ratio * n)))
    if s >= n or n < SAMPLE_RUN:
        # An exact top-k; zeros it takes go as padding (not valid).
        top = tf.math.top_k(tf.abs(x), k, sorted=False)
        return top.indices, top.values > 0, tf.gather(x, top.indices)
    s = sample_size(s)
    r = _sample_rank(s, k, n)
    thr = tf.math.top_k(sample_magnitudes(x, s, seed), r, sorted=True).values[r - 1]
    # At least the smallest normal number: zeros are never candidates.
    tiny = tf.constant(np.finfo(x.dtype.as_numpy_dtype).tiny, x.dtype)
    chosen = stage(_reach, x, tf.maximum(thr, tiny))
    cand = tf.cast(tf.where(chosen)[:, 0], tf.int32)

    def ranked():
        idx, values = _top_of_candidates(cand, gather_many(x, cand, _capacity(n, s, r), stage),
                                         k)
        return idx, tf.ones([k], tf.bool), values

    def padded():
        # Every candidate, then the first entries that are not candidates: padding at
        # distinct indices lets a payload decode by placement.
        rest = tf.cast(tf.where(~chosen)[:, 0], tf.int32)
        idx = tf.concat([cand, rest], 0)[:k]
        return idx, tf.range(k) < tf.size(cand), tf.gather(x, idx)
    idx, valid, values = tf.cond(tf.size(cand) >= k, ranked, padded)
    return tf.ensure_shape(idx, [k]), tf.ensure_shape(valid, [k]), tf.ensure_shape(values, [k])


#: Compiled, `Segments.apply` picks the values of this many segments or fewer by index.
FEW = 8
#: A run of equal segments at least this long (elements) reduces as a reshape.
LONG_RUN = 1 << 14
#: Other segments share segment reductions over pieces of at most this many elements,
#: with their ids as a graph constant.
IDS_PIECE = 1 << 16


_UNSORTED = {tf.math.segment_sum: tf.math.unsorted_segment_sum,
             tf.math.segment_max: tf.math.unsorted_segment_max,
             tf.math.segment_min: tf.math.unsorted_segment_min,
             tf.math.segment_mean: tf.math.unsorted_segment_mean}


class Segments:
    """Contiguous segments of a flat bucket: its tensors, or chunks of its tensors.

    Statistics are computed piece by piece over the bucket: a run of equal segments
    long enough (a large tensor, or a tensor cut into chunks) reduces as a reshape; the
    short, irregular ones between runs share one segment reduction per piece, their ids
    a small constant. A bucket of hundreds of small tensors and one of a large tensor
    and its bias both take a few ops and passes over memory: segment ids over a whole
    large bucket cost more than the statistics themselves (computing them took 80 ms
    for 5M elements; a gather through them 40 ms, against 8 ms for the sums).

    Args:
      sizes: element count of each segment, in bucket order; empty ones are dropped
        (they hold no elements).
      runs: instead of `sizes`, `(size, repeat)` pairs (a tensor cut into a million
        chunks stays two pairs).

    Example:
      >>> Segments([3, 0, 2]).expand(tf.constant([1.0, 2.0])).numpy()
      array([1., 1., 1., 2., 2.], dtype=float32)
    """

    def __init__(self, sizes=(), runs=None):
        merged: list[list[int]] = []
        for size, repeat in (runs if runs is not None else ((s, 1) for s in sizes)):
            if size <= 0 or repeat <= 0:
                continue
            if merged and merged[-1][0] == size:
                merged[-1][1] += int(repeat)
            else:
                merged.append([int(size), int(repeat)])
        self.runs = tuple((s, r) for s, r in merged)
        self.count = sum(r for _, r in self.runs)
        self.numel = sum(s * r for s, r in self.runs)
        #: All segments have one size.
        self.regular = self.count > 1 and len(self.runs) == 1
        self._pieces = _pieces(self.runs)

    @classmethod
    def of(cls, layout) -> "Segments":
        """One segment per tensor of a `Layout`."""
        return cls(layout.sizes)

    @classmethod
    def chunks(cls, layout, chunk: int) -> "Segments":
        """Each tensor of `layout` cut into chunks of `chunk` elements (the last shorter)."""
        runs = []
        for size in layout.sizes:
            full, rest = divmod(size, chunk)
            runs += [(chunk, full), (rest, 1)]
        return cls(runs=runs)

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Each segment's element count."""
        return tuple(int(s) for s in np.repeat([s for s, _ in self.runs],
                                               [r for _, r in self.runs]))

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each segment's first element."""
        return tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))

    def _reduce(self, plain, segment, v: tf.Tensor) -> tf.Tensor:
        if self.count == 1:
            return plain(v, keepdims=True)
        out = []
        for piece in self._pieces:
            part = v if len(self._pieces) == 1 else v[piece.start:piece.stop]
            if piece.ids is None:
                out.append(plain(tf.reshape(part, [piece.count, -1]), axis=1))
            elif xla.tracing():   # XLA has only the unsorted segment reductions
                out.append(_UNSORTED[segment](part, tf.constant(piece.ids), piece.count))
            else:
                out.append(tf.reshape(segment(part, tf.constant(piece.ids)), [piece.count]))
        return out[0] if len(out) == 1 else tf.concat(out, 0)

    def sum(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment sums, [count] (one entry per segment)."""
        return self._reduce(tf.reduce_sum, tf.math.segment_sum, v)

    def max(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment maxima, [count]."""
        return self._reduce(tf.reduce_max, tf.math.segment_max, v)

    def min(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment minima, [count]."""
        return self._reduce(tf.reduce_min, tf.math.segment_min, v)

    def abs_max(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment max |v|, [count], from two reductions that only read `v` (no
        bucket-sized |v| is written)."""
        return tf.maximum(self.max(v), -self.min(v))

    def mean(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment means, [count]."""
        return self._reduce(tf.reduce_mean, tf.math.segment_mean, v)

    def sum_of_squares(self, v: tf.Tensor) -> tf.Tensor:
        """Per-segment sums of squares, [count]: the long runs in one read of `v` (as
        squared Euclidean norms), no squared copy written (25M entries, one core: 12 ms
        against 23 for a square and a sum in blocks of 16, 6 against 17 in rows of 512)."""
        if xla.tracing():   # XLA has no Euclidean norm, and fuses the square
            return self.sum(tf.square(v))
        return self._reduce(
            lambda rows, **kw: tf.square(tf.math.reduce_euclidean_norm(rows, **kw)),
            lambda part, ids: tf.math.segment_sum(tf.square(part), ids), v)

    def sizes_as(self, dtype: tf.DType) -> tf.Tensor:
        """The segment sizes as a [count] tensor of `dtype` ([1] for one segment)."""
        if self.regular:
            return tf.fill([self.count], tf.constant(self.runs[0][0], dtype))
        return tf.constant(self.sizes, dtype)

    def apply(self, fn, v: tf.Tensor, per_segment: tf.Tensor) -> tf.Tensor:
        """`fn(v, expand(per_segment))` for an elementwise binary `fn` (multiply,
        divide), without writing the expansion out where segments are runs of equal
        size: there `fn` broadcasts each segment's value over a row of the reshaped
        bucket, one pass instead of two.

        `v` may have leading axes (`[..., numel]`, e.g. several replicas' decodes),
        `per_segment` the same ones before its segment axis (`[..., count, ...]`).
        Compiled within `xla.summing_payloads`, the result is summed over those axes,
        piece by piece."""
        lead = v.shape[:-1]
        summing = xla.summing() and len(lead) > 0

        def done(result):
            return tf.reduce_sum(result, list(range(len(lead)))) if summing else result
        if self.count == 1:
            return done(fn(v, per_segment))
        (size, repeat), last = self.runs[0], self.runs[1:]
        rows = repeat + 1
        if (xla.tracing() and 8 * (rows * size - self.numel) <= self.numel
                and (not last or (len(last) == 1 and last[0][0] < size and last[0][1] == 1))):
            # Equal blocks, the last one maybe shorter (a tensor cut into chunks): the
            # bucket padded to whole rows and one more (the values too), which XLA fuses
            # into `fn`'s loop, instead of two pieces, a flat expansion or plain rows (4
            # onebit payloads summed, one core: 2236^2 entries 20 ms in pieces, 5
            # padded; 2240^2 12 ms as rows, 3.9 padded; QSGD's round trip on 25M
            # entries 2.0 -> 2.8 GB/s, and with 4 payloads gathered 120 -> 57 ms). Not
            # where the padding would add more than an eighth (a kernel and its bias:
            # TernGrad's data path on 1M + 1000 entries 4.5 -> 13 ms padded).
            values = tf.pad(per_segment, [[0, 0]] * len(lead) + [[0, rows - self.count]]
                            + [[0, 0]] * (per_segment.shape.rank - len(lead) - 1))
            out = fn(tf.reshape(tf.pad(v, [[0, 0]] * len(lead) + [[0, rows * size - self.numel]]),
                                [*lead, rows, size]),
                     tf.expand_dims(values, len(lead) + 1))
            return done(tf.reshape(out, [*lead, -1])[..., :self.numel])
        if xla.tracing() and self.count <= FEW and per_segment.shape.rank == len(lead) + 1:
            # A few segments (a kernel and its bias): each entry's value is picked in
            # `fn`'s loop by comparing its index with the segments' ends (TernGrad's
            # encoding of 5M + 1000 entries, one core: 7.2 ms expanded, 2.6 picked, 3.2
            # for one segment of 5M + 1000).
            index = tf.range(self.numel)
            picked = per_segment[..., -1:]
            for j in range(self.count - 2, -1, -1):
                picked = tf.where(index < self.offsets[j + 1], per_segment[..., j:j + 1],
                                  picked)
            return done(fn(v, picked))
        if (xla.tracing() and not summing and len(self._pieces) > 1
                and per_segment.shape.rank == len(lead) + 1):
            # Irregular segments (many tensors): XLA fuses the expansion into `fn`'s
            # loop; `fn` applied per piece and the pieces concatenated instead can cost
            # XLA's CPU code 30x (a uniform draw in QSGD's rounding: 25M entries in 700
            # ms against 25). Values with trailing axes stay in pieces (onebit's two
            # sides, 4 payloads of 5M entries summed: 18-21 ms in pieces, 27 expanded).
            return fn(v, self.expand(per_segment, axis=len(lead)))
        out, axis = [], len(lead)
        for piece in self._pieces:
            part = v if len(self._pieces) == 1 else v[..., piece.start:piece.stop]
            values = per_segment if len(self._pieces) == 1 else per_segment[
                (slice(None),) * axis + (slice(piece.first, piece.first + piece.count),)]
            if piece.ids is None:
                rows = fn(tf.reshape(part, [*lead, piece.count, -1]),
                          tf.expand_dims(values, axis + 1))
                out.append(done(tf.reshape(rows, [*lead, -1])))
            else:
                out.append(done(fn(part, tf.gather(values, tf.constant(piece.ids), axis=axis))))
        return out[0] if len(out) == 1 else tf.concat(out, -1)

    def expand(self, per_segment: tf.Tensor, axis: int = 0) -> tf.Tensor:
        """Each segment's value repeated over its elements ([1] for one segment, which
        broadcasts): `per_segment` is `[..., count, ...]` with its segment axis at
        `axis`, the result `[..., numel, ...]`."""
        if self.count == 1:
            return per_segment
        out, shape = [], per_segment.shape.as_list()
        for piece in self._pieces:
            values = per_segment if len(self._pieces) == 1 else per_segment[
                (slice(None),) * axis + (slice(piece.first, piece.first + piece.count),)]
            if piece.ids is None:
                size = (piece.stop - piece.start) // piece.count
                rows = shape[:axis] + [piece.count, size] + shape[axis + 1:]
                out.append(tf.reshape(tf.broadcast_to(tf.expand_dims(values, axis + 1), rows),
                                      shape[:axis] + [-1] + shape[axis + 1:]))
            else:
                out.append(tf.gather(values, tf.constant(piece.ids), axis=axis))
        return out[0] if len(out) == 1 else tf.concat(out, axis)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Consecutive segments `first .. first + count` over elements `start .. stop`;
    `ids` (local segment of each element) unless they are equal-size (a reshape)."""
    first: int
    count: int
    start: int
    stop: int
    ids: np.ndarray | None


def _pieces(runs) -> list[_Piece]:
    pieces: list[_Piece] = []
    pending: list[tuple[int, int]] = []      # short runs waiting for a shared piece
    first = start = 0

    def flush():
        nonlocal pending
        if pending:
            count = sum(r for _, r in pending)
            numel = sum(s * r for s, r in pending)
            seg0, el0 = first - count, start - numel
            ids = np.repeat(np.arange(count, dtype=np.int32),
                            np.repeat([s for s, _ in pending], [r for _, r in pending]))
            pieces.append(_Piece(seg0, count, el0, start, ids))
            pending = []

    for size, repeat in runs:
        if size * repeat >= LONG_RUN:
            flush()
            pieces.append(_Piece(first, repeat, start, start + size * repeat, None))
        else:
            if sum(s * r for s, r in pending) + size * repeat > IDS_PIECE:
                flush()
            pending.append((size, repeat))
        first += repeat
        start += size * repeat
    flush()
    return pieces


def blocks(layout, block: int | None) -> Segments:
    """Blocks of `block` entries within each tensor of `layout` (None: whole tensors)."""
    return Segments.of(layout) if block is None else Segments.chunks(layout, block)


def scale_dtype(dtype: tf.DType) -> tf.DType:
    """The wire dtype of per-block scales: bfloat16 (float32's range in 2 bytes; error
    feedback absorbs its rounding), float64 for float64 input."""
    return tf.float64 if dtype == tf.float64 else tf.bfloat16


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


#: Segments at least this long are ranked alone (with the sampled fast paths); shorter
#: ones are ranked together, padded to the next power of two.
LARGE = 1 << 15


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
        # Pads (past the bucket's end) rank below every magnitude.
        mag = tf.where(table < seg.numel,
                       tf.abs(tf.gather(x, np.minimum(table, seg.numel - 1))), -1)
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


@dataclasses.dataclass(frozen=True)
class Drawn:
    """Coordinates of a bucket drawn one per stratum (`random_per_segment`): `take`
    reads their values, `place` writes values back to them in a dense vector.

    Attributes:
      numel: entries of the bucket.
      lengths: int32 length of each coordinate's stratum, [K], or a scalar when all
        strata have one (an unbiased estimate scales a kept value by it).
      indices: int32 [K] bucket indices, or None when the strata tile the bucket in
        steps of `stride` (index i is i * stride plus field i of `words`).
      words: int32 Philox words whose log2(stride)-bit fields are the offsets (`_fields`),
        or None (listed indices, or a stride of 1).
      stride: the strata's common length when they tile the bucket, else 0.
    """

    numel: int
    lengths: tf.Tensor
    indices: tf.Tensor | None = None
    words: tf.Tensor | None = None
    stride: int = 0

    def _offsets(self, words: tf.Tensor) -> tf.Tensor:
        return _fields(words, self.numel // self.stride, self.stride.bit_length() - 1)

    def take(self, x: tf.Tensor, stage=_inline, plus: tf.Tensor | None = None) -> tf.Tensor:
        """The [K] values of `x` at the coordinates, plus the scalar `plus` if given
        (`stage` runs the selection and the sum, in one loop when it compiles)."""
        plus = tf.zeros([], x.dtype) if plus is None else tf.cast(plus, x.dtype)
        if self.indices is not None:
            # XLA's gather where the stage compiles (12.5M of 25M entries: 12 ms against 57).
            return stage(lambda x, i, p: tf.gather(x, i) + p, x, self.indices, plus)
        if self.stride == 1:
            return x + plus

        def strided(x, words, plus):
            # Tiled strata: a select in each row of [K, stride], one pass over the bucket
            # instead of a gather at K listed indices (25M entries, stride 2, compiled:
            # 11 ms against 19, and no [K] indices to write).
            rows, off = tf.reshape(x, [-1, self.stride]), self._offsets(words)
            if self.stride == 2:
                return tf.where(tf.equal(off, 1), rows[:, 1], rows[:, 0]) + plus
            return tf.gather(rows, off, batch_dims=1) + plus
        return stage(strided, x, self.words, plus)

    def place(self, values: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """A dense [numel] vector of `dtype` holding `values` at the coordinates, zeros
        elsewhere."""
        if self.indices is not None:
            return place(values, self.indices, self.numel, dtype)
        values = tf.cast(values, dtype)
        if self.stride == 1:
            return values
        # Tiled strata: each row of [K, stride] written whole, an elementwise loop instead
        # of a scatter (25M entries, stride 2, compiled: 17 ms against 28).
        # tf.equal: `==` on tensors is not elementwise in a graph built outside a function.
        hit = tf.equal(self._offsets(self.words)[:, None], tf.range(self.stride)[None])
        return tf.reshape(tf.where(hit, values[:, None], tf.zeros([], dtype)), [self.numel])


def random_per_segment(seed: tf.Tensor, seg: Segments, ks, step: tf.Tensor | None = None,
                       stage=_inline) -> Drawn:
    """`ks[t]` distinct indices of each segment, one from each of `ks[t]` strata, in
    O(sum(ks)) elementwise work.

    Segment t of size s is cut into k = `ks[t]` strata of nearly equal length (stratum
    j spans floor(j s / k) to floor((j + 1) s / k)) and one index is drawn uniformly
    from each. Every entry goes out with probability 1 / (its stratum's length), which
    is k / s when k divides s and within one part in s / k of it otherwise. A uniformly
    drawn set of k (a seeded permutation per segment) costs a keyed shuffle per element,
    hundreds of nanoseconds each on a CPU: at random-k's default ratio of one half it
    took longer than sending the gradient uncompressed at 100 Mbit/s.

    Without `step`, each call draws from `seed`. With `step` (cyclic), every stratum
    walks through its entries in turn, one a step, from a random start that changes
    with each cycle of ceil(s / k) steps, so every entry goes out at least once per
    cycle; the start comes from `seed[1]` and the cycle's index, not from the step.

    When every segment's k divides its size with one quotient L, a power of two (random-k's
    default ratio of one half on even sizes), the strata tile the bucket in steps of L:
    index i is i L plus log2(L) random bits, drawn 32 / log2(L) to a Philox word, and
    only the words are kept: `Drawn.take` and `Drawn.place` read the bits in the loop
    that selects or writes the values (25M elements, one core: K indices computed in 260
    ms by the general path, the words drawn in under 1).

    The draws are Philox's, made by TensorFlow (the same on every kind of device, and
    XLA's CPU code draws them slower); `stage(fn, *tensors)` runs the arithmetic after
    them (inline by default; `Context.stage` compiles it when asked): a random-k of 25M entries at
    ratio 0.3 (strata of 3 or 4), one core, 0.57 -> 0.7 GB/s.

    Returns:
      The `sum(ks)` coordinates (`Drawn`), the same for the same seed on every device.
    """
    seed = tf.cast(seed, tf.int64)
    ks = np.asarray(ks, np.int64)
    total = int(ks.sum())
    sizes = np.asarray(seg.sizes, np.int64)
    stride = int(sizes[0] // ks[0]) if total else 0
    if (step is None and total and np.all(sizes == stride * ks) and stride & (stride - 1) == 0
            and stride <= 1 << 16):
        words = None if stride == 1 else _random_words(total, stride.bit_length() - 1, seed)
        return Drawn(seg.numel, tf.constant(stride, tf.int32), words=words, stride=stride)

    def per_element(values):       # a per-segment constant, repeated for its k entries
        return tf.repeat(tf.constant(np.asarray(values, np.int64)), ks)

    def strata(draws, step):
        size, k = per_element(seg.sizes), per_element(ks)
        j = tf.range(total, dtype=tf.int64) - per_element(np.cumsum(ks) - ks)
        start = j * size // k
        length = (j + 1) * size // k - start
        if step is None:
            offset = tf.math.floormod(draws, length)
        else:
            cycle = per_element(-(-np.asarray(seg.sizes, np.int64) // ks))
            r, g = tf.unstack(tf.math.floormod(draws, length[None]))
            # Cycle c starts at (r + c g) mod L: a random stride g moves it from cycle to
            # cycle.
            c = tf.math.floormod(step // cycle, length)
            offset = tf.math.floormod(r + c * g + step % cycle, length)
        index = per_element(seg.offsets) + start + offset
        return tf.cast(index, tf.int32), tf.cast(length, tf.int32)
    if step is None:
        index, length = stage(lambda d: strata(d, None), _full_ints([total], seed))
    else:
        cycle_seed = tf.stack([seed[1], tf.constant(0x6379, tf.int64)])
        index, length = stage(strata, _full_ints([2, total], cycle_seed), tf.cast(step, tf.int64))
    return Drawn(seg.numel, length, indices=index)


def _random_words(count: int, bits: int, seed: tf.Tensor) -> tf.Tensor:
    """The Philox words whose `bits`-wide fields (`_fields`) are `count` random ints."""
    return tf.random.stateless_uniform([-(-count // (32 // bits))], seed, minval=None,
                                       maxval=None, dtype=tf.int32, alg="philox")


def _fields(words: tf.Tensor, count: int, bits: int) -> tf.Tensor:
    """int32 [count] uniform in [0, 2^bits), `bits` <= 16: the fields of `words`."""
    per = 32 // bits
    fields = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(words[:, None], tf.range(0, per * bits, bits)[None]),
        (1 << bits) - 1)
    return tf.reshape(fields, [-1])[:count]


def uniform(n: int, seed: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """[n] uniform in [0, 1) on a grid of 2^-24: a hash of (seed, index), for the
    stochastic rounding of the quantizers.

    Entry i is murmur3's 32-bit finaliser applied to i times the golden ratio plus one
    key, xor the other, the two keys drawn from `seed` by Philox: a Weyl sequence
    through an avalanche mix, as SplitMix draws. The finaliser is a bijection whose
    output bits each flip with probability one half when any input bit does. The draws
    are a function of (seed, i) alone, so TensorFlow's ops and a cluster compiled by XLA
    draw the same values (Philox under XLA does not draw TensorFlow's), and a few
    integer ops per entry fuse into the quantizer's loop. QSGD's rounding of 25M entries
    on one core takes 15 ms with them, 20 with the finaliser applied twice, 10 with no
    draws at all (Philox's floats alone: 125 ms; XLA's own Philox fused into the loop:
    295). Rounding up with probability u < frac on this grid is biased by less than
    2^-24 of a level.

    Args:
      n: how many draws.
      seed: an int64 [2] stateless seed.
      dtype: float32 or float64.

    Returns:
      A [n] tensor of `dtype`.
    """
    keys = tf.random.stateless_uniform([2], seed, minval=None, maxval=None, dtype=tf.uint32,
                                       alg="philox")
    index = tf.bitcast(tf.range(n, dtype=tf.int32), tf.uint32)
    h = _fmix32(tf.bitwise.bitwise_xor(index * tf.constant(0x9E3779B9, tf.uint32) + keys[0],
                                       keys[1]))
    top = tf.bitcast(tf.bitwise.right_shift(h, tf.constant(8, tf.uint32)), tf.int32)
    return tf.cast(top, dtype) * tf.constant(2.0 ** -24, dtype)


def _fmix32(h: tf.Tensor) -> tf.Tensor:
    """murmur3's finaliser of uint32 words."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(shift, tf.uint32)))
        if factor is not None:
            h = h * tf.constant(factor, tf.uint32)
    return h


def _full_ints(shape, seed: tf.Tensor) -> tf.Tensor:
    """Uniform int64 over the whole range, from a stateless seed."""
    return tf.random.stateless_uniform(shape, seed, minval=None, maxval=None, dtype=tf.int64,
                                       alg="philox")   # the same on every kind of device
