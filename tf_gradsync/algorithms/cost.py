"""Alpha-beta prices of the exchanges: seconds and bytes per member for N members.

A link is a latency per message (alpha) and a bandwidth (beta); each exchange sends a
known number of messages and bytes per member. `exchange="auto"` and the step model
(`tf_gradsync.costmodel`) both price exchanges here.
"""

from __future__ import annotations

import dataclasses
import math
import re

#: Exchanges priced here. "ring" and "tree" all-reduce summable payloads, "gather"
#: and "two_phase" move the others, "hierarchical" all-reduces within each worker's
#: devices, then between workers.
KINDS = ("ring", "tree", "gather", "two_phase", "hierarchical")
#: The kinds that all-reduce summable payloads.
ALL_REDUCES = ("ring", "tree", "hierarchical")
#: What "auto" assumes of a link: latency per message and bandwidth.
LATENCY_S = 50e-6
BYTES_PER_S = 125e6
#: What it assumes of the link between one worker's devices (about PCIe 3.0 x16), tc style.
LOCAL_BANDWIDTH, LOCAL_LATENCY_US = "100gbit", 10.0

#: tc's rate units, in bits per second.
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "kibit": 2**10, "mibit": 2**20, "gibit": 2**30,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second of a rate written as tc writes it ("100mbit", "1gbit",
    "25gbit"; "mbps" means megabytes per second) or as a number of bits per second.

    Raises:
      ValueError: for text in no such form, or a rate that is not positive.

    Example:
      >>> parse_bandwidth("1gbit")
      125000000.0
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        bits = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
        if not m or m.group(2) not in ("", *UNITS):
            raise ValueError(f"bandwidth {text!r} is not a rate; write e.g. 100mbit, 1gbit, "
                             f"25gbit (units: {', '.join(UNITS)}; a bare number is bit/s)")
        bits = float(m.group(1)) * UNITS.get(m.group(2), 1)
    if not bits > 0 or math.isinf(bits):
        raise ValueError(f"bandwidth must be a positive rate, got {text!r}")
    return bits / 8


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's latency per message (alpha, seconds) and bandwidth (beta, bytes/s), and
    the fixed cost of one round of a pairwise all-to-all.

    Defaults: 50 us and 1 Gbit/s, what `exchange="auto"` assumes.

    Attributes:
      latency_s: seconds per message of a ring (one step of a collective all-reduce).
      bytes_per_s: bandwidth.
      round_s: seconds of one round of the all-to-all two phases run where the runtime
        has none (`algorithms.pairwise`: every member in one two-member collective),
        beyond its bytes; None: one latency. Each round starts a collective of its own,
        so it costs more than a ring's message (1.3 to 4.3 of them in the cluster
        bench's sittings, BENCHMARKS.md).
    """

    latency_s: float = LATENCY_S
    bytes_per_s: float = BYTES_PER_S
    round_s: float | None = None

    def __post_init__(self):
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {self.latency_s!r}")
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if self.round_s is not None and not self.round_s >= 0:
            raise ValueError(f"round_s must be >= 0 seconds or None, got {self.round_s!r}")

    @property
    def round_seconds(self) -> float:
        """`round_s`, or one latency where it is None."""
        return self.latency_s if self.round_s is None else self.round_s

    def seconds(self, messages: float, nbytes_: float) -> float:
        """`messages` latencies plus `nbytes_` at the link's bandwidth."""
        return messages * self.latency_s + nbytes_ / self.bytes_per_s


def exchange_seconds(kind: str, workers: int, payload_bytes: float, link: Link = Link(),
                     server_bytes: float | None = None, local: int = 1,
                     local_link: Link | None = None) -> float:
    """Seconds one worker spends in one exchange of one bucket (alpha-beta model).

    With N workers of one device each and a payload of P bytes (per device):
      ring:       2(N-1) messages, 2(N-1)/N P bytes (reduce-scatter + all-gather);
      tree:       2 ceil(log2 N) messages, 2(N-1)/N P bytes (halving-doubling);
      gather:     N-1 messages, (N-1) P bytes;
      two_phase:  `all_to_all_rounds(N)` rounds (`Link.round_s` each), then N-1
        messages; (N-1)/N (P + S) bytes, S the re-compressed chunks;
      hierarchical: a ring among the `local` devices of each worker on `local_link`
        (reduce-scatter, then all-gather), and between them each device's ring of its
        P/L shard among N workers, L rings sharing the worker's link: on it, one ring
        of the full payload.
    With L = `local` devices per worker, the M = N L devices gather as one ring of M
    members, a worker's devices next to each other (TensorFlow's collectives order
    members by worker): M-1 messages, and the hop out of the worker carries (M-1) P
    bytes; two phases run among the M devices, `all_to_all_rounds(M)` rounds whose
    worker's link carries what its L devices send to the other workers' devices,
    L (N-1)/N P, then one ring gather of the re-compressed chunks, (M-1)/M S
    (`bytes_sent`). One worker's devices (N = 1) exchange as L members on
    `local_link`.

    Args:
      kind: one of `KINDS`.
      workers: N, the workers in the exchange.
      payload_bytes: P. For "two_phase", one member's chunk payloads, summed.
      link: the link between workers.
      server_bytes: S, two phases only (default: P).
      local: L, devices per worker (1: each worker is one member; "ring" and "tree"
        take no other).
      local_link: the link between a worker's devices (default: `link`).

    Raises:
      ValueError: for an unknown kind, fewer than one worker or device, or a flat
        all-reduce ("ring", "tree") among workers of several devices.
    """
    n = workers
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not (isinstance(local, int) and local >= 1):
        raise ValueError(f"local must be an integer >= 1 (devices per worker), got {local!r}")
    if n == 1 and local > 1 and kind != "hierarchical":
        return exchange_seconds(kind, local, payload_bytes, local_link or link, server_bytes)
    if kind in ("ring", "tree") and local > 1:
        raise ValueError(f"workers of several devices all-reduce in the hierarchical "
                         f"exchange, not {kind!r}; valid with local={local}: hierarchical, "
                         "gather, two_phase")
    if kind == "hierarchical":
        inner = exchange_seconds("ring", local, payload_bytes, local_link or link) if local > 1 else 0
        return inner + exchange_seconds("ring", n, payload_bytes, link)
    m = n * local
    if m == 1:
        return 0.0
    messages = {"ring": 2 * (n - 1), "tree": 2 * math.ceil(math.log2(n)), "gather": m - 1,
                "two_phase": m - 1}
    if kind not in messages:
        raise ValueError(f"unknown exchange {kind!r}; valid: {', '.join(KINDS)}")
    rounds = all_to_all_rounds(m) * link.round_seconds if kind == "two_phase" else 0.0
    return rounds + link.seconds(messages[kind],
                                 bytes_sent(kind, n, payload_bytes, server_bytes, local))


def all_to_all_rounds(members: int) -> int:
    """Rounds of the pairwise all-to-all among `members` (`algorithms.pairwise.tournament`):
    N-1 for an even N, N for an odd one."""
    return members - 1 + members % 2 if members > 1 else 0


def bytes_sent(kind: str, workers: int, payload_bytes: float,
               server_bytes: float | None = None, local: int = 1) -> float:
    """Bytes one worker sends to the others in one exchange of one bucket, its `local`
    devices together (see `exchange_seconds`)."""
    n, m = workers, workers * local
    if n == 1 and kind in KINDS:
        return 0.0
    if kind in ALL_REDUCES:
        return 2 * (n - 1) / n * payload_bytes
    if kind == "gather":
        return (m - 1) * payload_bytes
    if kind == "two_phase":
        server = payload_bytes if server_bytes is None else server_bytes
        return local * (n - 1) / n * payload_bytes + (m - 1) / m * server
    raise ValueError(f"unknown exchange {kind!r}; valid: {', '.join(KINDS)}")


def local_link() -> Link:
    """The link `LOCAL_BANDWIDTH` and `LOCAL_LATENCY_US` describe."""
    return Link(LOCAL_LATENCY_US * 1e-6, parse_bandwidth(LOCAL_BANDWIDTH))


__all__ = ["ALL_REDUCES", "BYTES_PER_S", "KINDS", "LATENCY_S", "LOCAL_BANDWIDTH",
           "LOCAL_LATENCY_US", "Link", "UNITS", "all_to_all_rounds", "bytes_sent",
           "exchange_seconds", "local_link", "parse_bandwidth"]
