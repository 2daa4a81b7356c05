"""PowerSGD: rank-r compression by one step of power iteration, with error feedback.

References: Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from tf_gradsync.compression import _util
from tf_gradsync.compression.base import Context, RoundCompressor, StateSpec, register

_Q_SEED = (0x5067, 0x5347)   # fixed: the initial Q is the same on every replica


def _initial_q(shape, dtype, seed=_Q_SEED) -> tf.Tensor:
    return tf.random.stateless_normal(shape, tf.cast(seed, tf.int64), dtype=dtype)


@register("powersgd")
class PowerSGD(RoundCompressor):
    """Sends P = M Q, then Q_i = M^T orth(sum P); M is the bucket as a [rows, cols] matrix.

    M is this replica's bucket (divided by the replica count: `prescale`) plus its
    residual e, zero-padded to cols = ceil(sqrt(n)), rows = ceil(n / cols). Round 1
    sends P = M Q [rows, r]; round 2 sends Q_i = M^T P_hat [cols, r], P_hat =
    orth(sum P) by QR. The result P_hat (sum Q_i)^T is the sum of the replicas' local
    approximations P_hat Q_i^T, i.e. of the mean gradient. The residual is the local
    error e = M - P_hat Q_i^T (the paper's Algorithm 2), not M - result / N, which
    would pile up the differences between replicas' gradients without bound. With
    `warm_start` the summed Q is reused (redrawn if all zero or non-finite).

    Payload: two summed rounds in float32 (float64 for float64 input), (rows + cols)
    * r * 4 bytes. A bucket with n < min_compression_rate * (rows + cols) * r is sent
    as it is in one round and keeps no state. `start_iter`: payload shapes cannot
    depend on the step (a tensor), so the bucket is never sent dense; before step
    `start_iter` the rank-r result is used *without* error feedback (residual held
    at zero; Q still warms up). Non-finite input gives NaN results, a zero residual
    and a redrawn Q.

    Args:
      rank: r, an integer >= 1 (capped at min(rows, cols)).
      start_iter: first step with error feedback, an integer >= 0.
      min_compression_rate: least dense/compressed size ratio to compress, >= 1.
      warm_start: reuse the previous step's Q.

    Raises:
      ValueError: for an argument outside its range.

    Example:
      >>> c = tf_gradsync.compression.get("powersgd", rank=2)
    """

    unbiased = False
    prescale = True
    has_own_memory = True

    def __init__(self, rank: int = 4, start_iter: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True):
        _util.check_number("rank", rank, 1, integer=True)
        _util.check_number("start_iter", start_iter, 0, integer=True)
        _util.check_number("min_compression_rate", min_compression_rate, 1)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be a bool (True or False), got {warm_start!r}")
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate, self.warm_start = min_compression_rate, warm_start

    def matrix_shape(self, n: int) -> tuple[int, int, int] | None:
        """(rows, cols, rank) for an n-element bucket, or None to send it dense."""
        cols = max(1, math.ceil(math.sqrt(n)))
        rows = max(1, math.ceil(n / cols))      # rows <= cols
        r = min(self.rank, rows)
        return (rows, cols, r) if n >= self.min_compression_rate * (rows + cols) * r else None

    def state_spec(self, numel: int, dtype: tf.DType) -> dict[str, StateSpec]:
        """`residual` [numel] and, with warm start, `q` [cols, rank]; none if dense."""
        shape, wd = self.matrix_shape(numel), _util.work_dtype(dtype)
        if shape is None:
            return {}
        spec = {"residual": StateSpec((numel,), wd)}
        if self.warm_start:
            spec["q"] = StateSpec((shape[1], shape[2]), wd, _initial_q)
        return spec

    def first_round(self, x: tf.Tensor, ctx: Context):
        """Returns `((P,), carry)`, or `((x,), carry)` for a dense bucket."""
        n = _util.numel(x)
        shape = self.matrix_shape(n)
        if shape is None:
            return (x,), {"dense": True}
        rows, cols, _ = shape
        m_flat = tf.cast(x, _util.work_dtype(x.dtype)) + ctx.state["residual"]
        m = tf.reshape(tf.pad(m_flat, [[0, rows * cols - n]]), [rows, cols])
        q = ctx.state["q"] if self.warm_start else _initial_q(shape[1:], m.dtype, ctx.seed)
        carry = {"dense": False, "n": n, "dtype": x.dtype, "shape": shape, "m": m, "m_flat": m_flat}
        return (tf.matmul(m, q),), carry

    def next_round(self, reduced: Sequence[tf.Tensor], carry, ctx: Context):
        """Round 2: orthonormalise the summed P and send M^T P_hat; then None."""
        if carry["dense"] or "p_hat" in carry:
            return None, carry
        p_hat = tf.linalg.qr(reduced[0]).q
        q_local = tf.matmul(carry["m"], p_hat, transpose_a=True)
        return (q_local,), {**carry, "p_hat": p_hat, "q_local": q_local}

    def finish(self, reduced: Sequence[tf.Tensor], carry, ctx: Context) -> tf.Tensor:
        """The reconstruction P_hat (sum Q)^T; updates the residual and Q."""
        if carry["dense"]:
            return reduced[0]
        n, p_hat, q_sum = carry["n"], carry["p_hat"], reduced[0]
        recon = tf.reshape(tf.matmul(p_hat, q_sum, transpose_b=True), [-1])[:n]
        local = tf.reshape(tf.matmul(p_hat, carry["q_local"], transpose_b=True), [-1])[:n]
        error = carry["m_flat"] - local
        keep = tf.reduce_all(tf.math.is_finite(error))
        keep &= tf.cast(ctx.step, tf.int64) >= self.start_iter
        ctx.state["residual"].assign(tf.where(keep, error, 0))
        if self.warm_start:
            ok = tf.reduce_all(tf.math.is_finite(q_sum)) & tf.reduce_any(q_sum != 0)
            fresh = _initial_q(q_sum.shape, q_sum.dtype, ctx.seed)
            ctx.state["q"].assign(tf.where(ok, q_sum, fresh))
        return tf.cast(recon, carry["dtype"])
