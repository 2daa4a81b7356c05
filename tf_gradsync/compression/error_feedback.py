"""Error feedback: carry what a compressor lost over to the next step.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014;
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes", ICML 2019; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Compressor, Context, RoundCompressor, StateSpec, get

_INNER = "inner_"


class ErrorFeedback(Compressor):
    """Wraps a compressor: compresses e = x + residual and keeps e - decompress(...).

    Uses only the inner compressor's public interface. Its state variables are kept
    under names prefixed with `inner_`, next to the float32 (float64 for float64
    input) `residual`. `summable`, `prescale`, `floating_only`, the payload and its
    size, its payload variants (`variant`) and what it `observe`s are the inner
    compressor's; the result is biased (it is delayed, not lost). The inner
    compressor is used in its `for_error_feedback` form: random-k, for one, then
    drops its n / k scaling, which would make the residual grow without bound.
    If the new residual is not finite (a NaN/Inf gradient), it is reset to zero so
    one bad step does not poison later ones, while the payload still carries the
    non-finite values to every replica, as a plain all-reduce would.

    Args:
      inner: a `Compressor` or a registered name; not multi-round and not one with
        its own memory (`has_own_memory`, e.g. dgc, powersgd).

    Raises:
      ValueError: for an inner compressor that cannot be wrapped.

    Example:
      >>> c = ErrorFeedback(tf_gradsync.compression.get("topk", ratio=0.01))

    References:
      Karimireddy et al., ICML 2019 (see the module docstring).
    """

    name = "error_feedback"
    unbiased = False

    def __init__(self, inner: Compressor | str):
        inner = get(inner).for_error_feedback()
        if isinstance(inner, RoundCompressor) or inner.has_own_memory:
            raise ValueError(f"ErrorFeedback cannot wrap {inner!r}: multi-round compressors and "
                             "compressors with their own memory (has_own_memory) keep their own "
                             "residual; allowed: single-round compressors without memory")
        self.inner = inner
        self.summable = inner.summable
        self.prescale = inner.prescale
        self.floating_only = inner.floating_only
        self.num_variants = inner.num_variants

    def state_spec(self, numel: int, dtype: tf.DType) -> dict[str, StateSpec]:
        """The inner state (names prefixed `inner_`) plus `residual` [numel]."""
        spec = {_INNER + k: s for k, s in self.inner.state_spec(numel, dtype).items()}
        spec["residual"] = StateSpec((numel,), _util.work_dtype(dtype))
        return spec

    def check_input(self, x: tf.Tensor) -> None:
        self.inner.check_input(x)

    @staticmethod
    def _inner_ctx(ctx: Context) -> Context:
        state = {k[len(_INNER):]: v for k, v in ctx.state.items() if k.startswith(_INNER)}
        return dataclasses.replace(ctx, state=state)

    def compress(self, x: tf.Tensor, ctx: Context):
        """Compresses x + residual with the inner compressor; stores the new residual."""
        residual = ctx.state["residual"]
        e = tf.cast(x, residual.dtype) + residual
        payload, meta = self.inner.compress(tf.cast(e, x.dtype), self._inner_ctx(ctx))
        new = e - tf.cast(self.inner.decompress(payload, meta), residual.dtype)
        residual.assign(tf.where(tf.reduce_all(tf.math.is_finite(new)), new, 0))
        return payload, meta

    def decompress(self, payload: Sequence[tf.Tensor], meta) -> tf.Tensor:
        return self.inner.decompress(payload, meta)

    def payload_bytes(self, payload: Sequence[tf.Tensor]) -> tf.Tensor:
        return self.inner.payload_bytes(payload)

    def variant(self, ctx: Context) -> tf.Tensor | None:
        return self.inner.variant(self._inner_ctx(ctx))

    def observe(self, reduced: tf.Tensor, ctx: Context) -> None:
        self.inner.observe(reduced, self._inner_ctx(ctx))
