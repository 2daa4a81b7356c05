"""8-bit linear quantisation with one scale per tensor.

References:
  Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016
  (here with plain linear levels rather than the paper's dynamic tree format).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _segments, _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("int8")
class Int8(Compressor):
    """Rounds x / scale to the nearest int8 in [-127, 127], scale = max|x| / 127 per tensor.

    Each tensor of the bucket gets its own scale, so a layer with small gradients is
    not rounded to zero by a neighbour's large ones. Deterministic rounding, so biased
    (error at most scale / 2 per entry); wrap in `ErrorFeedback` to carry the rounding
    error over. Payload: `(int8 values, scales)` with one float32 scale per tensor
    (float64 for float64 input): n + 4 T bytes for float32 and T tensors. All-gathered,
    since int8 sums would overflow and scales differ per replica. A zero tensor gives
    zeros; a non-finite bucket NaN scales (all-NaN output).

    Example:
      >>> c = tf_gradsync.compression.get("int8")
    """

    accuracy = "balanced"

    summable = False
    batched_decode = True
    xla_decode = xla_compress = True
    unbiased = False

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((int8 values, scales), (segments, dtype))`."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        scale = seg.abs_max(v) / 127
        # |v| / scale <= 127 (to within a rounding of the division, which cannot reach
        # 127.5), so no clipping; a non-finite bucket's NaN scale decodes to NaN anyway.
        q = tf.round(seg.apply(tf.math.divide_no_nan, v, scale))
        return (tf.cast(q, tf.int8), scale + _util.poison(x, wd)), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * values, in the input dtype."""
        q, scale = payload
        seg, dtype = meta
        return tf.cast(seg.apply(tf.multiply, tf.cast(q, scale.dtype), scale), dtype)
