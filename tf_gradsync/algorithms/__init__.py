"""Exchanges: stateless objects that move one round's payloads among a group's members.

Every exchange has one signature, `exchange(payloads, transport, group, wire, like)`
(`Exchange`): "ring", "tree" (among the devices of one process), "collective"
(TensorFlow's collective ops, in one process or across workers), "hierarchical"
(several devices per worker) and "two_phase" (the all-to-all and ragged all-gather of
two-phase exchanges). `for_round` picks the one that moves a round; adding an
exchange is one module and one entry here.

Payloads that cannot be summed travel in one of two exchanges, chosen per bucket by
their predicted cost (`cost`): "gather" (all-gather, each member decodes
every payload) or "two_phase" (`tf_gradsync.compression.two_phase`).
"""

from __future__ import annotations

from typing import Sequence

from tf_gradsync.algorithms import collective, cost, hierarchical, pairwise, ring, tree
from tf_gradsync.algorithms._common import Exchange, Group, Wire
from tf_gradsync.compression.base import SCATTER, SUM

#: The exchanges a user may name as `algorithm`, for summed and gathered payloads in one
#: process.
ALGORITHMS: dict[str, Exchange] = {"ring": ring.Ring(), "tree": tree.Tree(),
                                   "collective": collective.Collective()}
HIERARCHICAL = hierarchical.Hierarchical()
TWO_PHASE = pairwise.TwoPhase()

#: Below this payload size a bucket is latency-bound: halving-doubling's log2(N) steps
#: beat the ring's N-1.
TREE_MAX_BYTES = 256 * 1024


#: Exchanges of payloads that cannot be summed.
EXCHANGES = ("auto", "gather", "two_phase")


def names() -> list[str]:
    return ["auto", *sorted(ALGORITHMS)]


def validate(name: str) -> str:
    if name not in names():
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(names())}")
    return name


def choose(name: str, payload_bytes: int, num_devices: int) -> Exchange:
    """Resolves `auto`: tree for small buckets or few devices, ring otherwise."""
    if name != "auto":
        return ALGORITHMS[name]
    if num_devices <= 2 or payload_bytes <= TREE_MAX_BYTES:
        return ALGORITHMS["tree"]
    return ALGORITHMS["ring"]


def for_round(transport: str, like: Sequence | None, group: Group, algorithm: str,
              payload_bytes: int) -> Exchange:
    """The exchange that moves one round.

    Args:
      transport: the round's transport (SUM, GATHER or SCATTER).
      like: its per-member payload specs, when they differ by member.
      group: who takes part.
      algorithm: the user's choice for one process ("auto" or a name in `ALGORITHMS`).
      payload_bytes: one member's payload.
    """
    if transport == SCATTER or like is not None:
        return TWO_PHASE
    if group.workers > 1:
        # Summed payloads take the shards' route (HIERARCHICAL also covers one device
        # per worker); gathered ones one collective over every member.
        return HIERARCHICAL if transport == SUM else ALGORITHMS["collective"]
    return choose(algorithm, payload_bytes, len(group.devices))


def validate_exchange(name: str) -> str:
    if name not in EXCHANGES:
        raise ValueError(f"unknown exchange {name!r}; valid exchanges: {', '.join(EXCHANGES)}")
    return name


__all__ = ["ALGORITHMS", "EXCHANGES", "HIERARCHICAL", "TWO_PHASE", "Exchange", "Group", "Wire",
           "choose", "cost", "for_round", "names", "pairwise", "validate",
           "validate_exchange"]
