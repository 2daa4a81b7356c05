"""The identity compressor: sends the bucket as it is."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression.base import Compressor, Context, register


@register("none")
class NoCompression(Compressor):
    """Sends the bucket unchanged; bit-exact, any numeric dtype.

    Example:
      >>> ops = tf_gradsync.CompressedAllReduce("none")
    """

    accuracy = "lossless"
    summable = True
    unbiased = True
    exact = True

    floating_only = False

    def compress(self, x: tf.Tensor, ctx: Context):
        del ctx
        return (x,), None

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        del meta
        return payload[0]
