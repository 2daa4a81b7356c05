"""1-bit SGD: one bit per entry, reconstructed as the mean of its sign class.

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
    """Sends bit = (x >= 0); entries decode to the mean of the entries with their bit.

    The two reconstruction values, the mean of the non-negative entries and the mean
    of the negative ones (0 for an empty class), minimise the squared error for the
    given bits. The paper carries the quantisation error to the next step; here that
    is `ErrorFeedback(OneBit())`. Biased.

    Payload: `(bits, positive mean, negative mean)`: bits packed eight per uint8,
    ceil(n / 8) bytes, and two float32 scalars (float64 for float64 input): n / 8 + 8
    bytes for float32. All-gathered. A non-finite bucket gives NaN means (all-NaN
    output).

    Example:
      >>> c = tf_gradsync.compression.ErrorFeedback(tf_gradsync.compression.get("onebit"))
    """

    summable = False
    unbiased = False

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed bits, positive mean, negative mean), (n, dtype))`."""
        del ctx
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        bit = v >= 0
        pos = tf.cast(bit, wd)
        bad = _util.poison(x, wd)
        hi = tf.math.divide_no_nan(tf.reduce_sum(v * pos), tf.reduce_sum(pos)) + bad
        lo = tf.math.divide_no_nan(tf.reduce_sum(v * (1 - pos)), tf.reduce_sum(1 - pos)) + bad
        return (_util.pack(bit, 1), hi, lo), (_util.numel(x), x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Each entry becomes the mean of its class, in the input dtype."""
        packed, hi, lo = payload
        n, dtype = meta
        return tf.cast(tf.where(_util.unpack(packed, 1, n) == 1, hi, lo), dtype)
