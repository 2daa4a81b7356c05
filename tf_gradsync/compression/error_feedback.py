"""Error feedback: carry what a compressor lost over to the next step.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014;
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes", ICML 2019; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tf_gradsync.compression import _util, xla
from tf_gradsync.compression.base import (Compressor, Context, Layout, Payload, StateSpec,
                                          Wrapper, check_decoded, get)

_INNER = "inner_"


class ErrorFeedback(Wrapper):
    """Wraps a compressor: compresses e = x + residual and keeps e - decompress(...).

    Uses only the inner compressor's public interface. Its state variables are kept
    under names prefixed with `inner_`, next to the float32 (float64 for float64
    input) `residual`. `summable`, `prescale`, `floating_only`, the payload and its
    size, its modes and what it `observe`s are the inner compressor's; the result is
    biased (it is delayed, not lost). The inner compressor is used in its
    `for_error_feedback` form: random-k, for one, then drops its n / k scaling, which
    would make the residual grow without bound. If the new residual is not finite (a
    NaN/Inf gradient), it is reset to zero so one bad step does not poison later ones,
    while the payload still carries the non-finite values to every replica, as a plain
    all-reduce would. The compression error it reports is that of e, the input the
    inner compressor actually saw: ||new residual|| / ||e||.

    Args:
      inner: a `Compressor` or a registered name, with a single-round codec
        (`compress`/`decompress`) and no memory of its own (`has_own_memory`).

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
        if inner.has_own_memory or not inner.one_round:
            raise ValueError(f"ErrorFeedback cannot wrap {inner!r}: compressors with their own "
                             "memory (has_own_memory) or several rounds keep their own residual; "
                             "allowed: single-round compressors without memory")
        super().__init__(inner)
        self.unbiased = False
        self.num_modes = inner.num_modes

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        """The inner state (names prefixed `inner_`) plus `residual` [numel]."""
        spec = {_INNER + k: s for k, s in self.inner.state_spec(layout).items()}
        spec["residual"] = StateSpec((layout.numel,), _util.work_dtype(layout.dtype))
        return spec

    @staticmethod
    def _inner_ctx(ctx: Context) -> Context:
        return dataclasses.replace(ctx, state=ctx.substate(_INNER), errors=None)

    def mode(self, ctx: Context) -> tf.Tensor | None:
        return self.inner.mode(self._inner_ctx(ctx))

    def encode(self, x: tf.Tensor, ctx: Context) -> tuple[Payload, Any]:
        """Compresses x + residual with the inner codec; stores the new residual."""
        residual = ctx.state["residual"]
        e = tf.cast(x, residual.dtype) + residual
        payload, meta = xla.compress(self.inner, tf.cast(e, x.dtype), self._inner_ctx(ctx))
        payload = tuple(payload)

        def rest(sent) -> None:
            decoded = self.inner.decompress(sent, meta)
            check_decoded(self.inner, decoded, x)
            # Written in place: compiled, the residual's buffer is reused.
            residual.assign(e - tf.cast(decoded, residual.dtype))
        xla.decode(self, ctx, rest, payload)
        ctx.keep_residual(residual, e)
        return payload, meta

    def observe(self, reduced: tf.Tensor, ctx: Context) -> None:
        self.inner.observe(reduced, self._inner_ctx(ctx))


def with_error_feedback(compressor: Compressor, enabled: bool | None) -> Compressor:
    """`compressor` wrapped in `ErrorFeedback` when asked, or by default when it is
    biased and keeps no memory of its own (or says otherwise with
    `default_error_feedback`); an `ErrorFeedback` is returned as it is.

    Args:
      compressor: a registered compressor.
      enabled: True, False, or None for the compressor's default.

    Raises:
      ValueError: when asked to wrap, or not to wrap, a compressor that keeps its own
        memory (either way its memory is its own), or to wrap one that sends its input
        exactly (its residual would be a bucket of zeros).
    """
    if enabled is not None and compressor.has_own_memory:
        # False would change nothing: the memory is the compressor's own.
        raise ValueError(f"{compressor!r} keeps its own error memory, which "
                         f"error_feedback={enabled} does not reach; leave it unset (a "
                         "compressor with a switch for its memory has it among its own "
                         "settings: powersgd's error_feedback)")
    if isinstance(compressor, ErrorFeedback) or enabled is False:
        return compressor
    if enabled and compressor.exact:
        raise ValueError(f"{compressor!r} sends every value exactly, so it has no error to feed "
                         "back; leave error_feedback unset")
    if enabled is None:
        enabled = compressor.default_error_feedback
        if enabled is None:     # a compressor of its own rounds keeps its own residual
            enabled = (not compressor.unbiased and not compressor.has_own_memory
                       and compressor.one_round)
    return ErrorFeedback(compressor) if enabled else compressor
