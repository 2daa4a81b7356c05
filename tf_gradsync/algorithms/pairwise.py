"""All-to-all and ragged all-gather from what every runtime has: copies and two-member
collectives.

TensorFlow's all-to-all collective (`CollectiveAllToAllV2`) exists for NCCL only; on
CPUs it waits until its timeout. Here an all-to-all among T members runs as the rounds
of a round-robin tournament: in each round every member is paired with at most one
other and the two swap what they hold for each other, by a copy when both live in this
process and by a two-member gather collective otherwise. Every pair meets once, so each
member sends each of its T-1 outgoing parts once; every device launches its collectives
in round order, so no two wait on each other. Group and instance keys come from the
pairs, not the steps: none is created per step.

Payloads of different shapes (chunks of different layouts) travel packed into int32
words, padded to the longer of the two (or to the longest member's, for a gather); the
padding is counted as sent.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.algorithms import collective
from tf_gradsync.algorithms._common import (Exchange, Wire, in_graph, pack_words,
                                             unpack_words, words_of)
from tf_gradsync.compression.base import GATHER, SCATTER

Specs = Sequence[tf.TensorSpec]


class TwoPhase(Exchange):
    """The two transports of a two-phase exchange (`tf_gradsync.compression.two_phase`):
    the all-to-all of chunks to their owners, and the all-gather of the re-compressed
    chunks, whose payloads differ by member."""

    name = "two_phase"
    transports = (SCATTER, GATHER)

    def _scatter(self, payloads, group, wire):
        return all_to_all(payloads, group.devices, group.members, group.size, wire,
                          group.timeout)

    def _gather(self, payloads, group, wire, like):
        if like is None:
            like = [_specs(payloads[0])] * group.size
        return gather_ragged(payloads, like, group.devices, group.members, group.size, wire,
                             group.timeout, role=collective.everyone(group))


def tournament(members: int) -> list[list[tuple[int, int]]]:
    """Rounds of pairs `(a, b)`, a < b, in which every two members meet exactly once.

    The circle method: T-1 rounds for an even T, T for an odd one (each member sits
    one out).

    Example:
      >>> tournament(3)
      [[(1, 2)], [(0, 2)], [(0, 1)]]
    """
    m = members + members % 2
    ids = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(min(ids[i], ids[m - 1 - i]), max(ids[i], ids[m - 1 - i]))
                 for i in range(m // 2)]
        rounds.append(sorted(p for p in pairs if p[1] < members))
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


def all_to_all(parts: Sequence[Sequence[tuple]], devices: Sequence[str], members: Sequence[int],
               group_size: int, wire: Wire, timeout: float = 0) -> list[list[tuple]]:
    """Each local member sends its part j to member j and receives one from every member.

    Args:
      parts: per local device, `group_size` payload tuples: part j goes to member j.
        Part j has the same shapes on every member.
      devices: the local devices.
      members: each local device's index among all `group_size` members (global
        ranks, ordered as TensorFlow orders collective members: by task, then device).
      group_size: members across all workers.
      wire: counts what is sent.
      timeout: seconds before a collective with a missing peer fails (0: never).

    Returns:
      Per local device, `group_size` payload tuples: what each member sent it, its own
      part in its own place.
    """
    local = {m: i for i, m in enumerate(members)}

    def launch(parts):
        out = [[None] * group_size for _ in devices]
        for i, m in enumerate(members):
            out[i][m] = tuple(parts[i][m])
        for pairs in tournament(group_size):
            for a, b in pairs:
                ia, ib = local.get(a), local.get(b)
                if ia is not None and ib is not None:
                    out[ib][a] = tuple(wire.send(t, devices[ib]) for t in parts[ia][b])
                    out[ia][b] = tuple(wire.send(t, devices[ia]) for t in parts[ib][a])
                    continue
                # Reserved on every worker, whether or not it takes part, so that all
                # workers number their collectives alike.
                ikey = collective.next_instance_key(pair_group_key(a, b, group_size))
                if ia is None and ib is None:
                    continue
                i, me, peer = (ia, a, b) if ia is not None else (ib, b, a)
                mine, theirs = _specs(parts[i][peer]), _specs(parts[i][me])
                length = max(words_of(mine), words_of(theirs))
                with tf.device(devices[i]):
                    words = pack_words(parts[i][peer], length)
                    wire.fed([words], 1)
                    both = _tf_compat.collective_all_gather(
                        tf.expand_dims(words, 0), 2, pair_group_key(a, b, group_size), ikey,
                        collective.ordering_token(devices[i]), timeout)
                    out[i][peer] = unpack_words(both[0 if peer < me else 1], theirs)
        return out

    if group_size == len(devices):      # copies only
        return launch(parts)
    return in_graph(launch, parts, devices)


def gather_ragged(payloads: Sequence[tuple], like: Sequence[Specs], devices: Sequence[str],
                  members: Sequence[int], group_size: int, wire: Wire, timeout: float = 0,
                  role=None) -> list[list[tuple]]:
    """All-gather of payloads whose shapes differ by member (`like[j]`: member j's).

    Within a process each payload is copied to every other device; across workers they
    travel packed to the longest member's length through one gather collective.

    Returns:
      Per local device, every member's payload in member order.
    """
    if group_size == len(devices):
        return [[payloads[j] if j == i else tuple(wire.send(t, d) for t in payloads[j])
                 for j in range(group_size)] for i, d in enumerate(devices)]
    length = max(words_of(s) for s in like)
    packed = []
    for p, d in zip(payloads, devices):
        with tf.device(d):
            packed.append([pack_words(p, length)])
    got = collective.all_gather(packed, devices, wire, group_size=group_size,
                                timeout=timeout, role=role)
    out = []
    for i, (d, m) in enumerate(zip(devices, members)):
        with tf.device(d):
            out.append([payloads[i] if j == m else unpack_words(words, like[j])
                        for j, (words,) in enumerate(got[i])])
    return out


def pair_group_key(a: int, b: int, group_size: int) -> int:
    """The group key of members a < b: below the keys of named groups, one per pair."""
    return collective.GROUP_KEY_BASE - 1 - (a * group_size + b)


def _specs(payload) -> tuple[tf.TensorSpec, ...]:
    return tuple(tf.TensorSpec(t.shape, t.dtype) for t in payload)
