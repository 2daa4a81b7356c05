"""QSGD: stochastic quantisation to a few levels of the L2 norm of each chunk of a tensor.

References:
  Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
  Encoding", NeurIPS 2017.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _draws, _segments, _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("qsgd")
class QSGD(Compressor):
    """Quantises each entry to `sign(x) * norm * l / levels`, l in {0, ..., levels}.

    Each tensor of the bucket is cut into chunks of `chunk` entries (the paper's
    bucket size d, 512 in its experiments; the last chunk of a tensor is shorter), and
    `norm` is the chunk's L2 norm: the variance added is at most
    min(d / levels^2, sqrt(d) / levels) times ||x||^2 per chunk, independent of the
    size of the bucket. With a = |x| / norm * levels, l is floor(a) or floor(a) + 1,
    rounded up with probability a - floor(a), so the reconstruction is unbiased. The
    noise is a stateless uniform seeded per replica (`Context.replica_seed`), so the
    rounding errors of replicas are independent and average out. The paper's Elias
    coding of the levels is not done: the levels travel as fixed-width int8.

    Payload: `(int8 sign * l, norms)` with one float32 norm per chunk (float64 for
    float64 input): n + 4 ceil(n / chunk) bytes for float32 (about n (1 + 4 / chunk)).
    All-gathered. A zero chunk gives zeros; a non-finite bucket NaN norms (all-NaN
    output).

    Args:
      levels: number of quantisation levels s, an integer in [1, 127].
      chunk: entries per norm within a tensor, an integer >= 1.

    Raises:
      ValueError: for an argument outside its range.

    Example:
      >>> c = tf_gradsync.compression.get("qsgd", levels=16)
    """

    accuracy = "balanced"

    summable = False
    batched_decode = True
    xla_decode = True
    unbiased = True

    def __init__(self, levels: int = 64, chunk: int = 512):
        _util.check_number("levels", levels, 1, 127, integer=True)
        _util.check_number("chunk", chunk, 1, integer=True)
        self.levels, self.chunk = levels, chunk

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((int8 levels, norms), (segments, dtype))`."""
        seg = _segments.Segments.chunks(ctx.layout_of(x), self.chunk)
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        norm_sq = seg.sum_of_squares(v)
        norm = tf.sqrt(norm_sq)
        seed = ctx.replica_seed()

        def quantise(v, norm, seed):
            a = seg.apply(tf.math.divide_no_nan, tf.abs(v) * self.levels, norm)
            level = tf.minimum(tf.floor(a + _draws.uniform(seg.numel, seed, wd)), self.levels)
            return tf.cast(tf.sign(v) * level, tf.int8)
        q = ctx.stage(quantise, v, norm, seed)
        # A chunk's sum of squares is not finite when one of its entries is not (or
        # overflows, treated alike): checking the norms reads a chunk's worth of entries.
        return (q, norm + _util.poison(norm_sq, wd)), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """norm / levels * q, in the input dtype."""
        q, norm = payload
        seg, dtype = meta
        return tf.cast(seg.apply(tf.multiply, tf.cast(q, norm.dtype), norm / self.levels), dtype)
