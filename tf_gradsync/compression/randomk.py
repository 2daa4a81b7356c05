"""Random-k sparsification with shared coordinates, so payloads can be summed.

References:
  Stich et al., "Sparsified SGD with Memory", NeurIPS 2018 (rand-k);
  Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed
  Optimization", NeurIPS 2018.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


def _indices(seed: tf.Tensor, n: int, k: int) -> tf.Tensor:
    """k distinct coordinates of [0, n): the first k of a seeded permutation (O(k))."""
    if k == n:
        return tf.range(n, dtype=tf.int32)
    return tf.random.experimental.index_shuffle(tf.range(k), seed, n - 1)


@register("randomk")
class RandomK(Compressor):
    """Sends k = max(1, ceil(ratio * n)) coordinates drawn uniformly without replacement.

    Every replica draws the same coordinates (a stateless permutation seeded by
    `ctx.seed`), so the payload is just the k values in the input dtype (k * itemsize
    bytes) and is summed on the wire; decompression recomputes the coordinates from
    the seed kept in the metadata and scales by n / k, which makes the estimate
    unbiased. The n / k scaling happens after the sum, in float32 (float64 for float64
    input), so 16-bit payloads cannot overflow from it. With `scale=False` the kept
    values are returned as they are: biased, but never larger than the input, which
    is what error feedback needs (n / k times the kept values would make the residual
    grow without bound); `ErrorFeedback` switches to this form by itself
    (`for_error_feedback`), as in Stich et al.'s rand-k with memory. Coordinates come from
    `tf.random.experimental.index_shuffle`, which runs on the host (CPU kernel only);
    it is integer arithmetic, so every device gets the same coordinates.

    Args:
      ratio: fraction of entries kept, in (0, 1].
      scale: multiply by n / k on decompression (unbiased); False: biased, unscaled.

    Raises:
      ValueError: if `ratio` is outside (0, 1] or `scale` is not a bool.

    Example:
      >>> c = tf_gradsync.compression.get("randomk", ratio=0.01)
    """

    summable = True
    unbiased = True

    def __init__(self, ratio: float = 0.01, scale: bool = True):
        _util.check_number("ratio", ratio, 0, 1, low_open=True)
        if not isinstance(scale, bool):
            raise ValueError(f"scale must be a bool (True or False), got {scale!r}")
        self.ratio, self.scale = ratio, scale
        self.unbiased = scale

    def for_error_feedback(self) -> "RandomK":
        """The unscaled (biased, contractive) form, for use under error feedback."""
        return RandomK(self.ratio, scale=False) if self.scale else self

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values,), (n, k, dtype, seed))`."""
        n = _util.numel(x)
        k = _util.count(self.ratio, n)
        seed = tf.convert_to_tensor(ctx.seed, tf.int64)
        values = tf.gather(x, _indices(seed, n, k)) + tf.cast(_util.poison(x), x.dtype)
        return (values,), (n, k, x.dtype, seed)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Scatters the (summed) values to the seeded coordinates, times n / k if `scale`."""
        n, k, dtype, seed = meta
        wd = _util.work_dtype(dtype)
        values = tf.cast(payload[0], wd)
        if self.scale:
            values *= tf.constant(n / k, wd)
        return tf.cast(_util.scatter(values, _indices(seed, n, k), n, wd), dtype)
