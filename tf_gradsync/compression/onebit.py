"""1-bit SGD: one bit per entry, reconstructed as the mean of its sign class per tensor.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
  Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("onebit")
class OneBit(Compressor):
    """Sends bit = (x >= 0); entries decode to the mean of the entries of their tensor
    with their bit.

    The two reconstruction values per tensor (the paper quantises per column of a
    weight matrix; here per tensor), the mean of its non-negative entries and the mean
    of its negative ones (0 for an empty class), minimise the squared error for the
    given bits. The paper carries the quantisation error to the next step; here that
    is `ErrorFeedback(OneBit())`. Biased.

    Payload: `(bits, positive means, negative means)`: bits packed eight per uint8,
    ceil(n / 8) bytes, and two float32 values per tensor (float64 for float64 input).
    All-gathered. A non-finite bucket gives NaN means (all-NaN output).

    Example:
      >>> c = tf_gradsync.compression.ErrorFeedback(tf_gradsync.compression.get("onebit"))
    """

    summable = False
    unbiased = False

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed bits, positive means, negative means), (segments, dtype))`."""
        seg = _util.Segments.of(ctx.layout_of(x))
        ids = None if seg.count == 1 else seg.ids()
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        bit = v >= 0
        pos = tf.cast(bit, wd)
        bad = _util.poison(x, wd)
        n_pos = seg.sum(pos, ids)
        hi = tf.math.divide_no_nan(seg.sum(v * pos, ids), n_pos) + bad
        lo = tf.math.divide_no_nan(seg.sum(v * (1 - pos), ids),
                                   tf.constant(seg.sizes, wd) - n_pos) + bad
        return (_util.pack(bit, 1), hi, lo), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Each entry becomes the mean of its class in its tensor, in the input dtype."""
        packed, hi, lo = payload
        seg, dtype = meta
        bit = _util.unpack(packed, 1, seg.numel) == 1
        return tf.cast(tf.where(bit, seg.expand(hi), seg.expand(lo)), dtype)
