"""The compressor interface and the registry that finds compressors by name.

A compressor turns one flat bucket into *payload* tensors, the only thing that leaves
the device, plus local metadata needed to reconstruct the bucket. Compressors never
communicate: the pipeline moves payloads with a communication algorithm, and sums them
on the wire when the compressor declares them `summable`, or all-gathers them otherwise.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Any, Callable, ClassVar, Mapping, Sequence

import tensorflow as tf

Payload = tuple[tf.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A piece of per-bucket, per-replica state (e.g. an error-feedback residual).

    Attributes:
      shape: static shape of the state variable.
      dtype: its dtype.
      initializer: a callable `(shape, dtype) -> tensor`; zeros by default.
    """

    shape: tuple[int, ...]
    dtype: tf.DType
    initializer: Callable[[tuple[int, ...], tf.DType], tf.Tensor] = tf.zeros


@dataclasses.dataclass(frozen=True)
class Context:
    """What a compressor may know about the call it is part of.

    Attributes:
      state: this bucket's state variables on this replica, keyed as in `state_spec`.
      step: int64 scalar tensor, the number of synchronisations before this one; equal
        on every replica and worker.
      seed: int64 tensor of shape [2] for stateless random ops, equal on every replica
        and worker for this bucket and step (so e.g. random-k picks the same
        coordinates everywhere), different across buckets and steps.
      num_replicas: how many replicas contribute to the reduction.
    """

    state: Mapping[str, tf.Variable] = dataclasses.field(default_factory=dict)
    step: tf.Tensor | int = 0
    seed: tf.Tensor | Sequence[int] = (0, 0)
    num_replicas: int = 1


class Compressor(abc.ABC):
    """Base class of all compressors.

    Subclasses implement `compress` and `decompress` and declare:
      * `summable`: payloads from different replicas may be added elementwise and the
        sum decompresses to the sum of the inputs, so they can be all-reduced;
        otherwise they are all-gathered and decompressed one by one.
      * `unbiased`: `E[decompress(compress(x))] == x`.
      * `prescale`: divide the input by the number of replicas before compressing so
        that sums on the wire stay within the payload dtype's range (fp16).
      * `floating_only`: reject non-floating input.

    Example:
      >>> c = tf_gradsync.compression.get("fp16")
      >>> payload, meta = c.compress(tf.ones([4]), Context())
      >>> c.decompress(payload, meta).dtype
      tf.float32
    """

    name: ClassVar[str] = ""
    summable: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    prescale: ClassVar[bool] = False
    floating_only: ClassVar[bool] = True
    has_own_memory: ClassVar[bool] = False

    def state_spec(self, numel: int, dtype: tf.DType) -> dict[str, StateSpec]:
        """State this compressor keeps per bucket and replica (none by default)."""
        del numel, dtype
        return {}

    @abc.abstractmethod
    def compress(self, x: tf.Tensor, ctx: Context) -> tuple[Payload, Any]:
        """Compresses a flat bucket.

        Args:
          x: 1-D floating tensor.
          ctx: the call's `Context`.

        Returns:
          `(payload, meta)`: payload tensors to send, and Python metadata that stays
          local and must be identical on every replica for the same bucket.
        """

    @abc.abstractmethod
    def decompress(self, payload: Sequence[tf.Tensor], meta: Any) -> tf.Tensor:
        """Reconstructs a flat bucket (or the sum of buckets, for summed payloads)."""

    def payload_bytes(self, payload: Sequence[tf.Tensor]) -> tf.Tensor:
        """Bytes of `payload`, computed from the tensors themselves (int64 scalar)."""
        return nbytes(payload)

    #: How many fixed payload layouts `compress` chooses among at run time (see `variant`).
    num_variants: int = 1

    def variant(self, ctx: Context) -> tf.Tensor | None:
        """Which payload layout this step's payload has, or None for a static payload.

        A compressor whose payload size changes at run time picks among
        `num_variants` layouts of fixed shapes and returns the int32 index of this
        step's pick. It must be equal on every replica and worker (derive it from
        state updated by `observe`). Collective ops fix a tensor's shape per
        collective instance, so the exchange uses one instance per layout. Such
        payloads are all-gathered: a compressor with variants is not summable.
        """
        del ctx
        return None

    def observe(self, reduced: tf.Tensor, ctx: Context) -> None:
        """Sees the final reduced bucket of this step (a no-op by default).

        The pipeline calls it on every source replica with the reduced result, which
        is identical on every replica and worker, so state updated from it (e.g.
        for `variant`) stays identical everywhere. It runs after this step's
        `compress`; what it stores affects the next step.

        Args:
          reduced: the reduced flat bucket (sum or mean, as requested).
          ctx: this replica's `Context` for the bucket.
        """
        del reduced, ctx

    def for_error_feedback(self) -> "Compressor":
        """The form of this compressor to use under error feedback (itself by default).

        Error feedback needs a reconstruction no larger than its input; an unbiased
        sparsifier that scales kept values up (random-k by n / k) returns its
        unscaled form here.
        """
        return self

    def check_input(self, x: tf.Tensor) -> None:
        """Raises ValueError for input this compressor cannot handle."""
        if x.shape.rank != 1:
            raise ValueError(f"{self!r} compresses flat 1-D buckets, got shape {x.shape}")
        if self.floating_only and not x.dtype.is_floating:
            raise ValueError(
                f"{self!r} needs floating input (float16, bfloat16, float32, float64), "
                f"got {x.dtype.name}")

    def __repr__(self) -> str:
        params = inspect.signature(type(self).__init__).parameters
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in params
                         if k != "self" and hasattr(self, k))
        return f"{type(self).__name__}({args})"


def nbytes(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Total bytes of `tensors` as an int64 scalar (a constant when shapes are static)."""
    total = tf.constant(0, tf.int64)
    for t in tensors:
        n = t.shape.num_elements()
        size = tf.constant(n, tf.int64) if n is not None else tf.size(t, out_type=tf.int64)
        total += size * t.dtype.size
    return total


_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str):
    """Class decorator that makes a compressor available to `get(name)`."""
    def wrap(cls: type[Compressor]) -> type[Compressor]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"compressor name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def names() -> list[str]:
    """Names of all registered compressors, sorted."""
    return sorted(_REGISTRY)


def get(name: str | Compressor, **kwargs) -> Compressor:
    """Returns a compressor by registered name (or passes an instance through).

    Args:
      name: a registered name such as "fp16", or a `Compressor` instance.
      **kwargs: constructor arguments of that compressor.

    Raises:
      ValueError: for an unknown name, or arguments the compressor does not take.
    """
    if isinstance(name, Compressor):
        if kwargs:
            raise ValueError(f"got a compressor instance {name!r} and arguments {kwargs}; pass "
                             "either a registered name with arguments or an instance alone")
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(names())}")
    cls = _REGISTRY[name]
    params = [p.name for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"compressor {name!r} got unknown arguments {unknown}; "
                         f"valid arguments: {params or 'none'}")
    return cls(**kwargs)


class RoundCompressor(Compressor):
    """A compressor whose payload is summed in several dependent rounds (PowerSGD).

    The pipeline calls `first_round`, all-reduces its payload, hands the sum to
    `next_round`, and so on until `next_round` returns `None` for the payload; then
    `finish` turns the last sum into the reconstruction. Every round's payload is
    summable. The compressor never communicates itself.
    """

    summable = True

    @abc.abstractmethod
    def first_round(self, x: tf.Tensor, ctx: Context) -> tuple[Payload, Any]:
        """Returns the first payload and a local carry."""

    @abc.abstractmethod
    def next_round(self, reduced: Sequence[tf.Tensor], carry: Any,
                   ctx: Context) -> tuple[Payload | None, Any]:
        """Given the summed previous payload, returns the next payload (or None) and carry."""

    @abc.abstractmethod
    def finish(self, reduced: Sequence[tf.Tensor], carry: Any, ctx: Context) -> tf.Tensor:
        """Given the last summed payload, returns the reconstruction (and updates state)."""

    def compress(self, x, ctx):
        raise TypeError(f"{type(self).__name__} is multi-round; the pipeline calls first_round")

    def decompress(self, payload, meta):
        raise TypeError(f"{type(self).__name__} is multi-round; the pipeline calls finish")
