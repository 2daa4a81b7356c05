"""TernGrad: stochastic ternary gradients, 2 bits per entry.

References:
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
  Deep Learning", NeurIPS 2017.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("terngrad")
class TernGrad(Compressor):
    """Sends scale * t with t in {-1, 0, 1}, scale = max|x|, P(t = sign x) = |x| / scale.

    Unbiased: E[scale * t] = x. The Bernoulli draws use a stateless uniform seeded by
    `ctx.seed`, so they are the same on every replica (each estimate is still
    unbiased). The paper's optional gradient clipping (2.5 standard deviations) is
    not applied, since it would bias the estimate.

    Payload: `(codes, scale)`: 2-bit codes (0: zero, 1: +1, 2: -1) packed four per
    uint8, ceil(n / 4) bytes, and a float32 scale (float64 for float64 input):
    n / 4 + 4 bytes for float32. All-gathered. A zero bucket gives zeros; a
    non-finite one a NaN scale (all-NaN output).

    Example:
      >>> c = tf_gradsync.compression.get("terngrad")
    """

    summable = False
    unbiased = True

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed codes, scale), (n, dtype))`."""
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        scale = tf.reduce_max(tf.abs(v))
        u = tf.random.stateless_uniform(tf.shape(v), tf.convert_to_tensor(ctx.seed, tf.int64),
                                        dtype=wd)
        keep = u < tf.math.divide_no_nan(tf.abs(v), scale)
        codes = tf.where(keep, tf.where(v > 0, 1, 2), 0)
        return (_util.pack(codes, 2), scale + _util.poison(x, wd)), (_util.numel(x), x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * {0, +1, -1}[code], in the input dtype."""
        packed, scale = payload
        n, dtype = meta
        codes = _util.unpack(packed, 2, n)
        t = tf.cast(codes == 1, scale.dtype) - tf.cast(codes == 2, scale.dtype)
        return tf.cast(t * scale, dtype)
