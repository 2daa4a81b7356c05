"""Runs compressors the way the pipeline does, without devices: through the protocol
driver with an in-process exchange. Shared by the conformance and property tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tf_gradsync import compression as C
from tf_gradsync.compression import driver


def make_state(c: C.Compressor, layout: C.Layout) -> dict[str, tf.Variable]:
    return {k: tf.Variable(s.initializer(s.shape, s.dtype), trainable=False)
            for k, s in c.state_spec(layout).items()}


def layout_of(x: tf.Tensor, shapes=None) -> C.Layout:
    n = int(x.shape[0])
    return C.Layout.flat(n, x.dtype) if shapes is None else C.Layout(tuple(shapes), x.dtype)


def context(state=None, seed=(1, 2), step=0, num_replicas=1, replica=0, layout=None,
            mode=0) -> C.Context:
    return C.Context(state=state or {}, step=tf.convert_to_tensor(step, tf.int64),
                     seed=tf.convert_to_tensor(seed, tf.int64), num_replicas=num_replicas,
                     replica=replica, layout=layout, mode=mode)


@dataclasses.dataclass
class Reduction:
    results: list[tf.Tensor]     # per replica
    payloads: list[tuple]        # per round: replica 0's message payload
    transports: list[str]        # per round
    error_sq: tf.Tensor
    norm_sq: tf.Tensor

    @property
    def error(self) -> float:
        """||x - C(x)|| / ||x|| over the replicas, as the driver measured it."""
        norm = float(self.norm_sq)
        return float(np.sqrt(float(self.error_sq) / norm)) if norm > 0 else 0.0


def reduce(c: C.Compressor, xs, states=None, *, shapes=None, step=0, seed=(1, 2),
           mean=False) -> Reduction:
    """One synchronisation of `xs` (one flat bucket per replica) through the driver."""
    layout = layout_of(xs[0], shapes)
    states = states if states is not None else [make_state(c, layout) for _ in xs]
    ctxs = [context(s, seed, step, len(xs), r, layout) for r, s in enumerate(states)]
    payloads, transports = [], []

    def exchange(messages):
        payloads.append(tuple(messages[0].payload))
        transports.append(messages[0].transport)
        return driver.local_exchange(messages)

    out = driver.run(c, list(xs), ctxs, exchange, mean=mean, measure_error=True)
    return Reduction(out.results, payloads, transports, out.error_sq, out.norm_sq)


def roundtrip(c: C.Compressor, x: tf.Tensor, state=None, **kw) -> tf.Tensor:
    """What one replica's bucket becomes (a one-replica reduction)."""
    states = None if state is None else [state]
    return reduce(c, [x], states, **kw).results[0]
