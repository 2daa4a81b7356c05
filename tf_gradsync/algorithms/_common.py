"""What the exchanges share: the `Exchange` signature, the `Group` it serves, the `Wire`
that counts bytes, and word packing."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Sequence

import tensorflow as tf

from tf_gradsync.compression.base import GATHER, SCATTER, SUM

# Per device, a list of payload tensors (one entry per payload tensor of a bucket).
DevicePayloads = Sequence[Sequence[tf.Tensor]]


class Wire:
    """Moves tensors between devices and counts every byte that crosses.

    Payloads have static shapes, so their bytes are a Python int (`static`); tensors of
    run-time size (IndexedSlices rows) are counted by graph ops (`total`).
    """

    def __init__(self):
        self.static = 0
        self._dynamic: list[tf.Tensor] = []

    def send(self, t: tf.Tensor, device: str) -> tf.Tensor:
        """Copies `t` to `device`; the copy is the transfer that gets counted."""
        with tf.device(device):
            out = tf.identity(t)
        self._count(out)
        return out

    def fed(self, tensors: Sequence[tf.Tensor], num: int, den: int = 1) -> None:
        """Counts tensors handed to a collective op that sends num/den of its input."""
        for t in tensors:
            self._count(t, num, den)

    def _count(self, t: tf.Tensor, num: int = 1, den: int = 1) -> None:
        n = t.shape.num_elements()
        if n is None:
            self._dynamic.append(tf.size(t, out_type=tf.int64) * t.dtype.size * num // den)
        else:
            self.static += n * t.dtype.size * num // den

    def total(self) -> tf.Tensor:
        """All bytes sent so far (int64 scalar)."""
        return tf.add_n([tf.constant(self.static, tf.int64), *self._dynamic])


@dataclasses.dataclass(frozen=True)
class Group:
    """The members of one reduction, as one process sees them.

    Members are numbered as TensorFlow numbers collective members: by worker, then by
    device, so this process's devices are members `worker * len(devices) + i`.

    Attributes:
      devices: this process's devices, one member each.
      workers: processes taking part, each with as many devices.
      worker: this process's index among them.
      timeout: seconds before a collective with a missing peer fails (0: never).
    """

    devices: tuple[str, ...]
    workers: int = 1
    worker: int = 0
    timeout: float = 0

    @property
    def size(self) -> int:
        """Members across all workers."""
        return len(self.devices) * self.workers

    @property
    def members(self) -> tuple[int, ...]:
        """Each local device's index among all members."""
        n = len(self.devices)
        return tuple(self.worker * n + i for i in range(n))


class Exchange(abc.ABC):
    """Moves one round's payloads among the members of a `Group`. Stateless.

    Every exchange has the one signature `exchange(payloads, transport, group, wire,
    like=None)`; subclasses implement the transports they can move (`_sum`, `_gather`,
    `_scatter`) and list them in `transports`.

    Example:
      >>> got = Ring()([(a,), (b,)], SUM, Group(("/cpu:0", "/cpu:1")), Wire())
      >>> got[1][0]   # a + b, on /cpu:1
    """

    name: ClassVar[str]
    transports: ClassVar[tuple[str, ...]] = (SUM, GATHER)

    def __call__(self, payloads: Sequence, transport: str, group: Group, wire: Wire,
                 like: Sequence[Sequence[tf.TensorSpec]] | None = None) -> list:
        """Moves the payloads.

        Args:
          payloads: per local device, its payload (a tuple of tensors of static
            shapes); for SCATTER, a tuple of `group.size` payloads, the j-th for member j.
          transport: SUM, GATHER or SCATTER (see `tf_gradsync.compression.Message`).
          group: who takes part.
          wire: counts every byte sent.
          like: for a GATHER whose payloads differ by member, each member's specs.

        Returns:
          Per local device: for SUM, the summed payload; for GATHER, every member's
          payload in member order; for SCATTER, the parts addressed to it, in member
          order. Tensors are tuples, placed on that device.

        Raises:
          ValueError: for a transport this exchange does not move.
        """
        if transport not in self.transports:
            raise ValueError(f"the {self.name} exchange moves {', '.join(self.transports)} "
                             f"payloads, not {transport!r}")
        if transport == SCATTER:
            payloads = [tuple(tuple(part) for part in p) for p in payloads]
        else:
            payloads = [tuple(p) for p in payloads]
        if group.size == 1:
            (own,) = payloads
            return [own] if transport == SUM else [[own[0] if transport == SCATTER else own]]
        if transport == SUM:
            return fused_by_dtype(payloads, group.devices,
                                  lambda fused: self._sum(fused, group, wire))
        if transport == SCATTER:
            return [[tuple(p) for p in parts] for parts in self._scatter(payloads, group, wire)]
        return [[tuple(p) for p in parts] for parts in self._gather(payloads, group, wire, like)]

    def _sum(self, payloads, group: Group, wire: Wire) -> list:
        raise NotImplementedError

    def _gather(self, payloads, group: Group, wire: Wire, like) -> list:
        raise NotImplementedError

    def _scatter(self, payloads, group: Group, wire: Wire) -> list:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class InProcess(Exchange):
    """An exchange among the devices of one process (copies between devices)."""

    def __call__(self, payloads, transport, group, wire, like=None):
        if group.workers > 1:
            raise ValueError(f"the {self.name} exchange runs among the devices of one "
                             f"process; {group.workers} workers need a collective one")
        return super().__call__(payloads, transport, group, wire, like)


def fused_by_dtype(payloads: DevicePayloads, devices: Sequence[str], sum_fn) -> list[tuple]:
    """`sum_fn(fused)` of the payloads with their tensors of one dtype concatenated into
    one flat tensor, split back to their shapes: a round is then one reduction per dtype.

    Across workers each reduction is a collective, whose launch and rendezvous cost
    more than the copy of a compressed payload (8 workers on 2 cores: 25-35 ms each;
    PowerSGD's first round, its factors and the tensors sent as they are, took two).

    Returns:
      Per device, the summed payload tensors as a tuple, on that device.
    """
    groups: dict[tf.DType, list[int]] = {}
    for k, t in enumerate(payloads[0]):
        groups.setdefault(t.dtype, []).append(k)
    if len(groups) == len(payloads[0]):
        return [tuple(p) for p in sum_fn(payloads)]
    shapes = [t.shape for t in payloads[0]]
    fused = []
    for p, d in zip(payloads, devices):
        with tf.device(d):
            fused.append([p[g[0]] if len(g) == 1 else
                          tf.concat([tf.reshape(p[k], [-1]) for k in g], 0)
                          for g in groups.values()])
    out = []
    for sums, d in zip(sum_fn(fused), devices):
        got: list = [None] * len(shapes)
        with tf.device(d):
            for g, total in zip(groups.values(), sums):
                parts = (tf.split(total, [shapes[k].num_elements() for k in g]) if len(g) > 1
                         else [total])
                for k, part in zip(g, parts):
                    got[k] = tf.reshape(part, shapes[k])
        out.append(tuple(got))
    return out


def accumulate(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """a + b, computed in float32 for 16-bit floats so only the result is rounded."""
    if a.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(a, tf.float32) + tf.cast(b, tf.float32), a.dtype)
    return a + b


def even_sizes(numel: int, parts: int) -> list[int]:
    """Splits `numel` elements into `parts` sizes differing by at most one."""
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_static(t: tf.Tensor) -> int:
    n = t.shape.num_elements()
    if n is None:
        raise ValueError(f"summable payloads need static shapes, got {t.shape}")
    return n


def words_of(specs: Sequence[tf.TensorSpec]) -> int:
    """How many int32 words `pack_words` needs for tensors of these specs."""
    return sum(-(-spec.shape.num_elements() * spec.dtype.size // 4) for spec in specs)


def pack_words(tensors: Sequence[tf.Tensor], length: int | None = None) -> tf.Tensor:
    """The tensors' bits as one int32 vector (each tensor padded to whole words), then
    zero-padded to `length` words: payloads of any dtypes and shapes in one tensor that
    collectives carry, so replicas can exchange payloads of different shapes."""
    words = []
    for t in tensors:
        flat = tf.reshape(t, [-1])
        if t.dtype == tf.bool:      # no bitcast for bool: a byte each
            flat = tf.cast(flat, tf.uint8)
        if t.dtype.size >= 4:
            words.append(tf.reshape(tf.bitcast(flat, tf.int32), [-1]))
            continue
        per_word = 4 // t.dtype.size
        flat = tf.concat([flat, tf.zeros([(-flat.shape[0]) % per_word], flat.dtype)], 0)
        words.append(tf.bitcast(tf.reshape(flat, [-1, per_word]), tf.int32))
    out = tf.concat(words, 0) if words else tf.zeros([0], tf.int32)
    if length is not None and length > out.shape[0]:
        out = tf.concat([out, tf.zeros([length - out.shape[0]], tf.int32)], 0)
    return out


def unpack_words(words: tf.Tensor, specs: Sequence[tf.TensorSpec]) -> tuple[tf.Tensor, ...]:
    """Inverse of `pack_words`: tensors of `specs` from the front of `words`."""
    out, at = [], 0
    for spec in specs:
        n = spec.shape.num_elements()
        size = words_of([spec])
        chunk = words[at:at + size]
        at += size
        dtype = tf.uint8 if spec.dtype == tf.bool else spec.dtype
        if dtype.size >= 4:
            flat = tf.bitcast(tf.reshape(chunk, [-1, dtype.size // 4]) if dtype.size > 4
                              else chunk, dtype)
        else:
            flat = tf.reshape(tf.bitcast(chunk, dtype), [-1])[:n]
        out.append(tf.reshape(tf.cast(flat, spec.dtype), spec.shape))
    return tuple(out)


def in_graph(launch, payloads, devices):
    """Runs `launch(payloads)`, building it into one function when eager.

    Eagerly, one device's collective would block before the next one launches, so
    build them all into one function, from inputs first copied to their own devices (a
    collective fed from another device waits forever); inside a graph, just build them.
    `payloads` holds, per device, any nest of tensors.
    """
    if not tf.executing_eagerly():
        return launch(payloads)
    placed = []
    for p, d in zip(payloads, devices):
        with tf.device(d):
            placed.append(tf.nest.map_structure(tf.identity, p))
    return tf.function(launch)(placed)
