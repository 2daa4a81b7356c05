"""A simulated cluster network on one Linux host: one network namespace per worker.

    bridge (root namespace, no address)
      |-- veth: bridge side (shaped) <==> worker side (shaped), 10.77.0.1, namespace 0
      |-- veth: bridge side (shaped) <==> worker side (shaped), 10.77.0.2, namespace 1

Each worker's link is shaped with a `tc` token bucket (tbf) on both of its ends, so
its "NIC" is limited to the rate in both directions: the worker side shapes what the
worker sends, the bridge side what it receives. The bridge has no address, so traffic
between the addresses stays inside the namespaces. Every name starts with
`gsb<pid>`, so what a killed run leaves behind can be found and removed
(`cleanup_stale`). Needs root.

Example:
  >>> with Network(workers=2, rate="1gbit") as net:
  ...     subprocess.run([*net.exec_prefix(0), "ping", "-c1", net.addresses[1]])
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
from typing import Sequence

from tf_gradsync.algorithms import cost

PREFIX = "gsb"
#: Worker i gets SUBNET.(i+1)/24.
SUBNET = "10.77.0"
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_TIMEOUT = 30   # seconds for any one `ip` / `tc` command
_serial = itertools.count()


def parse_rate(text: str) -> int:
    """A tc-style rate ("100mbit", "1gbit", "2.5gbit") in bits per second.

    Raises:
      ValueError: naming `text` and the accepted form.
    """
    try:
        if not re.search(r"[a-z]\s*$", str(text).lower()):
            raise ValueError("no unit")
        bps = int(round(cost.parse_bandwidth(text) * 8))
    except ValueError:
        raise ValueError(f"bad rate {text!r}: give a positive number and a unit, one of "
                         f"{', '.join(cost.UNITS)} (e.g. 100mbit, 1gbit, 10gbit)") from None
    if not 8_000 <= bps <= 100 * 10**9:   # tbf's practical range
        raise ValueError(f"bad rate {text!r}: must be between 8kbit and 100gbit")
    return bps


def parse_delay(text: str) -> float:
    """A tc-style delay ("10ms", "500us") in seconds.

    Raises:
      ValueError: naming `text` and the accepted form.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad delay {text!r}: give a number and a unit, one of "
                         f"{', '.join(_DELAY_UNITS)} (e.g. 5ms)")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


def check_privileges() -> None:
    """Raises PermissionError unless this process can build namespaces and qdiscs."""
    if os.geteuid() != 0:
        raise PermissionError("network namespaces, veth links and tc qdiscs need root; "
                              "run as root (e.g. with sudo)")
    missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
    if missing:
        raise PermissionError(f"missing {' and '.join(missing)} (iproute2); install it")


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (tried on loopback in a scratch namespace)."""
    ns = f"{PREFIX}{os.getpid()}p{next(_serial)}"
    _ip("netns", "add", ns)
    try:
        return subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True,
                              timeout=_TIMEOUT).returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


def check_delay(delay: str) -> None:
    """Checks that `delay` can be applied: well formed, and the kernel has netem.

    Raises:
      ValueError: for a malformed delay.
      RuntimeError: when the kernel has no netem qdisc (sch_netem), the only qdisc
        that delays packets; the delay is never silently dropped.
    """
    parse_delay(delay)
    if not netem_available():
        raise RuntimeError(
            f"delay {delay!r} needs the netem qdisc (kernel module sch_netem), which this "
            f"kernel does not provide ('tc qdisc add ... netem' fails); run without a delay")


def cleanup_stale() -> list[str]:
    """Removes namespaces and links whose owning process (`gsb<pid>...`) is gone.

    Processes still running inside such a namespace are killed first.

    Returns:
      The names removed.
    """
    removed = []
    namespaces = _ip("netns", "list").split()
    links = re.findall(r"^\d+:\s+([^:@\s]+)", _ip("-o", "link", "show"), re.M)
    for name in [n for n in namespaces if _stale(n)]:
        for pid in (_ip("netns", "pids", name, check=False) or "").split():
            _kill(int(pid))
        _ip("netns", "del", name, check=False)
        removed.append(name)
    for name in [n for n in links if _stale(n)]:
        if _ip("link", "del", name, check=False) is not None:
            removed.append(name)
    return removed


class Network:
    """Namespaces, veth pairs, a bridge and tc shaping for `workers` workers.

    Args:
      workers: how many namespaces (>= 1).
      rate: each worker's link rate in both directions, tc-style ("1gbit").
      delay: one-way latency added to what each worker sends ("5ms"); needs netem.

    Attributes:
      namespaces: the namespace of each worker.
      addresses: each worker's IPv4 address.
      interface: the name of each worker's interface inside its namespace (the same
        in all of them, so one worker command fits every namespace).
      bridge_ports: the bridge-side interface of each worker's link.

    Raises:
      ValueError: for a bad `workers`, `rate` or `delay`.
      RuntimeError: when netem is needed but missing, or a command fails (after
        removing whatever was created).
    """

    def __init__(self, workers: int, rate: str, delay: str | None = None):
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 250:
            raise ValueError(f"workers must be an integer in [1, 250], got {workers!r}")
        self.rate_bps = parse_rate(rate)
        self.rate = rate
        self.delay = delay
        if delay is not None:
            parse_delay(delay)
        tag = f"{PREFIX}{os.getpid()}{chr(ord('a') + next(_serial) % 26)}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}n{i}" for i in range(workers)]
        self.bridge_ports = [f"{tag}h{i}" for i in range(workers)]
        self.interface = f"{tag}w"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(workers)]
        self._up = False

    def __enter__(self) -> "Network":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in worker i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def setup(self) -> None:
        """Creates everything; on any failure removes what was made and re-raises."""
        check_privileges()
        if self.delay is not None:
            check_delay(self.delay)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _quiet_ipv6(None, self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            host, inner = self.bridge_ports[i], self.interface
            _ip("netns", "add", ns)
            # No IPv6: its neighbour discovery would add stray bytes to the counters.
            _quiet_ipv6(ns, "all")
            _quiet_ipv6(ns, "default")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns)
            _quiet_ipv6(None, host)
            _ip("link", "set", host, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            self._shape(None, host, delay=None)
            self._shape(ns, inner, delay=self.delay)

    def _shape(self, ns: str | None, dev: str, delay: str | None) -> None:
        byte_rate = self.rate_bps / 8
        burst = tbf_burst(self.rate_bps)
        # The queue holds 20 ms at the rate beyond the bucket.
        _tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
            "rate", f"{self.rate_bps}bit", "burst", str(burst),
            "limit", str(burst + int(byte_rate * 0.02)))
        if delay is not None:
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                "delay", delay)

    def teardown(self) -> None:
        """Kills processes left in the namespaces and removes everything (idempotent)."""
        if not self._up:
            return
        for ns in self.namespaces:
            for pid in (_ip("netns", "pids", ns, check=False) or "").split():
                _kill(int(pid))
            _ip("netns", "del", ns, check=False)   # takes its veth pair with it
        for dev in [*self.bridge_ports, self.bridge]:
            _ip("link", "del", dev, check=False)
        self._up = False   # only now: a teardown cut short is redone by the next call


def tbf_burst(rate_bps: int) -> int:
    """Bytes of the token bucket shaping a link of `rate_bps`: 4 ms at the rate, at
    least 16 KiB.

    The bucket refills while the workers compute, and a transfer of up to a bucket then
    crosses at the veth's speed, which no NIC's line rate allows; so it is kept small.
    With less than 4 ms, the qdisc's timer granularity keeps 1gbit and 10gbit links
    well below their rate (measured). tbf cuts a GSO packet larger than the bucket
    into segments, so the bucket need not hold a 64 KiB one.
    """
    return max(16 * 1024, int(rate_bps / 8 / 250))


def qdiscs(ns: str | None, dev: str) -> list[dict]:
    """The qdiscs on `dev` as dicts with `kind` and, for tbf, `rate_bps` and `burst`
    (bytes)."""
    out = []
    for q in json.loads(_tc(ns, "-j", "qdisc", "show", "dev", dev) or "[]"):
        opts = q.get("options", {})
        out.append({"kind": q["kind"], **({"rate_bps": 8 * opts["rate"], "burst": opts["burst"]}
                                          if q["kind"] == "tbf" else {})})
    return out


def _stale(name: str) -> bool:
    m = re.match(rf"{PREFIX}(\d+)[a-z]", name)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _quiet_ipv6(ns: str | None, dev: str) -> None:
    cmd = ["sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"]
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    # Best effort: a kernel without IPv6 has nothing to disable.
    subprocess.run(cmd, capture_output=True, timeout=_TIMEOUT)


def _ip(*args: str, check: bool = True) -> str | None:
    return _run(["ip", *args], check)


def _tc(ns: str | None, *args: str) -> str:
    return _run(["tc", *(["-n", ns] if ns else []), *args], True)


def _run(cmd: Sequence[str], check: bool) -> str | None:
    """Runs a command; its stdout, or None (check=False) / RuntimeError on failure."""
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_TIMEOUT)
    if out.returncode:
        if check:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")
        return None
    return out.stdout
