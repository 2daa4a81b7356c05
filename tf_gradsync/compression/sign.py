"""Scaled sign compression (EF-SignSGD): one bit per entry plus the mean magnitude.

References:
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes", ICML 2019.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("sign")
class Sign(Compressor):
    """Reconstructs `mean|x| * sign(x)`, with sign(0) taken as +1.

    The scale ||x||_1 / n makes the compressor a contraction, which is what error
    feedback needs: use it as `ErrorFeedback(Sign())` to get EF-SignSGD. Biased.

    Payload: `(bits, scale)`: sign bits (1 for x >= 0) packed eight per uint8,
    ceil(n / 8) bytes, and a float32 scale (float64 for float64 input): n / 8 + 4
    bytes for float32. All-gathered. A zero bucket gives zeros; a non-finite one a
    NaN scale (all-NaN output).

    Example:
      >>> c = tf_gradsync.compression.ErrorFeedback(tf_gradsync.compression.get("sign"))
    """

    summable = False
    unbiased = False

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed bits, scale), (n, dtype))`."""
        del ctx
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        scale = tf.reduce_mean(tf.abs(v))
        return (_util.pack(v >= 0, 1), scale + _util.poison(x, wd)), (_util.numel(x), x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * (+1 or -1), in the input dtype."""
        packed, scale = payload
        n, dtype = meta
        signs = tf.cast(2 * _util.unpack(packed, 1, n) - 1, scale.dtype)
        return tf.cast(signs * scale, dtype)
