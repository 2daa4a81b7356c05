"""Segments of a flat bucket (its tensors, or chunks of them): per-segment statistics
and per-segment values applied over the bucket."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.compression import xla


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


#: What each kind of `Segments.statistics` starts from, combines with, and reduces
#: with over irregular segments.
_INIT = {"sum": 0.0, "max": -math.inf, "min": math.inf}
_COMBINE = {"sum": tf.add, "max": tf.maximum, "min": tf.minimum}
_UNSORTED_OF = {"sum": tf.math.unsorted_segment_sum, "max": tf.math.unsorted_segment_max,
                "min": tf.math.unsorted_segment_min}


@functools.lru_cache(maxsize=None)
def _reducer(kinds: tuple[str, ...], dtypes: tuple[tf.DType, ...]):
    """The combining function of a variadic reduction of `kinds` over `dtypes`."""
    def combine(*args):
        return tuple(_COMBINE[k](a, b)
                     for k, a, b in zip(kinds, args[:len(kinds)], args[len(kinds):]))
    specs = [tf.TensorSpec([], d) for d in dtypes] * 2
    return tf.function(combine, autograph=False).get_concrete_function(*specs)


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

    def statistics(self, *terms: tuple[str, tf.Tensor]) -> list[tf.Tensor]:
        """Several per-segment statistics of the bucket, each [count]: a term `(kind, v)`
        takes the "sum", "max", "min" or "sum_of_squares" of `v` (bucket-length) over
        each segment.

        Compiled, every run of equal segments reduces all the terms in one loop over the
        bucket (XLA's variadic reduction) instead of one loop per term: XLA's CPU code
        runs a reduction with its producer fused in at about the same speed whatever it
        computes per entry, so each term saved is a pass saved (a maximum, a minimum, a
        sum and a sum of squares of 25M entries, one core: 37 ms against 85 in rows of
        10,000, 21 against 69 in blocks of 32). Otherwise, one reduction per term. For
        terms computed from the bucket: XLA reduces the bucket itself alone in a
        vectorised kernel (a maximum, a minimum and a sum of one 25M-entry segment: 7-9
        ms each, 38 as one loop)."""
        if not xla.tracing() or not terms:
            single = {"sum": self.sum, "max": self.max, "min": self.min,
                      "sum_of_squares": self.sum_of_squares}
            return [single[kind](v) for kind, v in terms]
        kinds = tuple("sum" if kind == "sum_of_squares" else kind for kind, _ in terms)
        values = [tf.square(v) if kind == "sum_of_squares" else v for kind, v in terms]
        if self.count == 1:
            pieces = [_Piece(0, 1, 0, self.numel, None)]
        else:
            pieces = self._pieces
        out: list[list[tf.Tensor]] = [[] for _ in terms]
        for piece in pieces:
            parts = [v if len(pieces) == 1 else v[piece.start:piece.stop] for v in values]
            if piece.ids is None:
                rows = [tf.reshape(p, [piece.count, -1]) for p in parts]
                reduced = _tf_compat.variadic_reduce(
                    rows, [tf.constant(_INIT[k], p.dtype) for k, p in zip(kinds, parts)], 1,
                    _reducer(kinds, tuple(p.dtype for p in parts)))
            else:
                ids = tf.constant(piece.ids)
                reduced = [_UNSORTED_OF[k](p, ids, piece.count) for k, p in zip(kinds, parts)]
            for results, r in zip(out, reduced):
                results.append(r)
        return [r[0] if len(r) == 1 else tf.concat(r, 0) for r in out]

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
