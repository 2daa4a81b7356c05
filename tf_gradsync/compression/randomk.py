"""Random-k sparsification with shared coordinates, so payloads can be summed.

References:
  Stich et al., "Sparsified SGD with Memory", NeurIPS 2018 (rand-k);
  Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed
  Optimization", NeurIPS 2018.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _draws, _segments, _selection, _util
from tf_gradsync.compression.base import Compressor, Context, register


@register("randomk")
class RandomK(Compressor):
    """Sends k = max(1, ceil(ratio * size)) coordinates of each tensor, drawn at random:
    one from each of k strata of nearly equal length, so every entry is equally likely.

    Every replica draws the same coordinates (stateless draws seeded by `ctx.seed`),
    so the payload is just the K kept values in the input dtype (K * itemsize bytes,
    K the sum of the tensors' k) and is summed on the wire; decompression scatters the
    sum to the coordinates kept in the local metadata.

    Random-k learns less per step than any other compressor here, for a reason that is
    not an implementation detail: it keeps a k / n share of the gradient's energy
    whatever the gradient looks like. With `scale=True` each value is multiplied by its
    stratum's length (size / k when k divides the size), which makes the estimate
    unbiased but multiplies its variance by about n / k. By default (`scale=False`) the
    kept values go out as they are and error feedback (on by default) sends the rest
    later (Stich et al.'s rand-k with memory); the theory of error feedback then asks
    for a learning rate about k / n times smaller, since an entry waits n / k steps on
    average and leaves in one burst. At the learning rates people use with momentum SGD
    both forms diverge unless about half the entries go out: measured on a CNN with SGD
    (learning rate 0.05, momentum 0.9), error feedback trained at ratio 0.5 (within 2
    points of uncompressed training) and diverged at 0.25, 0.1 and 0.01, cyclic
    selection included, and the unbiased form diverged at 0.25. So the default ratio is
    0.5; smaller ratios suit small learning rates (or learning rates divided by n / k).
    `topk` keeps far more of the energy for the same bytes, because gradients are
    heavy-tailed.

    The scaling happens after the sum, in float32 (float64 for float64 input), so
    16-bit payloads cannot overflow from it. Drawing the coordinates is a few
    elementwise passes over K integers (`_draws.random_per_segment`), or, at the default
    ratio on even sizes, one random bit per pair of entries, read in the loop that takes
    or places the values; Philox draws and integer arithmetic give every device the
    same ones. With `cyclic=True` each stratum walks through its entries in about n / k
    steps, so every entry goes out at least once per cycle (bounded delay), from a new
    random start each cycle.

    Args:
      ratio: fraction of entries kept, in (0, 1].
      scale: multiply by about size / k on decompression (unbiased, no error feedback by
        default); False: unscaled, biased, with error feedback by default.
      cyclic: every entry once per 1 / ratio steps instead of independent draws.

    Raises:
      ValueError: if `ratio` is outside (0, 1] or `scale` or `cyclic` is not a bool.

    Example:
      >>> c = tf_gradsync.compression.get("randomk", ratio=0.25)
    """

    summable = True
    xla_decode = True

    def __init__(self, ratio: float = 0.5, scale: bool = False, cyclic: bool = False):
        _util.check_number("ratio", ratio, 0, 1, low_open=True)
        for name, value in (("scale", scale), ("cyclic", cyclic)):
            _util.check_flag(name, value)
        self.ratio, self.scale, self.cyclic = ratio, scale, cyclic
        self.unbiased = scale

    def send_interval(self) -> float:
        """1/ratio: every entry is equally likely to go out."""
        return 1 / self.ratio

    def for_error_feedback(self) -> "RandomK":
        """The unscaled (biased, contractive) form, for use under error feedback."""
        return RandomK(self.ratio, scale=False, cyclic=self.cyclic) if self.scale else self

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values,), (coordinates, dtype))`: the drawn coordinates
        (`_draws.Drawn`) stay local for decompression (every replica draws the same)."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        step = tf.convert_to_tensor(ctx.step, tf.int64) if self.cyclic else None
        drawn = _draws.random_per_segment(
            tf.convert_to_tensor(ctx.seed, tf.int64), seg, _selection.counts(self.ratio, seg), step,
            stage=ctx.stage)
        return (drawn.take(x, ctx.stage, plus=_util.poison(x)),), (drawn, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Scatters the (summed) values to the drawn coordinates, each times its
        stratum's length (about size / k) if `scale`."""
        drawn, dtype = meta
        wd = _util.work_dtype(dtype)
        values = tf.cast(payload[0], wd)
        if self.scale:
            values *= tf.cast(drawn.lengths, wd)
        return tf.cast(drawn.place(values, wd), dtype)
