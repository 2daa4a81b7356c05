"""QSGD: stochastic quantisation of the bucket to a few levels of its L2 norm.

References:
  Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
  Encoding", NeurIPS 2017.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("qsgd")
class QSGD(Compressor):
    """Quantises each entry to `sign(x) * norm * l / levels`, l in {0, ..., levels}.

    With a = |x| / ||x||_2 * levels, l is floor(a) or floor(a) + 1, rounded up with
    probability a - floor(a), so the reconstruction is unbiased. The noise is a
    stateless uniform seeded by `ctx.seed`: the same on every replica (the context
    offers no per-replica seed). Each replica's estimate is still unbiased, but the
    rounding errors of replicas are correlated, so averaging over replicas reduces
    the variance less than independent noise would. The paper's Elias coding of the
    levels is not done: the levels travel as fixed-width int8.

    Payload: `(int8 sign * l, norm)` with the norm a float32 scalar (float64 for
    float64 input): n + 4 bytes for float32. All-gathered. A zero bucket gives zeros;
    a non-finite one gives a NaN norm, so its reconstruction is all NaN.

    Args:
      levels: number of quantisation levels s, an integer in [1, 127].

    Raises:
      ValueError: if `levels` is not an integer in [1, 127].

    Example:
      >>> c = tf_gradsync.compression.get("qsgd", levels=16)
    """

    summable = False
    unbiased = True

    def __init__(self, levels: int = 64):
        _util.check_number("levels", levels, 1, 127, integer=True)
        self.levels = levels

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((int8 levels, norm), dtype)`."""
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        norm = tf.norm(v)
        a = tf.math.divide_no_nan(tf.abs(v) * self.levels, norm)
        u = tf.random.stateless_uniform(tf.shape(v), tf.convert_to_tensor(ctx.seed, tf.int64),
                                        dtype=wd)
        level = tf.minimum(tf.floor(a + u), self.levels)
        q = tf.cast(tf.sign(v) * level, tf.int8)
        return (q, norm + _util.poison(x, wd)), x.dtype

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """norm / levels * q, in the input dtype."""
        q, norm = payload
        return tf.cast(tf.cast(q, norm.dtype) * (norm / self.levels), meta)
