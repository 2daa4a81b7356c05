"""Deep Gradient Compression: sparse updates with momentum correction and masking.

References:
  Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
  Distributed Training", ICLR 2018.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import tensorflow as tf

from tf_gradsync.compression import _segments, _selection, _sparse, _util
from tf_gradsync.compression.base import (Compressor, Context, Layout, OptimizerRefused,
                                          StateSpec, applying_optimizer, optimizer_config,
                                          optimizer_momentum, register, sum_of_squares, when)


@register("dgc")
class DGC(_sparse.SparseDecoding, Compressor):
    """Accumulates momentum locally and sends only the largest accumulated entries.

    Per step, with g the (optionally clipped) gradient: u = momentum * u + g (momentum
    correction), v = v + u; the k largest |v| (sampled threshold, as in `threshold`)
    are sent and zeroed in both u and v (momentum factor masking); the rest stays in
    v. v already is the error memory, so do not wrap DGC in `ErrorFeedback`. Momentum
    is applied here, so train with SGD without momentum: DGC raises a ValueError
    naming both momenta before the first step when the optimizer applying the
    gradients has one (`check_optimizer`: SGD's momentum, or Adam's beta_1, whose
    first moment compounds with DGC's momentum in the same way; measured under Adam,
    DGC lost 7 to 12 points).

    The default keeps 1% of each tensor. The paper's 0.1% (`ratio=0.001`) relies on
    large layers and a warm-up (`warmup_steps`, about 4 epochs in the paper): k per
    tensor is then a handful of entries for the layers of small models, and a CNN of
    58k parameters lost 7 points (11 with a 100-step warm-up) where 1% stays within 2
    (BENCHMARKS.md).

    Clipping: g is clipped to L2 norm `clip_norm / sqrt(num_replicas)` (the paper's
    local clipping) when `clip_norm` is set. Warm-up: as in the paper, the kept
    fraction falls in stages, by a factor of at most 4 each, from `warmup_ratio` at
    step 0 to `ratio` at `warmup_steps` (e.g. 0.25, 0.0625, 0.0156, 0.004, 0.001),
    the stages evenly spread over the warm-up. Each stage is one fixed payload
    mode (`mode`, chosen by the step, so equal everywhere) with payloads of fixed
    shapes; only the current stage's payload is sent. Keep the warm-up early, as
    the paper does: one ending when the model has already trained (step 300 of the
    digits MLP) dipped 8 points, as every late move to a sparser payload under
    momentum does (BENCHMARKS.md). k is taken per tensor of the
    bucket (ratio x size, at least 1), as the paper selects per layer.

    Payload: `(values, indices)`, values in the input dtype and int32 indices, K
    entries (the sum of the tensors' k, padded with zeros at unselected entries):
    K * (itemsize + 4) bytes. All-gathered; biased. A non-finite gradient sends NaN
    values and resets u and v to zero.

    Args:
      ratio: fraction of entries sent after warm-up, in (0, 1].
      momentum: momentum factor, in [0, 1).
      clip_norm: global L2 clipping norm (> 0), or None for no clipping.
      warmup_steps: length of the warm-up in steps, an integer >= 0.
      warmup_ratio: fraction sent at step 0, in [ratio, 1] (in (0, 1] if unused).
      sample_ratio: fraction of each long tensor sampled for its threshold, in (0, 1].

    Raises:
      ValueError: for an argument outside its range.

    Example:
      >>> c = tf_gradsync.compression.get("dgc", ratio=0.001, warmup_steps=1000)
    """

    summable = False
    unbiased = False
    has_own_memory = True

    def __init__(self, ratio: float = 0.01, momentum: float = 0.9, clip_norm: float | None = None,
                 warmup_steps: int = 0, warmup_ratio: float = 0.25, sample_ratio: float = 0.01):
        _util.check_number("ratio", ratio, 0, 1, low_open=True)
        _util.check_number("momentum", momentum, 0, 1, high_open=True)
        if clip_norm is not None:
            _util.check_number("clip_norm", clip_norm, 0, low_open=True)
        _util.check_number("warmup_steps", warmup_steps, 0, integer=True)
        _util.check_number("warmup_ratio", warmup_ratio, ratio if warmup_steps else 0, 1,
                           low_open=not warmup_steps)
        _util.check_number("sample_ratio", sample_ratio, 0, 1, low_open=True)
        self.ratio, self.momentum, self.clip_norm = ratio, momentum, clip_norm
        self.warmup_steps, self.warmup_ratio = warmup_steps, warmup_ratio
        self.sample_ratio = sample_ratio
        self.ratios = self._stages()
        self.num_modes = len(self.ratios)
        self._warned: set[str] = set()      # the warnings given (`_warn_once`)

    def _stages(self) -> tuple[float, ...]:
        """The kept fraction of each warm-up stage, ending with `ratio`."""
        if self.warmup_steps == 0 or self.warmup_ratio == self.ratio:
            return (self.ratio,)
        drop = self.warmup_ratio / self.ratio
        stages = math.ceil(math.log(drop) / math.log(4) - 1e-9)
        return (*(self.warmup_ratio * drop ** (-j / stages) for j in range(stages)), self.ratio)

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        """Momentum `u` and accumulated velocity `v`, float32 (float64 for float64)."""
        wd = _util.work_dtype(layout.dtype)
        return {"u": StateSpec((layout.numel,), wd), "v": StateSpec((layout.numel,), wd)}

    def mode(self, ctx: Context) -> tf.Tensor | None:
        """The warm-up stage of this step (None without warm-up)."""
        if self.num_modes == 1:
            return None
        last = self.num_modes - 1
        stage = tf.cast(ctx.step, tf.int64) * last // self.warmup_steps
        return tf.cast(tf.minimum(stage, last), tf.int32)

    def check_optimizer(self, optimizer) -> None:
        """Refuses an optimizer that applies momentum on top of DGC's own (SGD's
        `momentum`, Adam's `beta_1`)."""
        name, momentum = optimizer_momentum(optimizer)
        if self.momentum > 0 and momentum:
            # SGD's heavy ball is what DGC's momentum correction replaces; Adam's first
            # moment is not, and Adam without it lost points (`_optimizer_changes`).
            fix = ("CompressedAllReduce.adapt_optimizer(optimizer) rebuilds it so"
                   if name == "momentum" else f"adapt_optimizer cannot take {name} off for dgc")
            raise OptimizerRefused(
                f"dgc applies momentum {self.momentum} itself (momentum correction), and the "
                f"optimizer {type(applying_optimizer(optimizer)).__name__} applies "
                f"{name}={momentum} again: the two compound and training diverges or "
                f"stalls. Use SGD without momentum (SGD(momentum=0.0); {fix}), or dgc "
                "with momentum=0.0 (sparsification with accumulation, no momentum "
                "correction)")
        super().check_optimizer(optimizer)

    def optimizer_unseen(self) -> None:
        """Warns, once, that the optimizer's momentum cannot be refused (gradients
        all-reduced by hand): under SGD with momentum 0.9 the two compound unseen."""
        self._warn_once(
            "unseen", f"dgc applies momentum {self.momentum} itself, and these gradients "
            "are all-reduced outside an optimizer's apply_gradients, so the optimizer "
            "that applies them cannot be checked: give it no momentum of its own "
            "(SGD(momentum=0.0)), or the two compound")

    def sparse_unseen(self) -> None:
        """Warns, once, that embedding gradients get none of DGC's momentum: with the
        optimizer's own gone (as DGC requires), they train without any."""
        self._warn_once(
            "sparse", f"dgc applies momentum {self.momentum} to the dense gradients it "
            "compresses; embedding gradients (IndexedSlices) are gathered as they are and "
            "get none, and the optimizer may apply none of its own (dgc refuses it), so "
            "the embeddings train without momentum (an Embedding + Dense model on digits "
            "reached 0.41 against 0.87 uncompressed): for models with embeddings, use "
            "topk, whose adapted optimizer scales the rate of every variable, or "
            "CompressedAllReduce(sparse_as_dense=True), which hands dgc the tables' "
            "gradients densified")

    def _warn_once(self, key: str, message: str) -> None:
        """Warns `message` the first time `key` comes, while DGC applies momentum."""
        if self.momentum > 0 and key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def required_optimizer_changes(self, optimizer: Any) -> dict:
        """While DGC applies momentum, SGD's or RMSprop's own goes (`momentum`,
        `nesterov`): DGC's momentum correction is the momentum SGD would have
        applied. Adam's first moment cannot go this way (`check_optimizer` refuses
        it)."""
        name, momentum = optimizer_momentum(optimizer)
        if self.momentum == 0 or name != "momentum" or not momentum:
            return {}
        nesterov = optimizer_config(optimizer).get("nesterov")
        return {"momentum": 0.0, **({"nesterov": False} if nesterov else {})}

    def _optimizer_changes(self, optimizer: Any) -> tuple[float, dict]:
        """While DGC applies momentum, its `required_optimizer_changes` at the same
        learning rate. Adam's first moment stays (and `check_optimizer` refuses it):
        what a sparsifier would take from Adam DGC brings back itself. Measured with
        Adam at beta_1 0 and 3.16x its rate: the digits MLP ended 3.9 points below
        uncompressed training, noisy (the CNN 1.4 above). With `momentum=0` DGC is a
        sparsifier like top-k and adapts the optimizer as it does."""
        if self.momentum == 0:
            return super()._optimizer_changes(optimizer)
        return 1.0, self.required_optimizer_changes(optimizer)

    def send_interval(self) -> float:
        return _selection.magnitude_send_interval(self.ratio)

    def compress(self, x: tf.Tensor, ctx: Context):
        """Returns `((values, int32 indices), (n, dtype))`; updates `u` and `v`."""
        seg = _segments.Segments.of(ctx.layout_of(x))
        n, wd = seg.numel, _util.work_dtype(x.dtype)
        u, v = ctx.state["u"], ctx.state["v"]
        g = tf.cast(x, wd)
        if self.clip_norm is not None:
            g = tf.clip_by_norm(g, self.clip_norm / math.sqrt(ctx.num_replicas))
        m = self.momentum

        # The elementwise stages around the selection are one loop each, compiled under
        # `Context.jit_compile`, and update u and v in place (compiled, a variable's
        # update reuses its buffer: 25M entries, one core, the accumulation 26 -> 15 ms
        # and the masking 12 -> 2.5 ms against new tensors assigned afterwards).
        def accumulate(g):
            u.assign(m * u.read_value() + g)
            v.assign_add(u.read_value())
        ctx.stage(accumulate, g)
        v_new = v.read_value()
        values, idx, valid = self._select(v_new, seg, ctx, x.dtype)
        # Read before the masking below writes v, which would otherwise copy it first.
        if ctx.errors is not None:
            # One read of v serves both: its squared norm is not finite exactly when an
            # entry is not (or overflows, beyond 1e19 in float32: the state restarts).
            norm_sq = sum_of_squares(v_new)
            finite = tf.math.is_finite(norm_sq)
        else:
            norm_sq, finite = tf.zeros([], wd), _util.all_finite(v_new)

        def mask(sent, idx, valid):
            # Sent entries (valid slots; padding leaves its entry alone) are zeroed in u
            # (momentum factor masking); v keeps v_new less what was sent, which is what
            # the wire dtype rounded away.
            u_now = u.read_value()
            u.assign(tf.tensor_scatter_nd_update(
                u_now, idx[:, None], tf.where(valid, tf.zeros([], wd), tf.gather(u_now, idx))))
            v.assign(tf.tensor_scatter_nd_sub(v.read_value(), idx[:, None], sent))
        with tf.control_dependencies([norm_sq, finite]):
            ctx.stage(mask, tf.cast(values, wd), idx, valid)

        # A non-finite step resets both.
        when(~finite, lambda: (u.assign(tf.zeros_like(u)), v.assign(tf.zeros_like(v))))
        if ctx.errors is not None:
            ctx.record_error(v_new, None, norm_sq=norm_sq, error_sq=tf.where(
                finite, sum_of_squares(v.read_value()), math.nan))
        bad = tf.where(finite, tf.constant(0, x.dtype), tf.constant(math.nan, x.dtype))
        return (values + bad, idx), (n, x.dtype)

    def _select(self, v: tf.Tensor, seg: _segments.Segments, ctx: Context, dtype: tf.DType):
        """The largest entries of `v` per tensor at this mode's ratio: `(values in
        `dtype`, int32 indices, which slots hold a selected entry)`."""
        return _selection.sampled_largest(v, seg, self.ratios[ctx.mode], ctx.seed,
                                          self.sample_ratio, ctx.stage, dtype)

    def codec(self) -> Compressor:
        """DGC's selection without its momentum and accumulation: a reduced chunk's
        largest entries at this mode's ratio, DGC's payload and meta."""
        return _Selection(self)


class _Selection(_sparse.SparseDecoding, Compressor):
    """The memoryless codec of a `DGC` (see `DGC.codec`)."""

    summable = False
    unbiased = False

    def __init__(self, dgc: DGC):
        self.dgc = dgc

    def compress(self, x: tf.Tensor, ctx: Context):
        seg = _segments.Segments.of(ctx.layout_of(x))
        values, idx, _ = self.dgc._select(x, seg, ctx, x.dtype)  # pylint: disable=protected-access
        # A NaN's magnitude cuts no candidates, so the selection alone can drop it: a
        # non-finite chunk is sent as NaN, as DGC's own payload is.
        return (values + tf.cast(_util.poison(x), x.dtype), idx), (seg.numel, x.dtype)
