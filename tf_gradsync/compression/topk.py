"""Top-k sparsification: send the largest-magnitude fraction of each tensor.

References:
  Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
  Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_gradsync.compression import _segments, _selection, _sparse, _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("topk")
class TopK(_sparse.SparseDecoding, Compressor):
    """Keeps the k = max(1, ceil(ratio * size)) entries of largest magnitude of each tensor.

    k is taken per tensor of the bucket, as DGC selects per layer, so a layer with
    small gradients still sends its largest entries instead of starving next to a
    layer with large ones. The selection is exact (the entries `tf.math.top_k` picks
    in each tensor); short tensors are ranked together, long ones rank only the
    entries above a threshold estimated from a sample, and everything when too few
    pass it.

    Payload: `(values, indices)` with values in the input dtype and int32 indices into
    the bucket, K * (itemsize + 4) bytes for K = the sum of the tensors' k. Payloads
    are all-gathered (different replicas pick different coordinates). Biased; wrap in
    `ErrorFeedback` to recover convergence (the default). A non-finite input turns
    every sent value into NaN.

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

    def send_interval(self) -> float:
        return _selection.magnitude_send_interval(self.ratio)

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values, int32 indices), (n, dtype))`."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        wd = _util.work_dtype(x.dtype)
        finite = _util.all_finite(x)

        def exact(m, k):
            idx, values = _selection.top_k_entries(m, k, full=~finite,
                                              stage=ctx.stage)
            return idx, None, values
        idx, _, values = _selection.top_per_segment(
            tf.cast(x, wd), seg, _selection.counts(self.ratio, seg), exact)
        bad = tf.where(finite, tf.constant(0, x.dtype), tf.constant(math.nan, x.dtype))
        return (tf.cast(values, x.dtype) + bad, idx), (seg.numel, x.dtype)
