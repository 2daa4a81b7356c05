"""Hierarchical all-reduce for several devices per worker: within a worker, copies; between
workers, collectives over shards.

Each worker's devices reduce-scatter the payload in a ring (device i then holds the
worker's sum of shard i+1); device i all-reduces that shard with device i of every
other worker, in one collective group per device index, so each worker's devices
share the traffic between workers; a ring all-gather inside each worker spreads the
result. Each worker sends 2(N-1)/N of the payload to the others, N workers, as a
flat ring over workers would, while its devices' traffic stays local.

Payloads that cannot be summed are all-gathered over every member (`Collective`).

References:
  Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
  TensorFlow", 2018 (hierarchical all-reduce); Jia et al., "Highly Scalable Deep
  Learning Training System with Mixed-Precision", 2018 (2D all-reduce).
"""

from __future__ import annotations

import tensorflow as tf

from tf_gradsync.algorithms import collective, ring
from tf_gradsync.algorithms._common import Group, Wire


class Hierarchical(collective.Collective):
    """Reduce-scatter within each worker, all-reduce of shards between workers, all-gather
    within each worker; gathers as `Collective`."""

    name = "hierarchical"

    def _sum(self, payloads, group: Group, wire: Wire):
        n = len(group.devices)

        def across_workers(shards: list[tf.Tensor]) -> list[tf.Tensor]:
            out = []
            for i, (shard, device) in enumerate(zip(shards, group.devices)):
                if shard.shape.num_elements() == 0:     # same on every worker
                    out.append(shard)
                    continue
                (got,) = collective.all_reduce(
                    [[shard]], [device], wire, group_size=group.workers,
                    timeout=group.timeout, role=("shard", i, n, group.workers))
                out.append(got[0])
            return out

        return ring.all_reduce(payloads, group.devices, wire, between=across_workers)
