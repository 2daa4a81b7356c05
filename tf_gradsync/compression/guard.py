"""A run-time accuracy guard: a bucket whose compression error stays too high falls
back to a less lossy compressor, and returns when the error would fall."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Mapping

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import (GATHER, SUM, Compressor, Context, Layout, Message,
                                          OptimizerAdvice, Rounds, StateSpec, get,
                                          weight_decay_change)

_INNER, _FALLBACK = "inner_", "fallback_"


class Guard(Compressor):
    """Sends a bucket with `inner`, or with `fallback` while `inner` loses too much.

    Each step every replica measures the relative compression error of its bucket,
    ||x - C(x)|| / ||x|| (what `stats()["comm_error"]` reports). The squared error and
    norm ride, 8 bytes, on the next step's first round and are summed over every
    replica there, so every replica and worker sees the same pooled error and takes
    the same decision without a round of their own (a collective's latency per
    bucket and step), one step late. At the end of each `window` of pooled steps, a
    bucket whose mean pooled error exceeded `bound` switches to `fallback`; while it
    is there, each replica also measures what `inner` would lose on its bucket: a
    single-round codec encodes without sending, a compressor of several rounds
    (PowerSGD, whose second round needs the first's sum) runs its rounds in full,
    its result unused. The bucket returns to `inner`, with its state (residuals)
    reset, once that mean falls to `bound` or below. Non-finite steps are left out of
    the means.

    State per bucket and replica: `inner`'s and `fallback`'s (prefixed `inner_`,
    `fallback_`), the last step's error terms (`terms`), the window's error sum and
    step count, and the level (0: inner).

    Args:
      inner: the compressor to guard (a name or instance, e.g. wrapped in
        `ErrorFeedback`); single-bucket exchanges only (not cut into two phases).
      fallback: the less lossy compressor (default fp16).
      bound: the largest tolerated mean relative error, in (0, 1]. Error feedback
        keeps a compressor's error high by design (top-k at 1% reports 0.94-0.96 on
        the digits CNN and trains as uncompressed training does), so the default,
        0.99, only catches a compressor that keeps next to nothing.
      window: steps per decision, an integer >= 1.

    Raises:
      ValueError: for a setting outside its range.

    Example:
      >>> g = Guard(ErrorFeedback(get("topk", ratio=1e-4)))
    """

    name = "guard"
    unbiased = False
    splittable = False

    def __init__(self, inner: Compressor | str, fallback: Compressor | str = "fp16",
                 bound: float = 0.99, window: int = 20):
        _util.check_number("bound", bound, 0, 1, low_open=True)
        _util.check_number("window", window, 1, integer=True)
        self.inner, self.fallback = get(inner), get(fallback)
        # Encoding alone gives the error of a single-round codec; others run in full.
        self._encodes = self.inner.codec().one_round
        self.bound, self.window = bound, window
        self.num_modes = self.inner.num_modes + self.fallback.num_modes
        self.summable = self.inner.summable
        self.floating_only = self.inner.floating_only or self.fallback.floating_only
        self.accuracy = self.inner.accuracy

    def check_input(self, x: tf.Tensor) -> None:
        self.inner.check_input(x)
        self.fallback.check_input(x)

    def check_optimizer(self, optimizer: Any) -> None:
        """The inner and fallback compressors' checks, with the guard's own advice in
        place of theirs (it keeps the momentum they would drop)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizerAdvice)
            self.inner.check_optimizer(optimizer)
            self.fallback.check_optimizer(optimizer)
        super().check_optimizer(optimizer)

    def optimizer_unseen(self) -> None:
        self.inner.optimizer_unseen()

    def sparse_unseen(self) -> None:
        self.inner.sparse_unseen()

    def send_interval(self) -> float:
        return self.inner.send_interval()

    def rms_step(self) -> float:
        return self.inner.rms_step()

    def steady_mode(self) -> int:
        """The inner compressor's: the fallback is the exception."""
        return self.inner.steady_mode()

    def _optimizer_changes(self, optimizer: Any) -> tuple[float, dict]:
        """The learning-rate scale, and only the changes the inner compressor cannot
        train without (DGC's momentum, which it applies itself: a bucket the guard
        sends in fp16 then trains without momentum), and the weight decay kept per step.
        The momentum stays otherwise, since the guard may send its buckets dense, where
        the optimizer needs it (without it, a CNN guarded from a far too aggressive
        top-k ended 5 points below uncompressed training)."""
        factor = self.learning_rate_scale(optimizer)
        return factor, {**self.inner.required_optimizer_changes(optimizer),
                        **weight_decay_change(optimizer, factor)}

    def sparse_values_dtype(self, dtype: tf.DType) -> tf.DType | None:
        return self.inner.sparse_values_dtype(dtype)

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        """Both compressors' state, `terms` (this replica's last squared error and
        norm), `error_sum`, `count` and `level` (0: inner)."""
        spec = {_INNER + k: s for k, s in self.inner.state_spec(layout).items()}
        spec.update({_FALLBACK + k: s for k, s in self.fallback.state_spec(layout).items()})
        spec.update({"terms": StateSpec((2,), tf.float32),
                     "error_sum": StateSpec((), tf.float32), "count": StateSpec((), tf.int64),
                     "level": StateSpec((), tf.int32)})
        return spec

    def report(self, states: Iterable[Mapping[str, tf.Variable]]) -> dict[str, float]:
        """`guarded_buckets` (buckets built so far) and `fallback_buckets` (those sent
        with the fallback now, as this replica's state says; every replica's agrees)."""
        levels = [int(s["level"].numpy()) for s in states]
        return {"guarded_buckets": len(levels),
                "fallback_buckets": sum(level > 0 for level in levels)}

    @staticmethod
    def _sub(ctx: Context, prefix: str, mode: int) -> Context:
        return dataclasses.replace(ctx, state=ctx.substate(prefix), mode=mode, errors=[])

    def mode(self, ctx: Context) -> tf.Tensor:
        """The inner compressor's modes while `level` is 0, then the fallback's."""
        def of(c, prefix):
            m = c.mode(self._sub(ctx, prefix, 0))
            return tf.constant(0, tf.int32) if m is None else tf.cast(m, tf.int32)
        level = ctx.state["level"]
        return tf.where(level == 0, of(self.inner, _INNER),
                        self.inner.num_modes + of(self.fallback, _FALLBACK))

    def rounds(self, x: tf.Tensor, ctx: Context) -> Rounds:
        on_inner = ctx.mode < self.inner.num_modes
        last = ctx.state["terms"].read_value()
        if on_inner:
            sub = self._sub(ctx, _INNER, ctx.mode)
            reduced, pooled = yield from _carrying(self.inner.rounds(x, sub), last)
            terms = sub.errors
        else:
            sub = self._sub(ctx, _FALLBACK, ctx.mode - self.inner.num_modes)
            n = ctx.num_replicas
            # The fallback may need its input divided by the replica count (fp16's
            # range); the guard as a whole does not prescale.
            scale = 1.0 / n if n > 1 and self.fallback.prescales(x.dtype) else 1.0
            reduced, pooled = yield from _carrying(
                self.fallback.rounds(x * tf.cast(scale, x.dtype), sub), last)
            reduced = reduced / tf.cast(scale, reduced.dtype)
            # The inner compressor keeps encoding (its memory advancing as if it sent):
            # what it would lose now, on the same footing as before.
            shadow = self._sub(ctx, _INNER, self.inner.steady_mode())
            if self._encodes:
                self.inner.encode(x, shadow)
            else:
                yield from self.inner.rounds(x, shadow)
            terms = shadow.errors
        if ctx.errors is not None:
            ctx.errors.extend(sub.errors)
        err = tf.add_n([tf.cast(e, tf.float32) for e, _ in terms]) if terms else tf.zeros([])
        norm = tf.add_n([tf.cast(v, tf.float32) for _, v in terms]) if terms else tf.zeros([])
        ctx.state["terms"].assign(tf.stack([err, norm]))
        self._decide(pooled, ctx, on_inner, ctx.layout_of(x))
        return reduced

    def _decide(self, pooled: tf.Tensor, ctx: Context, on_inner: bool, layout: Layout) -> None:
        s = ctx.state
        # Left out: non-finite steps, and the first step's (no step before it to pool).
        finite = tf.reduce_all(tf.math.is_finite(pooled)) & (pooled[1] > 0)
        relative = tf.sqrt(tf.math.divide_no_nan(pooled[0], pooled[1]))
        total = s["error_sum"] + tf.where(finite, relative, 0.0)
        count = s["count"] + tf.cast(finite, tf.int64)
        end = count >= self.window
        mean = total / tf.cast(tf.maximum(count, 1), tf.float32)
        level = s["level"].read_value()
        new = tf.where(end, tf.cast(mean > self.bound, tf.int32), level)
        if not on_inner:
            # Back to the inner compressor with a clean memory: its residual stopped
            # when the fallback took over and no longer matches the model.
            back = new < level
            for k, spec in self.inner.state_spec(layout).items():
                v = s[_INNER + k]
                v.assign(tf.where(back, spec.initializer(spec.shape, spec.dtype), v))
        s["level"].assign(new)
        s["error_sum"].assign(tf.where(end, 0.0, total))
        s["count"].assign(tf.where(end, tf.zeros_like(count), count))

    def __repr__(self) -> str:
        return (f"Guard({self.inner!r}, fallback={self.fallback!r}, bound={self.bound}, "
                f"window={self.window})")


def _carrying(rounds: Rounds, terms: tf.Tensor):
    """Drives `rounds` with `terms` riding on its first message. Returns its result and
    `terms` summed over the replicas."""
    message = next(rounds)
    if message.transport not in (SUM, GATHER):
        raise ValueError(f"Guard pools its error on a summed or gathered round, not on "
                         f"{message.transport!r}")
    like = message.like and tuple((*spec, tf.TensorSpec(terms.shape, terms.dtype))
                                  for spec in message.like)
    received = yield Message((*message.payload, terms), message.transport, like)
    if message.transport == SUM:
        received, pooled = tuple(received[:-1]), received[-1]
    else:
        received, pooled = [tuple(p[:-1]) for p in received], tf.add_n([p[-1] for p in received])
    while True:
        try:
            message = rounds.send(received)
        except StopIteration as stop:
            return stop.value, pooled
        received = yield message
