"""Ring all-reduce (reduce-scatter + all-gather) and ring all-gather.

Each device sends only to its right neighbour. For an all-reduce the payload is cut in
N chunks; in N-1 reduce-scatter steps every chunk travels once around the ring and is
summed on the way, then N-1 all-gather steps spread the reduced chunks. Each device
sends 2(N-1)/N of the payload, which is bandwidth-optimal. Chunks stay in the payload
dtype on every hop, so compressed bytes are what travels.

References:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tf_gradsync.algorithms._common import (DevicePayloads, InProcess, Wire, accumulate,
                                             check_static, even_sizes)


class Ring(InProcess):
    """Ring all-reduce and ring all-gather among the devices of one process."""

    name = "ring"

    def _sum(self, payloads, group, wire):
        return all_reduce(payloads, group.devices, wire)

    def _gather(self, payloads, group, wire, like):
        return all_gather(payloads, group.devices, wire)


def all_reduce(payloads: DevicePayloads, devices: Sequence[str], wire: Wire,
               between: Callable[[list[tf.Tensor]], list[tf.Tensor]] | None = None,
               ) -> list[list[tf.Tensor]]:
    """Sums each payload tensor over devices; every device gets the sum.

    Args:
      payloads: per device, the payload tensors (same shapes and dtypes everywhere).
      devices: the device of each entry of `payloads`.
      wire: records what crosses a device boundary.
      between: called once the reduce-scatter is done, per payload tensor, with each
        device's fully reduced chunk (device i holds chunk i+1); what it returns is
        all-gathered instead. The hierarchical exchange sums the chunks across workers
        there.

    Returns:
      Per device, the summed payload tensors, placed on that device.
    """
    n = len(devices)
    out: list[list[tf.Tensor]] = [[] for _ in devices]
    for k in range(len(payloads[0])):
        shape = payloads[0][k].shape
        sizes = even_sizes(check_static(payloads[0][k]), n)
        chunks = []
        for i, d in enumerate(devices):
            with tf.device(d):
                chunks.append(tf.split(tf.reshape(payloads[i][k], [-1]), sizes))
        for step in range(n - 1):          # reduce-scatter
            for i in range(n):
                c, dst = (i - step) % n, (i + 1) % n
                chunks[dst][c] = _add_on(devices[dst], wire.send(chunks[i][c], devices[dst]),
                                         chunks[dst][c])
        if between is not None:
            owned = between([chunks[i][(i + 1) % n] for i in range(n)])
            for i in range(n):
                chunks[i][(i + 1) % n] = owned[i]
        for step in range(n - 1):          # all-gather: device i owns chunk i+1
            for i in range(n):
                c, dst = (i + 1 - step) % n, (i + 1) % n
                chunks[dst][c] = wire.send(chunks[i][c], devices[dst])
        for i, d in enumerate(devices):
            with tf.device(d):
                out[i].append(tf.reshape(tf.concat(chunks[i], 0), shape))
    return out


def all_gather(payloads: DevicePayloads, devices: Sequence[str], wire: Wire) -> list[list[list[tf.Tensor]]]:
    """Every device receives every device's payload, forwarded around the ring.

    Returns:
      Per device, the list of all N payloads (in device order), placed on that device.
    """
    n = len(devices)
    held = [[None] * n for _ in devices]
    for i in range(n):
        held[i][i] = list(payloads[i])
    for step in range(n - 1):
        for i in range(n):
            src, dst = (i - step) % n, (i + 1) % n
            held[dst][src] = [wire.send(t, devices[dst]) for t in held[i][src]]
    return held


def _add_on(device: str, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    with tf.device(device):
        return accumulate(a, b)
