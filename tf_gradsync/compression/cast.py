"""Half-precision compressors: fp16 and bf16 casts.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018. PyTorch's
  `fp16_compress_hook` / `bf16_compress_hook` use the same scheme for DDP.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, register


class _Cast(Compressor):
    """Casts to a 16-bit wire dtype; halves the bytes of float32 gradients.

    Summation along a ring accumulates in float32 at each hop and is rounded once per
    hop. A bucket already in 16 bits (float16, bfloat16: a mixed-precision model's) goes
    as it is: the cast would save no byte, and fp16 would lose bfloat16's range (1e6
    overflowed, 1e-9 vanished), bf16 float16's precision.
    """

    accuracy = "lossless"
    summable = True
    unbiased = True

    wire_dtype: ClassVar[tf.DType]

    def _narrows(self, dtype: tf.DType) -> bool:
        """Whether the cast makes a bucket of `dtype` smaller (16-bit ones go as they are)."""
        return dtype.size > self.wire_dtype.size

    def compress(self, x: tf.Tensor, ctx: Context):
        del ctx
        wire = self.wire_dtype if self._narrows(x.dtype) else x.dtype
        return (tf.cast(x, wire),), x.dtype

    def prescales(self, dtype: tf.DType) -> bool:
        """Only what the cast narrows: a 16-bit bucket is summed as TensorFlow sums it,
        its small values not divided towards zero first."""
        return self.prescale and self._narrows(dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta: tf.DType) -> tf.Tensor:
        return tf.cast(payload[0], meta)

    def sparse_values_dtype(self, dtype: tf.DType) -> tf.DType | None:
        """Embedding gradients' values travel in the wire dtype too (half the bytes)."""
        return self.wire_dtype if dtype.is_floating and dtype.size > 2 else None


@register("fp16")
class Float16(_Cast):
    """IEEE half precision (11-bit significand, range +-65504).

    By default input is divided by the replica count N before the cast (`prescale`),
    so the sum of all replicas' payloads on the wire is a mean and cannot overflow
    float16 (PyTorch's `fp16_compress_hook` divides too). The price is at the small
    end: float16's normal numbers start at 6.1e-5, so entries below about 6e-5 N keep
    fewer significant bits and those below 3e-8 N vanish. `prescale=False` casts the
    gradient as it is and divides the sum (Horovod's fp16 compression without a
    predivide): small entries keep N times more room, and a sum beyond 65504 turns
    into Inf (a loss-scaled step then skips). `bf16` keeps float32's range for both.

    Args:
      prescale: divide by N before the cast (True) or after the sum (False).

    Raises:
      ValueError: if `prescale` is not a bool.

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("fp16")
      >>> small = tf_gradsync.compression.get("fp16", prescale=False)
    """

    wire_dtype = tf.float16

    def __init__(self, prescale: bool = True):
        _util.check_flag("prescale", prescale)
        self.prescale = bool(prescale)


@register("bf16")
class BFloat16(_Cast):
    """bfloat16 (8-bit significand, float32's range): coarser but never overflows.

    Not prescaled: the range needs no division by the replica count, so a SUM takes
    no pass over the bucket to divide and none to multiply back.

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("bf16")
    """

    wire_dtype = tf.bfloat16
