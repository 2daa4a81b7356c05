"""8-bit linear quantisation with one scale per bucket.

References:
  Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016
  (here with plain linear levels rather than the paper's dynamic tree format).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("int8")
class Int8(Compressor):
    """Rounds x / scale to the nearest int8 in [-127, 127], scale = max|x| / 127.

    Deterministic rounding, so biased (error at most scale / 2 per entry); wrap in
    `ErrorFeedback` to carry the rounding error over. Payload: `(int8 values, scale)`
    with the scale a float32 scalar (float64 for float64 input): n + 4 bytes for
    float32. All-gathered, since int8 sums would overflow and scales differ per
    replica. A zero bucket gives zeros; a non-finite one a NaN scale (all-NaN output).

    Example:
      >>> c = tf_gradsync.compression.get("int8")
    """

    summable = False
    unbiased = False

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((int8 values, scale), dtype)`."""
        del ctx
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        scale = tf.reduce_max(tf.abs(v)) / 127
        q = tf.clip_by_value(tf.round(tf.math.divide_no_nan(v, scale)), -127, 127)
        return (tf.cast(q, tf.int8), scale + _util.poison(x, wd)), x.dtype

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * values, in the input dtype."""
        q, scale = payload
        return tf.cast(tf.cast(q, scale.dtype) * scale, meta)
