"""Scaled sign compression (EF-SignSGD): one bit per entry plus a magnitude per tensor.

References:
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes", ICML 2019; Tang et al., "1-bit Adam: Communication Efficient Large-Scale
  Training with Adam's Convergence Speed", ICML 2021 (the L2 scale).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register

_SCALES = ("l1", "l2")


@register("sign")
class Sign(Compressor):
    """Reconstructs `scale * sign(x)` per tensor, with sign(0) taken as +1.

    Args:
      scale: "l1" (||x||_1 / d) or "l2" (||x||_2 / sqrt(d)).
      block: elements per scale within a tensor, or None for one per tensor.

    Example:
      >>> c = tf_gradsync.compression.ErrorFeedback(tf_gradsync.compression.get("sign"))
    """

    summable = False
    unbiased = False

    def __init__(self, scale: str = "l1", block: int | None = None):
        if scale not in _SCALES:
            raise ValueError(f"scale must be one of {', '.join(_SCALES)}, got {scale!r}")
        if block is not None:
            _util.check_number("block", block, 1, integer=True)
        self.scale, self.block = scale, block

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed bits, scales), (segments, dtype))`."""
        layout = ctx.layout_of(x)
        seg = (_util.Segments.of(layout) if self.block is None
               else _util.Segments.chunks(layout, self.block))
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        sizes = tf.constant(seg.sizes, wd)
        if self.scale == "l1":
            scale = seg.sum(tf.abs(v)) / sizes
        else:
            scale = tf.sqrt(seg.sum(tf.square(v)) / sizes)
        return (_util.pack(v >= 0, 1), scale + _util.poison(x, wd)), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * (+1 or -1), in the input dtype."""
        packed, scale = payload
        seg, dtype = meta
        signs = tf.cast(2 * _util.unpack(packed, 1, seg.numel) - 1, scale.dtype)
        return tf.cast(signs * seg.expand(scale), dtype)
