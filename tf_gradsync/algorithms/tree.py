"""Recursive halving-doubling all-reduce, and a one-step direct all-gather.

Halving-doubling takes 2*log2(N) steps instead of the ring's 2(N-1), so it suits
small, latency-bound buckets, while still sending 2(N-1)/N of the payload per device
when N is a power of two. Other N first fold the r = N - 2^k extra devices into
partners and unfold the result at the end (Rabenseifner's scheme).

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
  in MPICH", IJHPCA 2005.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync.algorithms._common import (DevicePayloads, InProcess, Wire, accumulate,
                                             check_static, even_sizes)


class Tree(InProcess):
    """Halving-doubling all-reduce and a direct all-gather among the devices of one
    process: for small, latency-bound payloads."""

    name = "tree"

    def _sum(self, payloads, group, wire):
        return all_reduce(payloads, group.devices, wire)

    def _gather(self, payloads, group, wire, like):
        return all_gather(payloads, group.devices, wire)


def all_reduce(payloads: DevicePayloads, devices: Sequence[str], wire: Wire) -> list[list[tf.Tensor]]:
    """Sums each payload tensor over devices; every device gets the sum (see ring.all_reduce)."""
    n = len(devices)
    p = 1 << (n.bit_length() - 1)       # largest power of two <= n
    r = n - p
    out: list[list[tf.Tensor]] = [[] for _ in devices]
    for k in range(len(payloads[0])):
        shape = payloads[0][k].shape
        vec = []
        for i, d in enumerate(devices):
            with tf.device(d):
                vec.append(tf.reshape(payloads[i][k], [-1]))
        for j in range(r):                 # fold extra devices into odd partners
            a, b = 2 * j, 2 * j + 1
            with tf.device(devices[b]):
                vec[b] = accumulate(wire.send(vec[a], devices[b]), vec[b])
        active = [2 * j + 1 for j in range(r)] + list(range(2 * r, n))
        sizes = even_sizes(check_static(payloads[0][k]), p)
        chunks = []
        for v, rank in enumerate(active):
            with tf.device(devices[rank]):
                chunks.append(tf.split(vec[rank], sizes))
        seg = [(0, p)] * p
        dist = p // 2
        while dist >= 1:                   # recursive halving: reduce-scatter
            new = [list(c) for c in chunks]
            for v in range(p):
                lo, hi = seg[v]
                mid = (lo + hi) // 2
                keep = (lo, mid) if not v & dist else (mid, hi)
                dev = devices[active[v]]
                for c in range(*keep):
                    received = wire.send(chunks[v ^ dist][c], dev)
                    with tf.device(dev):
                        new[v][c] = accumulate(received, chunks[v][c])
                seg[v] = keep
            chunks, seg, dist = new, seg, dist // 2
        dist = 1
        while dist < p:                    # recursive doubling: all-gather
            new = [list(c) for c in chunks]
            new_seg = list(seg)
            for v in range(p):
                partner = v ^ dist
                for c in range(*seg[partner]):
                    new[v][c] = wire.send(chunks[partner][c], devices[active[v]])
                new_seg[v] = (min(seg[v][0], seg[partner][0]), max(seg[v][1], seg[partner][1]))
            chunks, seg, dist = new, new_seg, dist * 2
        result = [None] * n
        for v, rank in enumerate(active):
            with tf.device(devices[rank]):
                result[rank] = tf.reshape(tf.concat(chunks[v], 0), shape)
        for j in range(r):                 # unfold: send the result back
            result[2 * j] = wire.send(result[2 * j + 1], devices[2 * j])
        for i in range(n):
            out[i].append(result[i])
    return out


def all_gather(payloads: DevicePayloads, devices: Sequence[str], wire: Wire) -> list[list[list[tf.Tensor]]]:
    """Every device fetches every other device's payload directly (one step).

    Returns:
      Per device, the list of all N payloads (in device order), placed on that device.
    """
    return [[list(payloads[j]) if j == i else [wire.send(t, d) for t in payloads[j]]
             for j in range(len(devices))]
            for i, d in enumerate(devices)]
