"""Sampled-threshold sparsification: top-k per tensor without sorting long tensors.

References:
  Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
  Distributed Training", ICLR 2018 (Section 3, sampled threshold selection).
"""

from __future__ import annotations

import tensorflow as tf

from tf_gradsync.compression import _segments, _selection, _sparse, _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("threshold")
class Threshold(_sparse.SparseDecoding, Compressor):
    """Sends k = max(1, ceil(ratio * size)) large entries of each tensor, found through a
    sampled threshold in long tensors.

    In a tensor longer than `_selection.LARGE` entries, a random sample of
    `max(1000, sample_ratio * size)` magnitudes (stateless, seeded by `ctx.seed`)
    gives a threshold that a few more than k entries almost surely reach; those are the
    candidates (a superset of the true top k, unless the sample was unlucky). With
    more than k candidates the k largest are kept; with fewer, the payload is padded
    with zero values at entries that were not selected (distinct, so a payload decodes
    by placement), so it always has exactly k entries and replicas can be all-gathered
    with equal shapes. Zeros are never sent. Shorter tensors get an exact top-k. The
    result approximates `topk`, with the cost of a top-k over the sample and the
    candidates instead of over the tensor.

    Payload: `(values, indices)`, values in the input dtype, int32 indices into the
    bucket: K * (itemsize + 4) bytes, K the sum of the tensors' k. Biased (error
    feedback by default). A non-finite input turns every sent value NaN.

    Args:
      ratio: fraction of entries kept, in (0, 1].
      sample_ratio: fraction of a long tensor sampled for its threshold, in (0, 1].

    Raises:
      ValueError: if `ratio` or `sample_ratio` is outside (0, 1].

    Example:
      >>> c = tf_gradsync.compression.get("threshold", ratio=0.001)
    """

    summable = False
    unbiased = False

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01):
        _util.check_number("ratio", ratio, 0, 1, low_open=True)
        _util.check_number("sample_ratio", sample_ratio, 0, 1, low_open=True)
        self.ratio = ratio
        self.sample_ratio = sample_ratio

    def send_interval(self) -> float:
        return _selection.magnitude_send_interval(self.ratio)

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values, int32 indices), (n, dtype))`."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        values, idx, _ = _selection.sampled_largest(
            tf.cast(x, _util.work_dtype(x.dtype)), seg, self.ratio, ctx.seed, self.sample_ratio,
            ctx.stage, x.dtype)
        return (values + tf.cast(_util.poison(x), x.dtype), idx), (seg.numel, x.dtype)
