"""Runs a compressor's rounds over the replicas of one bucket: the one driver of the protocol.

The pipeline, the benchmarks and the tests all reduce through `run`; what differs is
the `exchange` they hand it (collectives and device-to-device transfers in the
pipeline, plain in-process sums in `local_exchange`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import tensorflow as tf

from tf_gradsync.compression import two_phase
from tf_gradsync.compression.base import (GATHER, SCATTER, SUM, Compressor, Context, Message,
                                          check_decoded, nbytes)

#: `exchange(messages) -> (received, bytes)`: one message per replica (same round), what
#: each replica receives (SUM: the summed payload; GATHER: every replica's payload, in
#: replica order; SCATTER: the parts addressed to it, in replica order), and the bytes
#: all replicas together sent (a Python int).
Exchange = Callable[[Sequence[Message]], tuple[list, int]]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reduction produced.

    Attributes:
      results: per replica, the reduced bucket (SUM or MEAN, as asked).
      bytes: bytes all replicas sent (int64 scalar tensor, or an int for one mode).
      error_sq: sum over replicas of ||x - C(x)||^2, x a replica's compressor input and
        C(x) what its payload decodes to (float64 scalar; 0 when not measured).
      norm_sq: sum over replicas of ||x||^2 (float64 scalar).
    """

    results: list[tf.Tensor]
    bytes: tf.Tensor | int
    error_sq: tf.Tensor
    norm_sq: tf.Tensor


@tf.autograph.experimental.do_not_convert
def run(compressor: Compressor, xs: Sequence[tf.Tensor], ctxs: Sequence[Context],
        exchange: Exchange, *, mean: bool = False, devices: Sequence[str] | None = None,
        measure_error: bool = False) -> Outcome:
    """Reduces one bucket: prescale, rounds with exchanges, SUM or MEAN.

    Args:
      compressor: any registered compressor.
      xs: per local replica, the flat bucket.
      ctxs: per local replica, its `Context` (`num_replicas` counts every replica of
        the reduction, across workers too).
      exchange: moves one round's messages (see `Exchange`).
      mean: return the mean instead of the sum.
      devices: per local replica, the device its compressor ops run on (None: current).
      measure_error: collect the compression error terms (`Outcome.error_sq`, `norm_sq`).

    Returns:
      An `Outcome`.

    Raises:
      ValueError: when replicas disagree on the protocol (rounds, transports, shapes).
    """
    devices = list(devices) if devices is not None else [None] * len(xs)
    n = ctxs[0].num_replicas
    prescale = n > 1 and compressor.prescales(xs[0].dtype)
    if prescale:
        xs = [_on(d, lambda x=x: x * tf.cast(1.0 / n, x.dtype)) for x, d in zip(xs, devices)]
    sent: dict[int, int] = {}

    def one_mode(mode: int):
        results, bytes_, errors = run_mode(compressor, xs, ctxs, exchange, devices, mode,
                                           measure_error)
        sent[mode] = bytes_
        return results, errors

    index = _on(devices[0], lambda: compressor.mode(two_phase.mode_context(ctxs[0])))
    if (index is None) != (compressor.num_modes == 1) or (
            isinstance(index, int) and not 0 <= index < compressor.num_modes):
        raise ValueError(f"{compressor!r} has num_modes={compressor.num_modes} and its mode() "
                         f"returned {index!r}: a compressor of several modes returns a scalar "
                         "int32 tensor in [0, num_modes), one of a single mode None")
    if index is None:
        (results, (err, norm)), total = one_mode(0), sent[0]
    else:
        index = tf.cast(index, tf.int32)
        results, (err, norm) = tf.switch_case(
            index, [lambda m=m: one_mode(m) for m in range(compressor.num_modes)])
        results = list(results)
        if len(sent) == compressor.num_modes:
            total = tf.gather(tf.constant([sent[m] for m in range(len(sent))], tf.int64), index)
        else:   # eagerly only the chosen mode was built
            (total,) = sent.values()
    out = [_on(d, lambda y=y: finish(y, mean, n, prescale))
           for y, d in zip(results, devices)]
    return Outcome(out, total, err, norm)


def run_mode(compressor: Compressor, xs: Sequence[tf.Tensor], ctxs: Sequence[Context],
             exchange: Exchange, devices: Sequence[str | None] | None = None, mode: int = 0,
             measure_error: bool = False):
    """Drives every replica's generator through the rounds of one static `mode` (`run`
    picks the mode at run time). Returns per-replica results, the bytes `exchange`
    reported, and the error terms `(error_sq, norm_sq)`."""
    devices = list(devices) if devices is not None else [None] * len(xs)
    ctxs = [dataclasses.replace(c, mode=mode, errors=[] if measure_error else None)
            for c in ctxs]
    gens, messages = [], []
    for x, c, d in zip(xs, ctxs, devices):
        gen = compressor.rounds(x, c)
        gens.append(gen)
        messages.append(_on(d, lambda g=gen: next(g)))
    total, results = 0, None
    while results is None:
        _check_round(compressor, messages)
        received, sent = exchange(messages)
        total += sent
        steps = [_on(d, lambda g=g, r=r: _send(g, r)) for g, r, d in zip(gens, received, devices)]
        done = [s for s in steps if not isinstance(s, Message)]
        if done and len(done) != len(steps):
            raise ValueError(f"{compressor!r}: replicas ran different numbers of rounds")
        if done:
            results = [s.value for s in done]
            for y, x in zip(results, xs):
                check_decoded(compressor, y, x)
        else:
            messages = steps
    errors = [e for c in ctxs for e in (c.errors or [])]
    if errors:
        err = tf.add_n([tf.cast(e, tf.float64) for e, _ in errors])
        norm = tf.add_n([tf.cast(v, tf.float64) for _, v in errors])
    else:
        err = norm = tf.constant(0.0, tf.float64)
    return results, total, (err, norm)


class _Done:
    def __init__(self, value):
        self.value = value


def _send(gen, received):
    try:
        return gen.send(received)
    except StopIteration as stop:
        return _Done(stop.value)


def _check_round(compressor: Compressor, messages: Sequence[Message]) -> None:
    first = messages[0]
    for m in messages:
        if not isinstance(m, Message):
            got = (f"a {type(m).__name__} of {[getattr(t, 'shape', t) for t in m]}"
                   if isinstance(m, (tuple, list)) else type(m).__name__)
            raise ValueError(f"{compressor!r}: a round must yield a Message(payload, "
                             f"transport), got {got}")
        # Payloads of a two-phase gather differ between replicas as their `like` says.
        same = (m.like == first.like if m.like is not None else
                [_specs(p) for p in m.parts()] == [_specs(p) for p in first.parts()])
        if m.transport != first.transport or not same:
            raise ValueError(f"{compressor!r}: replicas sent different payloads in one round: "
                             f"{first} vs {m}")
    for part in first.parts():
        try:
            nbytes(part)
        except ValueError as e:    # the compressor named: sizes come from static shapes
            raise ValueError(f"{compressor!r}: {e} in its payload "
                             f"{[t.shape for t in part]}") from None


def _specs(payload) -> list:
    return [(t.shape, t.dtype) for t in payload]


def _on(device, fn):
    if device is None:
        return fn()
    with tf.device(device):
        return fn()


def finish(y: tf.Tensor, mean: bool, n: int, prescaled: bool) -> tf.Tensor:
    """Turns an exchanged sum (of inputs divided by n when `prescaled`) into SUM or MEAN."""
    if n == 1:
        return y
    if prescaled and not mean:
        return y * tf.cast(n, y.dtype)
    if not prescaled and mean:
        # As TensorFlow's reductions: integers divide into floats (int32/int64 into
        # float64), so the mean of 1 and 2 is 1.5.
        return tf.math.truediv(y, n) if y.dtype.is_integer else y / tf.cast(n, y.dtype)
    return y


def local_exchange(messages: Sequence[Message]) -> tuple[list, int]:
    """An exchange among replicas of one process without devices: sums and lists.

    Bytes are those of a ring: 2(N-1)/N of a summed payload and N-1 copies of a
    gathered one, per replica; a scattered payload sends each part but its own once.
    """
    n = len(messages)
    transport = messages[0].transport
    if transport == SUM:
        size = nbytes(messages[0].payload)
        total = [tf.add_n(list(ts)) if n > 1 else ts[0]
                 for ts in zip(*(m.payload for m in messages))]
        return [tuple(total)] * n, 2 * (n - 1) * size
    if transport == SCATTER:
        sent = sum(nbytes(p) for r, m in enumerate(messages)
                   for j, p in enumerate(m.payload) if j != r)
        return [[m.payload[j] for m in messages] for j in range(n)], sent
    assert transport == GATHER
    parts = [m.payload for m in messages]
    return [parts] * n, (n - 1) * sum(nbytes(p) for p in parts)
