"""Dense warm-up: exact all-reduce for the first steps, then the wrapped compressor.

References:
  Lin et al., "Deep Gradient Compression", ICLR 2018 (warm-up training);
  Tang et al., "1-bit Adam", ICML 2021 (an uncompressed warm-up stage);
  PyTorch's `powerSGD_hook` (`start_powerSGD_iter`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Mapping

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import (SUM, Compressor, Context, Layout, Message,
                                          OptimizerAdvice, Rounds, StateSpec, Wrapper,
                                          adaptation, applying_optimizer, get,
                                          optimizer_momentum)


class Warmup(Wrapper):
    """All-reduces the bucket uncompressed for `steps` synchronisations, then runs `inner`.

    The first steps of training move fastest and matter most; compressors that delay
    part of the gradient (error feedback) or approximate it (low rank) do worst there.
    During the warm-up the inner compressor's state is left untouched (residuals stay
    zero), so it starts from a trained-in model with a clean memory. Mode 0 is the
    dense round; modes 1.. are the inner compressor's.

    Args:
      inner: a `Compressor` or registered name (typically already wrapped in
        `ErrorFeedback`).
      steps: synchronisations sent dense, an integer >= 0.

    Raises:
      ValueError: for a `steps` that is not a non-negative integer.

    Example:
      >>> c = Warmup(ErrorFeedback("sign"), steps=100)
    """

    name = "warmup"

    def __init__(self, inner: Compressor | str, steps: int):
        _util.check_number("steps", steps, 0, integer=True)
        super().__init__(get(inner))
        self.steps = steps
        self.default_error_feedback = False     # the inner one decides its own
        self.num_modes = 1 + self.inner.num_modes

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        return self.inner.state_spec(layout)

    def report(self, states: Iterable[Mapping[str, tf.Variable]]) -> dict[str, float]:
        return self.inner.report(states)        # the state is the inner one's

    def check_optimizer(self, optimizer: Any) -> None:
        """Warns when a sparse payload follows the warm-up under SGD with momentum:
        moving a trained model to a payload that delays most entries cost the digits
        MLP up to 24 points for several epochs there (BENCHMARKS.md), where the same
        payload from the first step did not. Where `adapt_optimizer` takes the momentum
        off (the advice `Compressor.check_optimizer` gives), that advice covers it.

        Warns too when the optimizer was adapted with a rate raised for an optimizer
        that divides by a root mean square: the warm-up's dense gradients then train
        at that rate, meant for the payload's bursts (`learning_rate_scale`)."""
        name, momentum = optimizer_momentum(optimizer)
        _, changes = self._optimizer_changes(optimizer)
        rms_factor = self.inner.learning_rate_scale(applying_optimizer(optimizer))
        mark = adaptation(optimizer)
        # A schedule adapted is the user's to shape (the piecewise one below, say).
        if self.steps and rms_factor > 1 and mark is not None and mark.learning_rate is not None:
            warnings.warn(OptimizerAdvice(
                f"warmup_steps={self.steps}: the warm-up's dense gradients train with "
                f"{type(applying_optimizer(optimizer)).__name__} adapted for {self.inner!r}, "
                f"at {rms_factor:.3g}x its rate (raised for the payload's bursts, which dense "
                "gradients do not have). For the uncompressed rate during the warm-up, give "
                "the optimizer a schedule before adapting it, keras.optimizers.schedules."
                f"PiecewiseConstantDecay([{self.steps - 1}], [rate / {rms_factor:.4g}, rate]): "
                "adapt_optimizer scales every rate of a schedule"), stacklevel=2)
        if (self.steps and name == "momentum" and momentum and self.inner.send_interval() > 1
                and "momentum" not in changes):
            warnings.warn(
                f"warmup_steps={self.steps} before {self.inner!r}, which sends an entry "
                f"about every {self.inner.send_interval():.3g} steps, under "
                f"{type(optimizer).__name__} with momentum={momentum}: switching a trained "
                "model to a sparse payload under momentum costs accuracy for several "
                "epochs; start sparse (warmup_steps=0) or use a compressor that sends "
                "every entry (powersgd, int8, sign)", stacklevel=2)
        super().check_optimizer(optimizer)

    def mode(self, ctx: Context) -> tf.Tensor:
        """0 during the warm-up, then 1 + the inner compressor's mode."""
        inner = self.inner.mode(ctx)
        inner = tf.constant(0, tf.int32) if inner is None else tf.cast(inner, tf.int32)
        return tf.where(tf.cast(ctx.step, tf.int64) < self.steps, 0, 1 + inner)

    def rounds(self, x: tf.Tensor, ctx: Context) -> Rounds:
        if ctx.mode == 0:
            return (yield from dense_round(x, ctx))
        return (yield from self.inner.rounds(x, dataclasses.replace(ctx, mode=ctx.mode - 1)))


def dense_round(x: tf.Tensor, ctx: Context) -> Rounds:
    """One exact summed round of the whole bucket (its compression error is zero)."""
    ctx.record_error(x, None)
    (total,) = yield Message((x,), SUM)
    return total
