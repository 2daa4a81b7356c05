"""TernGrad: stochastic ternary gradients, 2 bits per entry, one scale per tensor.

References:
  Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
  Deep Learning", NeurIPS 2017.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _bits, _draws, _segments, _util
from tf_gradsync.compression.base import Compressor, Context, divides_by_rms, register
from tf_gradsync.compression.int8 import Int8


@register("terngrad")
class TernGrad(Compressor):
    """Sends scale * t with t in {-1, 0, 1} per tensor, P(t = sign x) = |x| / scale.

    As in the paper, each tensor (layer) is first clipped to `clip` standard
    deviations of its entries (None: no clipping), and scale is the largest clipped
    magnitude of the tensor; then E[scale * t] equals the clipped x. Clipping changes
    only the few outliers beyond the bound and shrinks the scale, and with it the
    variance scale * |x| - x^2 of each entry (the paper's Section 3.2). The Bernoulli
    draws are seeded per replica (`Context.replica_seed`), so replicas' errors are
    independent. Error feedback is off by default: the ternary noise is not a
    contraction, so a residual would only accumulate it.

    Under an optimizer that divides by a running root mean square (Adam, RMSprop,
    Adagrad: `divides_by_rms`), met when the all-reduce is traced
    (`check_optimizer`), the bound is `rms_clip` instead. Such an optimizer moves
    each entry by its mean over its root mean square, and the ternary noise of an
    entry much smaller than the scale swamps its mean square: small entries crawl
    (a CNN on digits under Adam 1e-3, 4 replicas, 15 epochs: 0.914 at the paper's 2.5
    sigma, 0.833 at 4, 0.744 unclipped; 0.958 at 1 and 0.967 at 0.75, against 0.969
    uncompressed; the digits MLP 0.969 at 1 and 0.961 at 0.75 against 0.975). The bias
    of a tight bound costs such an optimizer little, since it ignores each entry's
    scale, while SGD with momentum, which follows the magnitudes, keeps the paper's
    bound (at 1 sigma the residual network lost 2.5 points under it).

    Payload: `(codes, scales)`: 2-bit codes (0: zero, 1: +1, 2: -1) packed four per
    uint8, ceil(n / 4) bytes, and one float32 scale per tensor (float64 for float64
    input). All-gathered. A zero tensor gives zeros; a non-finite bucket NaN scales
    (all-NaN output).

    Args:
      clip: clipping bound in standard deviations per tensor (> 0), or None.
      rms_clip: the bound under optimizers that divide by a running root mean
        square (> 0), or None.

    Raises:
      ValueError: for a `clip` or `rms_clip` that is not a positive number or None.

    Example:
      >>> c = tf_gradsync.compression.get("terngrad")
    """

    accuracy = "balanced"

    summable = False
    batched_decode = True
    xla_decode = True
    default_error_feedback = False

    def __init__(self, clip: float | None = 2.5, rms_clip: float | None = 1.0):
        for name, bound in (("clip", clip), ("rms_clip", rms_clip)):
            if bound is not None:
                _util.check_number(name, bound, 0, low_open=True)
        self.clip, self.rms_clip = clip, rms_clip
        self.unbiased = clip is None and rms_clip is None
        self._bound = clip

    @property
    def bound(self) -> float | None:
        """The clipping bound in use: `clip` until an optimizer that divides by a
        running root mean square has been met, `rms_clip` after."""
        return self._bound

    def rms_step(self) -> float:
        """For Gaussian noise clipped at b = the bound in use under such optimizers:
        the mean keeps P(|z| < b) of the slope, the mean square is the scale b times
        E|clip(z)|: 0.86 at 1 sigma, 0.70 at 2.5 (no bound: as at 4 sigma, about the
        largest of ten thousand entries)."""
        b = next((c for c in (self.rms_clip, self.clip) if c is not None), 4.0)
        normal = statistics.NormalDist()
        mean_abs = 2 * (normal.pdf(0) - normal.pdf(b) + b * (1 - normal.cdf(b)))
        return (2 * normal.cdf(b) - 1) / math.sqrt(b * mean_abs)

    def check_optimizer(self, optimizer) -> None:
        """Settles the clipping bound: `rms_clip` under an optimizer that divides by a
        running root mean square, else `clip`."""
        super().check_optimizer(optimizer)
        self._bound = self.rms_clip if divides_by_rms(optimizer) else self.clip

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed codes, scales), (segments, dtype))`."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        # The statistics are TensorFlow's reductions over v; the clipping and the draws
        # are one loop (compiled by XLA under `Context.jit_compile`).
        magnitude = seg.abs_max(v)
        if self.bound is None:
            bound, scale, check = None, magnitude, x
        else:
            sum_sq = seg.sum_of_squares(v)
            mean = seg.mean(v)
            var = tf.maximum(sum_sq / seg.sizes_as(wd) - tf.square(mean), 0)
            bound = self.bound * tf.sqrt(var)
            # A constant tensor has sigma 0: it is left unclipped rather than zeroed.
            scale = tf.where(bound > 0, tf.minimum(magnitude, bound), magnitude)
            check = sum_sq    # not finite when an entry is not (or when it overflows)

        def encode(v, scale, bound, seed):
            if bound is not None:
                v = seg.apply(lambda e, b: tf.where(b > 0, tf.clip_by_value(e, -b, b), e),
                              v, bound)
            keep = _draws.uniform(seg.numel, seed, wd) < seg.apply(
                tf.math.divide_no_nan, tf.abs(v), scale)
            codes = tf.where(keep, tf.where(v > 0, 1, 2), 0)
            # The whole bytes and the last, partial one apart, joined outside the
            # compiled stage: XLA's CPU code ran a loop of draws that fed a padding or a
            # join of its output up to 20x slower (1M + 1 entries: 28 ms against 1.5).
            whole = seg.numel - seg.numel % 4
            if whole == seg.numel:
                return (_bits.pack(codes, 2),)
            return _bits.pack(codes[:whole], 2), _bits.pack(codes[whole:], 2)
        packed = tf.concat(ctx.stage(encode, v, scale, bound, ctx.replica_seed()), 0)
        return (packed, scale + _util.poison(check, wd)), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """scale * {0, +1, -1}[code], in the input dtype."""
        packed, scale = payload
        seg, dtype = meta
        t = _bits.unpack(packed, 2, seg.numel, values=(0, 1, -1, 0), dtype=scale.dtype)
        return tf.cast(seg.apply(tf.multiply, t, scale), dtype)

    def server_codec(self) -> Compressor:
        """int8 with a scale per tensor, as for `Sign`. An owner re-sending its sum of
        N ternary payloads as TernGrad, under the owner's error feedback, keeps
        ternary noise in a residual that no step contracts: on a 1M bucket of 4
        replicas its norm grew 1.3e3 -> 3.4e3 over 12 steps and the result's 3.8e3 ->
        9.8e3 (the sum's: 2.0e3; BENCHMARKS.md). The sum's levels {-N, ..., N} fit
        int8."""
        return Int8()
