"""1-bit SGD: one bit per entry, reconstructed from the magnitude of its class per block.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
  Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _bits, _segments, _util
from tf_gradsync.compression.base import Compressor, Context, register
from tf_gradsync.compression.int8 import Int8


@register("onebit")
class OneBit(Compressor):
    """Sends bit = (x >= 0) and, per block, one magnitude for each sign class.

    Each tensor is cut into blocks of `block` entries (the paper quantises per column
    of a weight matrix; `block=None`: one block per tensor). Per block, the
    non-negative entries decode to the root mean square of the non-negative entries,
    the negative ones to minus that of the negative entries (0 for an empty class).
    The paper's reconstruction values are the class means, which minimise the squared
    error for the given bits; under error feedback they delay the largest entries (see
    `Sign` for why), and the class root mean square, which sends each class's full
    energy, trains where the means diverge. The paper carries the quantisation error
    to the next step; here that is `ErrorFeedback(OneBit())`, the default. Biased.

    Payload: `(bits, positive magnitudes, negative magnitudes)`: bits packed eight per
    uint8, ceil(n / 8) bytes, and two bfloat16 values per block (float64 for float64
    input): 2 bits per entry at the default block of 32. All-gathered. A non-finite
    bucket gives NaN magnitudes (all-NaN output).

    Args:
      block: entries per pair of magnitudes within a tensor, an integer >= 1, or None
        for one pair per tensor.

    Raises:
      ValueError: for a `block` that is not a positive integer or None.

    Example:
      >>> c = tf_gradsync.compression.ErrorFeedback(tf_gradsync.compression.get("onebit"))
    """

    accuracy = "balanced"

    summable = False
    batched_decode = True
    xla_decode = xla_compress = True
    unbiased = False

    def __init__(self, block: int | None = 32):
        if block is not None:
            _util.check_number("block", block, 1, integer=True)
        self.block = block

    def rms_step(self) -> float:
        """0.8, measured on a noise stream through error feedback as for `Sign`
        (`tests/test_compressors.py`): each entry goes at its side's root mean square."""
        return 0.8

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((packed bits, positive, negative magnitudes), (segments, dtype))`."""
        seg = _segments.blocks(ctx.layout_of(x), self.block)
        wd = _util.work_dtype(x.dtype)
        v = tf.cast(x, wd)
        bit = v >= 0
        # One pass for the four (relu(v): the positive side; the sums check finiteness,
        # as `_util.all_finite` does): a round trip of 25M entries, one core, 76-79 ->
        # 56 ms.
        n_pos, sq_pos, sq, sums = seg.statistics(
            ("sum", tf.cast(bit, wd)), ("sum_of_squares", tf.nn.relu(v)),
            ("sum_of_squares", v), ("sum", v))
        hi = tf.sqrt(tf.math.divide_no_nan(sq_pos, n_pos))
        lo = tf.sqrt(tf.math.divide_no_nan(sq - sq_pos, seg.sizes_as(wd) - n_pos))
        bad, sd = _util.poison(sums, wd), _util.scale_dtype(x.dtype)
        return (_bits.pack(bit, 1), tf.cast(hi + bad, sd), tf.cast(lo + bad, sd)), (seg, x.dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        """Each entry becomes its class's magnitude in its block, signed, in the input dtype."""
        packed, hi, lo = payload
        seg, dtype = meta
        wd = _util.work_dtype(dtype)
        bit = _bits.unpack(packed, 1, seg.numel, values=(False, True), dtype=tf.bool)
        # One select that broadcasts each block's two magnitudes over its row, instead
        # of writing both expansions out first.
        sides = tf.stack([tf.cast(hi, wd), -tf.cast(lo, wd)], -1)
        return tf.cast(seg.apply(lambda b, s: tf.where(b, s[..., 0], s[..., 1]), bit, sides),
                       dtype)

    def server_codec(self) -> Compressor:
        """int8, as for `Sign` (see `Sign.server_codec`): one bit per entry cannot
        carry an owner's sum of N payloads (onebit re-sent as onebit ended at 0.87 where
        uncompressed training reached 0.978; as int8, 0.978)."""
        return Int8()
