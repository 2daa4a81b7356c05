"""Communication algorithms: stateless graph builders over per-device payload lists.

Each algorithm offers `all_reduce` (for summable payloads) and `all_gather` (for the
rest) with the signature `(payloads, devices, wire) -> per-device results`.
"""

from __future__ import annotations

import types

from tf_gradsync.algorithms import collective, ring, tree
from tf_gradsync.algorithms._common import Wire

ALGORITHMS: dict[str, types.ModuleType] = {"ring": ring, "tree": tree, "collective": collective}

#: Below this payload size a bucket is latency-bound: halving-doubling's log2(N) steps
#: beat the ring's N-1.
TREE_MAX_BYTES = 256 * 1024


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


__all__ = ["ALGORITHMS", "Wire", "choose", "names", "validate"]
