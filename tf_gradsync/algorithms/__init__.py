"""Communication algorithms: stateless graph builders over per-device payload lists.

Each algorithm offers `all_reduce` (for summable payloads) and `all_gather` (for the
rest) with the signature `(payloads, devices, wire) -> per-device results`; `pairwise`
adds the all-to-all and the ragged all-gather of two-phase exchanges.

Payloads that cannot be summed travel in one of two exchanges, chosen per bucket by
their predicted cost (`cost`): "gather" (all-gather, each member decodes
every payload) or "two_phase" (`tf_gradsync.compression.two_phase`).
"""

from __future__ import annotations

import types

from tf_gradsync.algorithms import collective, cost, pairwise, ring, tree
from tf_gradsync.algorithms._common import Wire

ALGORITHMS: dict[str, types.ModuleType] = {"ring": ring, "tree": tree, "collective": collective}

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


def choose(name: str, payload_bytes: int, num_devices: int) -> types.ModuleType:
    """Resolves `auto`: tree for small buckets or few devices, ring otherwise."""
    if name != "auto":
        return ALGORITHMS[name]
    if num_devices <= 2 or payload_bytes <= TREE_MAX_BYTES:
        return tree
    return ring


def validate_exchange(name: str) -> str:
    if name not in EXCHANGES:
        raise ValueError(f"unknown exchange {name!r}; valid exchanges: {', '.join(EXCHANGES)}")
    return name


def choose_exchange(name: str, members: int, payload_bytes: float,
                    chunk_bytes: float | None = None, server_bytes: float | None = None) -> str:
    """Resolves "auto" to the cheaper exchange on the default `cost.Link` (see
    `cost.exchange_seconds`); at N = 2 both
    move about the same bytes and gathering takes fewer rounds and compresses once.

    Args:
      name: "auto", "gather" or "two_phase".
      members: replicas taking part.
      payload_bytes: one member's payload for the whole bucket (gathered).
      chunk_bytes: its chunks' payloads, summed (default: `payload_bytes`).
      server_bytes: the re-compressed chunks, summed (default: `chunk_bytes`).
    """
    if name != "auto":
        return name
    if members <= 2:
        return "gather"
    chunk = payload_bytes if chunk_bytes is None else chunk_bytes
    gather = cost.exchange_seconds("gather", members, payload_bytes)
    two = cost.exchange_seconds("two_phase", members, chunk, server_bytes=server_bytes)
    return "two_phase" if two < gather else "gather"


__all__ = ["ALGORITHMS", "EXCHANGES", "Wire", "choose", "choose_exchange", "cost",
           "names", "pairwise", "validate", "validate_exchange"]
