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
    gives the threshold that would keep about 2k entries; entries at or above it are
    candidates (a superset of the true top k, unless the sample was unlucky). With
    more than k candidates the k largest are kept; with fewer, the payload is padded
    with zero values at index 0 (harmless when summed), so it always has exactly k
    entries and replicas can be all-gathered with equal shapes. Zeros are never sent.
    Shorter tensors get an exact top-k. The result approximates `topk`, with the cost
    of a top-k over the sample and the candidates instead of over the tensor.

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
        seed = tf.convert_to_tensor(ctx.seed, tf.int64)
        idx, valid, values = _selection.top_per_segment(
            tf.cast(x, _util.work_dtype(x.dtype)), seg, _selection.counts(self.ratio, seg),
            lambda m, k: _selection.select(m, k, seed, self.sample_ratio,
                                      stage=ctx.stage))
        values = tf.cast(values, x.dtype)
        if valid is not None:
            values = tf.where(valid, values, tf.zeros([], x.dtype))
        return (values + tf.cast(_util.poison(x), x.dtype), idx), (seg.numel, x.dtype)
