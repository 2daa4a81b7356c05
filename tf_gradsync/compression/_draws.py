"""Random draws for the compressors: coordinates one per stratum (random-k), and
uniform values hashed from (seed, index) for stochastic rounding."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tf_gradsync.compression._segments import Segments
from tf_gradsync.compression._sparse import place
from tf_gradsync.compression._util import inline


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

    def take(self, x: tf.Tensor, stage=inline, plus: tf.Tensor | None = None) -> tf.Tensor:
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
                       stage=inline) -> Drawn:
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
