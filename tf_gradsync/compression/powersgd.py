"""PowerSGD: rank-r compression of each weight matrix by one step of power iteration.

References: Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019. The per-tensor layout (all P's in one
payload, all Q's in another, small tensors sent as they are in the first round) and
the dense warm-up follow PyTorch's `powerSGD_hook`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_gradsync.compression import _util, xla
from tf_gradsync.compression.base import (SUM, Compressor, Context, Layout, Message, Rounds,
                                          StateSpec, register, sum_of_squares, when)
from tf_gradsync.compression.warmup import dense_round

_Q_SEED = (0x5067, 0x5347)   # fixed: the initial Q is the same on every replica


def _initial_q(shape, dtype, seed=_Q_SEED) -> tf.Tensor:
    return tf.random.stateless_normal(shape, tf.cast(seed, tf.int64), dtype=dtype, alg="philox")


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """One tensor compressed as a [rows, cols] matrix of rank r."""
    offset: int     # in the bucket
    rows: int
    cols: int
    rank: int
    p_offset: int   # in the P payload (and the `p` state)
    q_offset: int   # in the Q payload (and the `q`, `q_local` states)

    @property
    def size(self) -> int:
        return self.rows * self.cols


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a bucket's tensors travel: low-rank matrices, and tensors sent as they are."""
    matrices: tuple[_Matrix, ...]
    dense: tuple[tuple[int, int], ...]     # (offset, size) in the bucket
    p_size: int
    q_size: int


@register("powersgd")
class PowerSGD(Compressor):
    """Sends P = M Q, then Q_i = M^T orth(sum P), per weight matrix M of the bucket.

    Each tensor of rank >= 2 is a matrix [prod(shape[:-1]), shape[-1]] (a Dense kernel
    [in, out], a convolution kernel [kh, kw, in, out] as [kh * kw * in, out]) with rank
    r = min(rank, rows, cols). M is this replica's tensor plus its residual e. Round 1
    sends the P = M Q [rows, r] of every matrix in one payload, together with the
    tensors not worth compressing (vectors, and matrices where rows * cols <
    min_compression_rate * (rows + cols) * r), summed exactly; round 2 sends every
    Q_i = M^T P_hat [cols, r], P_hat = orth(sum P) by QR, in one payload. The result
    P_hat (sum Q_i)^T is the sum of the replicas' local approximations P_hat Q_i^T. The
    residual is the local error e = M - P_hat Q_i^T (the paper's Algorithm 2), kept as
    M, P_hat and Q_i and formed in the next step's pass that adds it to the gradient:
    no pass writes it out (`residual` forms it for inspection). With `warm_start` the
    summed Q is reused (redrawn if all zero or non-finite).

    Before step `start_iter` the whole bucket is all-reduced uncompressed (one round,
    no residual; PyTorch's `start_powerSGD_iter`): the first steps, where gradients
    change fastest, are exact, and error feedback starts from a trained-in state.

    Payload: round 1 sum(rows * r) + the dense tensors' elements, round 2
    sum(cols * r), in float32 (float64 for float64 input; 16-bit input keeps its dtype
    for the dense part). Summed. Non-finite input gives NaN results, a zero residual
    and a redrawn Q.

    Args:
      rank: r, an integer >= 1 (capped per matrix at min(rows, cols)).
      start_iter: steps of uncompressed warm-up, an integer >= 0.
      min_compression_rate: least dense/compressed size ratio to compress a matrix, >= 1.
      warm_start: reuse the previous step's Q.
      error_feedback: keep the residual (the paper's method; False: the error is
        dropped, as PyTorch's `use_error_feedback=False`).

    Raises:
      ValueError: for an argument outside its range.

    Example:
      >>> c = tf_gradsync.compression.get("powersgd", rank=2)
    """

    accuracy = "balanced"

    summable = True     # its factors P and Q are summed
    unbiased = False
    # Not prescaled: P_hat is orthonormalised, so the result is linear in the replicas'
    # M; a SUM then needs no pass over the bucket to divide by the replica count and
    # none to multiply back (a MEAN takes one, as a prescale would).
    has_own_memory = True

    def __init__(self, rank: int = 4, start_iter: int = 100, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback: bool = True):
        _util.check_number("rank", rank, 1, integer=True)
        _util.check_number("start_iter", start_iter, 0, integer=True)
        _util.check_number("min_compression_rate", min_compression_rate, 1)
        for name, value in (("warm_start", warm_start), ("error_feedback", error_feedback)):
            _util.check_flag(name, value)
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate, self.warm_start = min_compression_rate, warm_start
        self.error_feedback = error_feedback
        # Mode 0: dense warm-up, mode 1: low rank (only mode 1 without a warm-up).
        self.num_modes = 2 if start_iter else 1
        self._plans: dict[Layout, _Plan] = {}

    def plan(self, layout: Layout) -> _Plan:
        """Which tensors of `layout` are compressed, and where they sit in the payloads."""
        if layout not in self._plans:
            self._plans[layout] = self._make_plan(layout)
        return self._plans[layout]

    def _make_plan(self, layout: Layout) -> _Plan:
        matrices, dense, p, q = [], [], 0, 0
        for shape, size, offset in zip(layout.shapes, layout.sizes, layout.offsets):
            if size == 0:
                continue
            if len(shape) >= 2:
                cols = shape[-1]
                rows = size // cols
                r = min(self.rank, rows, cols)
                if size >= self.min_compression_rate * (rows + cols) * r:
                    matrices.append(_Matrix(offset, rows, cols, r, p, q))
                    p, q = p + rows * r, q + cols * r
                    continue
            dense.append((offset, size))
        return _Plan(tuple(matrices), tuple(dense), p, q)

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        """With error feedback, the residual as its factors: `m0`, `m1`, ... (each
        matrix's last M, [rows, cols]: XLA's loops over a matrix run at twice the speed
        of one over a flat bucket), `p` [sum(rows * r)] (the P_hat) and `q_local`
        [sum(cols * r)] (this replica's Q_i); `residual` forms e from them. With warm
        start, `q` [sum(cols * r)]. Empty if nothing is compressed."""
        plan, wd = self.plan(layout), _util.work_dtype(layout.dtype)
        if not plan.matrices:
            return {}
        spec = {}
        if self.error_feedback:
            spec = {f"m{i}": StateSpec((a.rows, a.cols), wd)
                    for i, a in enumerate(plan.matrices)}
            spec.update(p=StateSpec((plan.p_size,), wd), q_local=StateSpec((plan.q_size,), wd))
        if self.warm_start:
            spec["q"] = StateSpec((plan.q_size,), wd, _initial_q)
        return spec

    def residual(self, state: dict, layout: Layout) -> tf.Tensor:
        """The error-feedback residual e = M - P_hat Q_i^T that `state` holds as factors,
        as a flat bucket laid out as `layout` (zero at tensors sent as they are).

        Args:
          state: this compressor's state for a bucket of `layout` (`state_spec`).
          layout: the bucket's layout.

        Returns:
          A [numel] tensor in the work dtype (float32, or float64 for float64 buckets).
        """
        plan = self.plan(layout)
        pieces = [(a.offset, _matrix_residual(a, state[f"m{i}"], state["p"], state["q_local"]))
                  for i, a in enumerate(plan.matrices)]
        wd = _util.work_dtype(layout.dtype)
        pieces += [(o, tf.zeros([s], wd)) for o, s in plan.dense]
        return _assemble(pieces)

    def mode(self, ctx: Context) -> tf.Tensor | None:
        """1 (low rank) from step `start_iter` on, 0 (dense) before; None without warm-up."""
        if self.num_modes == 1:
            return None
        return tf.cast(tf.cast(ctx.step, tf.int64) >= self.start_iter, tf.int32)

    def rounds(self, x: tf.Tensor, ctx: Context) -> Rounds:
        layout = ctx.layout_of(x)
        plan = self.plan(layout)
        if not plan.matrices or (self.num_modes == 2 and ctx.mode == 0):
            return (yield from dense_round(x, ctx))
        return (yield from self._low_rank(x, ctx, layout, plan))

    def _low_rank(self, x: tf.Tensor, ctx: Context, layout: Layout, plan: _Plan) -> Rounds:
        wd = _util.work_dtype(x.dtype)
        state = ctx.state

        def gradient(x, a: _Matrix) -> tf.Tensor:   # matrix `a` of the bucket x
            return tf.reshape(tf.cast(x[a.offset:a.offset + a.size], wd), [a.rows, a.cols])
        if self.warm_start:
            q_all = state["q"]
        else:
            q_all = _initial_q([plan.q_size], wd, tf.convert_to_tensor(ctx.seed, tf.int64))

        def products(ms):
            # P = M Q, compiled with the stage that forms M: XLA's product of a matrix
            # and a few columns took 0.47-0.99 of oneDNN's time on real layers' shapes
            # (one core, 5000 x 5000 at rank 4: 15.4 -> 8.8 ms).
            return [tf.reshape(tf.matmul(m, _factor(q_all, a.q_offset, a.cols, a.rank)), [-1])
                    for a, m in zip(plan.matrices, ms)]
        if self.error_feedback:
            # M = x + e, e = M' - P_hat' Q_i'^T from the last step's factors: formed in
            # the pass that adds it, which writes M over M' in place (compiled under
            # `Context.jit_compile`). No pass writes e out, and the tail reads M once,
            # for its norm: 28.2 -> 15.2 bytes touched per byte; 25M entries, rank 4,
            # one core, a round trip 1.14-1.31 -> 1.47-1.60 GB/s.
            kept = [state[f"m{i}"] for i in range(len(plan.matrices))]

            def fold(x):
                p, q = state["p"].read_value(), state["q_local"].read_value()
                for a, m in zip(plan.matrices, kept):
                    m.assign(gradient(x, a) + _matrix_residual(a, m.read_value(), p, q))
                return products([m.read_value() for m in kept])
            ps = ctx.stage(fold, x)
            ms = [m.read_value() for m in kept]
        else:
            ms = [gradient(x, a) for a in plan.matrices]
            ps = ctx.stage(products, ms)
        payload = (_concat(ps),)
        if plan.dense:
            payload += (_concat([x[o:o + s] for o, s in plan.dense]),)
        received = yield Message(payload, SUM)
        p_sum = received[0]
        p_hats = [tf.linalg.qr(_factor(p_sum, a.p_offset, a.rows, a.rank)).q
                  for a in plan.matrices]
        # M^T P as (P^T M)^T: oneDNN's product reading M along its rows is 1.1-2x
        # faster than the one reading it transposed, on the shapes of real layers.
        q_locals = [tf.transpose(tf.matmul(p, m, transpose_a=True)) for m, p in zip(ms, p_hats)]
        (q_sum,) = yield Message((_concat([tf.reshape(q, [-1]) for q in q_locals]),), SUM)

        def decoded(p_hats, q_sum, dense):
            # Compiled: XLA's product P_hat Q^T writing the bucket took 0.55-0.93 of
            # oneDNN's time on real layers' shapes (5000 x 5000 at rank 4: 11.1 -> 9.4
            # ms; at rank 1 31 -> 20).
            recon = [tf.matmul(p, _factor(q_sum, a.q_offset, a.cols, a.rank), transpose_b=True)
                     for a, p in zip(plan.matrices, p_hats)]
            dense = (tf.split(dense[0], [s for _, s in plan.dense]) if len(plan.dense) > 1
                     else list(dense))
            pieces = [(a.offset, r) for a, r in zip(plan.matrices, recon)]
            pieces += [(o, tf.cast(d, wd)) for (o, _), d in zip(plan.dense, dense)]
            return tf.cast(_assemble(pieces), x.dtype)
        if ctx.errors is not None:
            error_sq, norm_sq = _error_terms(ms, q_locals, x, plan)
            ctx.record_error(x, None, error_sq=error_sq, norm_sq=norm_sq)
            # Not finite exactly when M, P_hat or Q_i is not (the error), or a tensor
            # sent as it is is not (the norm).
            finite = tf.math.is_finite(error_sq + norm_sq)
        elif self.error_feedback:
            finite = _finite_without_norms(q_locals, x, plan)
        if self.error_feedback:
            # The new residual's factors; all zero after a non-finite step.
            for name, parts in (("p", p_hats), ("q_local", q_locals)):
                flat = _concat([tf.reshape(t, [-1]) for t in parts])
                state[name].assign(tf.where(finite, flat, tf.zeros_like(flat)))
            when(~finite, lambda: [m.assign(tf.zeros_like(m)) for m in kept])
        if self.warm_start:
            ok = tf.reduce_all(tf.math.is_finite(q_sum)) & tf.reduce_any(q_sum != 0)
            seed = tf.convert_to_tensor(ctx.seed, tf.int64)
            state["q"].assign(tf.cond(
                ok, lambda: q_sum, lambda: _initial_q(q_sum.shape, q_sum.dtype, seed)))
        return ctx.stage(decoded, p_hats, q_sum, tuple(received[1:]))

    def compression_stats(self, layout: Layout) -> dict[str, int]:
        """Elements sent per round for a bucket laid out as `layout` (low-rank mode).

        Returns:
          `matrices` (compressed tensors), `dense_tensors` (sent as they are),
          `p_elements`, `q_elements`, `dense_elements` and `uncompressed_elements`.
        """
        plan = self.plan(layout)
        return {"matrices": len(plan.matrices), "dense_tensors": len(plan.dense),
                "p_elements": plan.p_size, "q_elements": plan.q_size,
                "dense_elements": sum(s for _, s in plan.dense),
                "uncompressed_elements": layout.numel}


def _error_terms(ms, q_locals, x, plan: _Plan) -> tuple[tf.Tensor, tf.Tensor]:
    """||M - P_hat Q_i^T||^2 and ||M||^2 over the bucket, with no pass over the residual.

    P_hat's columns are orthonormal, so this replica's approximation P_hat Q_i^T =
    P_hat P_hat^T M is M's projection onto them, and ||M - it||^2 = ||M||^2 - ||Q_i||^2
    (rounding can take that below zero by float32's precision of ||M||^2, hence the
    absolute value; a NaN or Inf in M, P_hat or Q_i stays non-finite, as the residual's
    reset needs). A tensor sent as it is adds its norm and no error.
    """
    norms = [sum_of_squares(m) for m in ms]
    errors = [tf.abs(n - sum_of_squares(q)) for n, q in zip(norms, q_locals)]
    wd = norms[0].dtype
    norms += [sum_of_squares(tf.cast(x[o:o + s], wd)) for o, s in plan.dense]
    return tf.add_n(errors), tf.add_n(norms)


def _finite_without_norms(q_locals, x, plan: _Plan) -> tf.Tensor:
    """Whether M, P_hat, Q_i and the tensors sent as they are are all finite, read from
    Q_i and those tensors alone: Q_i = M^T P_hat is not finite wherever M or P_hat is
    not (a NaN meets every column of P_hat in the product, an Inf too, and Inf times 0
    is NaN). Without the error measured, this spares the pass over M that its norm
    takes (25M entries, one core: 9-12 ms of PowerSGD's 59-73)."""
    parts = [*q_locals, *(x[o:o + s] for o, s in plan.dense)]
    return tf.reduce_all(tf.stack([_util.all_finite(t) for t in parts]))


def _factor(flat: tf.Tensor, offset: int, rows: int, rank: int) -> tf.Tensor:
    """A [rows, rank] factor (P or Q) of one matrix from its place in a flat payload."""
    return tf.reshape(flat[offset:offset + rows * rank], [rows, rank])


def _matrix_residual(a: _Matrix, m: tf.Tensor, p: tf.Tensor, q: tf.Tensor) -> tf.Tensor:
    """Matrix `a`'s residual M - P_hat Q_i^T [rows, cols], from its M and the flat P_hat
    and Q_i."""
    p_a, q_a = _factor(p, a.p_offset, a.rows, a.rank), _factor(q, a.q_offset, a.cols, a.rank)
    if xla.tracing() and a.rank <= _OUTER_RANK:
        # A sum of r outer products, elementwise: XLA fuses it into the loop that reads
        # M (25M entries, one core: rank 4 18 ms, rank 8 26 against 22 as a product).
        approx = tf.add_n([p_a[:, j:j + 1] * q_a[None, :, j] for j in range(a.rank)])
    else:
        approx = tf.matmul(p_a, q_a, transpose_b=True)
    return m - approx


#: Largest rank whose residual XLA forms as a sum of outer products (`_matrix_residual`).
_OUTER_RANK = 4


def _concat(parts: Sequence[tf.Tensor]) -> tf.Tensor:
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _assemble(pieces) -> tf.Tensor:
    """The flat bucket from `(offset, tensor)` pieces that tile it."""
    order = np.argsort([o for o, _ in pieces], kind="stable")
    return _concat([tf.reshape(pieces[i][1], [-1]) for i in order])
