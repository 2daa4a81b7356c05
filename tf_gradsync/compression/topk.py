"""Top-k sparsification: send the largest-magnitude fraction of the bucket.

References:
  Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
  Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("topk")
class TopK(Compressor):
    """Keeps the k = max(1, ceil(ratio * n)) entries of largest magnitude.

    Payload: `(values, indices)` with values in the input dtype and int32 indices,
    k * (itemsize + 4) bytes. Payloads are all-gathered (different replicas pick
    different coordinates). Biased; wrap in `ErrorFeedback` to recover convergence.
    A non-finite input turns every sent value into NaN.

    Args:
      ratio: fraction of entries kept, in (0, 1].

    Raises:
      ValueError: if `ratio` is outside (0, 1].

    Example:
      >>> c = tf_gradsync.compression.get("topk", ratio=0.01)
    """

    summable = False
    unbiased = False

    def __init__(self, ratio: float = 0.01):
        _util.check_number("ratio", ratio, 0, 1, low_open=True)
        self.ratio = ratio

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values, int32 indices), (n, dtype))`."""
        del ctx
        n = _util.numel(x)
        k = _util.count(self.ratio, n)
        wd = _util.work_dtype(x.dtype)
        idx = tf.math.top_k(tf.abs(tf.cast(x, wd)), k, sorted=False).indices
        values = tf.gather(x, idx) + tf.cast(_util.poison(x), x.dtype)
        return (values, idx), (n, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Scatters the values into zeros of the bucket's length and dtype."""
        n, dtype = meta
        values, idx = payload
        return _util.scatter(values, idx, n, dtype)
