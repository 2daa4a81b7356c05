"""Runs compressors the way the pipeline does, without devices: through the protocol
driver with an in-process exchange. Shared by the conformance and property tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tf_gradsync import compression as C
from tf_gradsync.compression import driver, two_phase


def make_state(c: C.Compressor, layout: C.Layout,
               chunks: two_phase.Chunks | None = None) -> dict[str, tf.Variable]:
    spec = c.state_spec(layout) if chunks is None else two_phase.state_spec(c, layout, chunks)
    return {k: tf.Variable(s.initializer(s.shape, s.dtype), trainable=False)
            for k, s in spec.items()}


def layout_of(x: tf.Tensor, shapes=None) -> C.Layout:
    n = int(x.shape[0])
    return C.Layout.flat(n, x.dtype) if shapes is None else C.Layout(tuple(shapes), x.dtype)


def context(state=None, seed=(1, 2), step=0, num_replicas=1, replica=0, layout=None,
            mode=0, chunks=None, jit_compile=False) -> C.Context:
    return C.Context(state=state or {}, step=tf.convert_to_tensor(step, tf.int64),
                     seed=tf.convert_to_tensor(seed, tf.int64), num_replicas=num_replicas,
                     replica=replica, layout=layout, mode=mode, chunks=chunks,
                     jit_compile=jit_compile)


@dataclasses.dataclass
class Reduction:
    results: list[tf.Tensor]     # per replica
    payloads: list[tuple]        # per round: replica 0's message payload
    transports: list[str]        # per round
    sent: int                    # bytes all replicas sent
    error_sq: tf.Tensor
    norm_sq: tf.Tensor

    @property
    def error(self) -> float:
        """||x - C(x)|| / ||x|| over the replicas, as the driver measured it."""
        norm = float(self.norm_sq)
        return float(np.sqrt(float(self.error_sq) / norm)) if norm > 0 else 0.0


def reduce(c: C.Compressor, xs, states=None, *, shapes=None, step=0, seed=(1, 2),
           mean=False, two_phases=False, jit_compile=False, measure_error=True) -> Reduction:
    """One synchronisation of `xs` (one flat bucket per replica) through the driver;
    with `two_phases`, its payloads travel in two phases (states from `make_state`
    with each replica's chunks); with `jit_compile`, decodings compile with XLA;
    without `measure_error`, no error terms are computed (`error_sq` and `norm_sq`
    then zero)."""
    layout = layout_of(xs[0], shapes)
    chunks = [two_phase.split(layout, len(xs), r) if two_phases else None
              for r in range(len(xs))]
    states = states if states is not None else [make_state(c, layout, ch) for ch in chunks]
    ctxs = [context(s, seed, step, len(xs), r, layout, chunks=ch, jit_compile=jit_compile)
            for r, (s, ch) in enumerate(zip(states, chunks))]
    payloads, transports = [], []

    def exchange(messages):
        payloads.append(tuple(messages[0].payload))
        transports.append(messages[0].transport)
        return driver.local_exchange(messages)

    out = driver.run(c, list(xs), ctxs, exchange, mean=mean, measure_error=measure_error)
    return Reduction(out.results, payloads, transports, int(out.bytes), out.error_sq,
                     out.norm_sq)


def roundtrip(c: C.Compressor, x: tf.Tensor, state=None, **kw) -> tf.Tensor:
    """What one replica's bucket becomes (a one-replica reduction)."""
    states = None if state is None else [state]
    return reduce(c, [x], states, **kw).results[0]
