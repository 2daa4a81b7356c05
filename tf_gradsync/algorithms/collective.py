"""TensorFlow collective ops (CollectiveReduceV2 / CollectiveGatherV2) fed with payloads.

TensorFlow's collective runtime runs the exchange (a ring on CPUs and across workers,
NCCL between GPUs when asked); we hand it the compressed payload tensors, so the bytes
it moves are the compressed ones. Byte counts use the payload tensors fed to the ops
and the ring's traffic per device: 2(N-1)/N of the input for a reduce, N-1 copies of
it for a gather.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import zlib
from typing import Hashable, Sequence

import tensorflow as tf
from absl import logging

from tf_gradsync import _tf_compat
from tf_gradsync.algorithms._common import (DevicePayloads, Exchange, Group, Wire, in_graph,
                                             pack_words, unpack_words)

# Far above the group keys TensorFlow's own CollectiveAllReduce allocates from 1, so
# both can live in one process without sharing a key for different device groups.
GROUP_KEY_BASE = 0x6A5000
_INSTANCE_KEY_BASE = 0x6A5000
_lock = threading.Lock()
_instance_keys = itertools.count(_INSTANCE_KEY_BASE)
# Keys derived from what a collective is (`keyed`) lie above the counted ones.
_DERIVED_BASE, _DERIVED_SPAN = 1 << 30, (1 << 31) - 1 - (1 << 30)
_derived: dict[tuple[int, int], Hashable] = {}
_tokens: dict[Hashable, tf.Variable] = {}
_apart = threading.local()   # the key of the innermost `ordered_apart`
_keyed = threading.local()   # [identity, collectives built] of the innermost `keyed`


def group_key(role: Hashable) -> int:
    """A key for a group, derived from what the group is (e.g. `("leaders", 4)`).

    Derived rather than allocated so that every worker computes the same key for the
    same group whatever else it traced before.
    """
    return GROUP_KEY_BASE + zlib.crc32(repr(role).encode()) % (1 << 20)


def ordering_token(device: str) -> tf.Tensor:
    """The resource that orders the collectives launched on `device`.

    Every collective op takes it, and TensorFlow runs the ops that share it one after
    another, in the order they were built, which is the same on every worker. NCCL
    needs that (two GPUs launching the same two collectives in opposite orders wait for
    each other forever). On CPU devices, inside `ordered_apart(key)`, the token is one
    of the key's own.
    """
    key = getattr(_apart, "key", None)
    if key is not None and tf.DeviceSpec.from_string(device or "").device_type == "CPU":
        device_key: Hashable = (device, key)
    else:
        device_key = device
    with _lock:
        if device_key not in _tokens:
            _tokens[device_key] = _tf_compat.plain_variable(
                lambda: tf.constant(0.0), name="ordering_token", device=device)
        return _tokens[device_key].handle


@contextlib.contextmanager
def ordered_apart(key: Hashable):
    """Collectives built inside, on CPU devices, are ordered among themselves only.

    For the collectives inside one functional op (a bucket's `tf.switch_case` between
    its compressor's modes): the op takes the token of each collective it holds, so
    with the device's one token TensorFlow would start it only after the previous
    bucket's exchange had ended, and none of its compression would overlap that
    exchange. CPU collectives find their peers by instance key, in any launch order,
    so there the op may hold a token of its own. GPU devices keep the shared one.

    Args:
      key: names the group of collectives; the same key gives the same token.
    """
    previous = getattr(_apart, "key", None)
    _apart.key = key
    try:
        yield
    finally:
        _apart.key = previous


@contextlib.contextmanager
def keyed(identity: Hashable):
    """Collectives built inside take keys derived from `identity`, their order among
    those built inside, their group and their payloads' shapes, not from a count of every
    collective this process has built. `identity`'s `repr` must be the same in every
    process for the same collectives (a bucket's exchange: its plan, bucket, compressor
    and settings, as the workers check at the start).

    A worker that traces its step functions in another order than its peers, or
    retraces one alone (an input of another shape on that worker), then builds the same
    keys for the same exchange, and the exchanges meet. A retraced exchange reuses its
    keys with the same shapes, which the runtime's cache of shapes by key allows.
    """
    previous = getattr(_keyed, "frame", None)
    _keyed.frame = [identity, 0]
    try:
        yield
    finally:
        _keyed.frame = previous


def next_instance_key(group: int = 0, shapes: Hashable = ()) -> int:
    """A key shared by the ops of one collective on all devices and workers.

    Inside `keyed`, derived from its identity, the collective's place in it, its `group`
    key and its payloads' `shapes`; elsewhere fresh and never reused in a process: the
    runtime caches a collective's shape by its key, so a key reused by another function
    with other shapes would wait forever. Workers agree on fresh keys because they run
    the same program and so build their collectives in the same order.
    """
    frame = getattr(_keyed, "frame", None)
    if frame is None:
        with _lock:
            return next(_instance_keys)
    identity = (frame[0], frame[1], group, shapes)
    frame[1] += 1
    key = _DERIVED_BASE + zlib.crc32(repr(identity).encode()) % _DERIVED_SPAN
    with _lock:
        taken = _derived.setdefault((group, key), identity)
        if taken != identity:
            # Two identities of one hash in one group (30 bits: rare). The later takes
            # the next free key, which a worker that built them in the other order
            # would not: say so, for the hang it may cause.
            logging.warning("tf_gradsync: collectives %r and %r hash to one key; the "
                            "second takes the next free one", taken, identity)
            while _derived.setdefault((group, key), identity) != identity:
                key = _DERIVED_BASE + (key - _DERIVED_BASE + 1) % _DERIVED_SPAN
    return key


def _shapes(tensors) -> tuple:
    return tuple((tuple(t.shape.as_list()), t.dtype.name) for t in tensors)


class Collective(Exchange):
    """TensorFlow's collective ops over every member of the group, in this process and
    across workers (one flat group)."""

    name = "collective"

    def _sum(self, payloads, group, wire):
        return all_reduce(payloads, group.devices, wire, group_size=group.size,
                          timeout=group.timeout, role=everyone(group))

    def _gather(self, payloads, group, wire, like):
        return all_gather(payloads, group.devices, wire, group_size=group.size,
                          timeout=group.timeout, role=everyone(group))


def everyone(group: Group) -> Hashable:
    """The role of a group of all members: across workers it names the group's shape,
    so every worker derives the same key; in one process the devices name it."""
    return None if group.workers == 1 else ("all", len(group.devices), group.workers)


def all_reduce(payloads: DevicePayloads, devices: Sequence[str], wire: Wire,
               group_size: int | None = None, timeout: float = 0,
               role: Hashable = None) -> list[list[tf.Tensor]]:
    """Sums payload tensors with CollectiveReduceV2; every device gets the sum.

    Args:
      payloads: per local device, the payload tensors.
      devices: the local devices.
      wire: records the bytes fed to the collectives.
      group_size: members of the collective group across all workers (default: the
        local devices).
      timeout: seconds before a collective whose peers are missing fails (0: never).
      role: names the group across workers (default: these local devices).
    """
    n = group_size or len(devices)
    gkey = group_key(role or ("local", tuple(devices)))
    wide = [_summed_as(t.dtype) for t in payloads[0]]
    keys = [next_instance_key(gkey, _shapes([t])) for t in payloads[0]]

    def launch(payloads):
        out: list[list[tf.Tensor]] = [[] for _ in devices]
        for k, ikey in enumerate(keys):
            for i, d in enumerate(devices):
                with tf.device(d):
                    t = payloads[i][k]
                    summed = _tf_compat.collective_all_reduce(
                        tf.cast(t, wide[k]), n, gkey, ikey, ordering_token(d), timeout)
                    out[i].append(tf.cast(summed, t.dtype))
        return out

    for k in range(len(keys)):
        wire.fed([tf.TensorSpec(p[k].shape, wide[k]) for p in payloads], 2 * (n - 1), n)
    return in_graph(launch, payloads, devices)


# CollectiveReduceV2 sums these dtypes only.
_SUMMABLE = (tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _summed_as(dtype: tf.DType) -> tf.DType:
    """The dtype a summed payload tensor of `dtype` travels in: its own, or int32 for
    8- and 16-bit integers (counted as sent)."""
    if dtype in _SUMMABLE:
        return dtype
    if dtype.is_integer and dtype.size < 4:
        return tf.int32
    raise ValueError(
        f"a summed payload tensor of {dtype.name} cannot travel through TensorFlow's "
        f"collectives, which sum {', '.join(d.name for d in _SUMMABLE)} (and 8- and "
        "16-bit integers as int32): send another dtype, or mark the compressor not "
        "summable so that its payloads are gathered")


# CollectiveGatherV2 carries float16/32/64 and int32/64 only; other payloads (packed
# bits, int8, bfloat16 scales) travel bit for bit as int32 words, each tensor padded to
# whole words (the padding counted as sent).
_NATIVE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def all_gather(payloads: DevicePayloads, devices: Sequence[str], wire: Wire,
               group_size: int | None = None, timeout: float = 0,
               role: Hashable = None) -> list[list[list[tf.Tensor]]]:
    """Gathers every member's payload with one CollectiveGatherV2.

    A payload of several tensors, or of one that the collective does not carry, travels
    packed into int32 words (`pack_words`): one collective per round, not per tensor
    (each costs a launch and a rendezvous of every member).

    Returns:
      Per local device, the list of all members' payloads in rank order.
    """
    n = group_size or len(devices)
    gkey = group_key(role or ("local", tuple(devices)))
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in payloads[0]]
    if not specs:
        return [[[] for _ in range(n)] for _ in devices]
    packed = len(specs) > 1 or specs[0].dtype not in _NATIVE
    ikey = next_instance_key(gkey, _shapes(specs))

    def launch(payloads):
        out = []
        for i, d in enumerate(devices):
            with tf.device(d):
                sent = pack_words(payloads[i]) if packed else payloads[i][0]
                wire.fed([sent], n - 1)
                gathered = _tf_compat.collective_all_gather(
                    tf.expand_dims(sent, 0), n, gkey, ikey, ordering_token(d), timeout)
                out.append([list(unpack_words(part, specs)) if packed else [part]
                            for part in tf.unstack(gathered, num=n)])
        return out

    return in_graph(launch, payloads, devices)
