"""The compressor interface, its round protocol, and the registry that finds compressors.

A compressor turns one flat bucket into *payload* tensors, the only thing that leaves
the device. It works in *rounds*: each round yields a `Message` (payload tensors plus
how they travel, summed or gathered) and receives what the exchange delivered; after
the last round it returns the reduced bucket. Compressors never communicate: a driver
(`tf_gradsync.compression.driver`) moves the messages, for the pipeline, the benchmarks
and the tests alike. Most compressors have one round and only implement `compress` and
`decompress`; multi-round ones (PowerSGD) override `rounds`.

A bucket fuses many tensors, but statistics belong to tensors: every compressor sees
the bucket's `Layout` (the shapes it holds, back to back) and computes its scales,
norms, k or matrices per tensor, while still sending one fused payload per round.
"""

from __future__ import annotations

import abc
import collections.abc
import dataclasses
import functools
import inspect
import math
import numbers
import warnings
import zlib
from typing import Any, Callable, ClassVar, Generator, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tf_gradsync import _tf_compat
from tf_gradsync.compression import xla

Payload = tuple[tf.Tensor, ...]

#: Transports of a round's payload. SUM: added elementwise on the wire (all-reduce);
#: the sum decodes to the sum of the inputs. GATHER: every replica's payload reaches
#: every replica (all-gather), which decodes each and adds them up. SCATTER: the
#: payload is one part per replica, part j goes to replica j (all-to-all), and each
#: replica receives the parts addressed to it by every replica.
SUM = "sum"
GATHER = "gather"
SCATTER = "scatter"
TRANSPORTS = (SUM, GATHER, SCATTER)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The tensors one flat bucket holds, back to back, in one dtype.

    Attributes:
      shapes: the shape of each tensor, in bucket order.
      dtype: the bucket's dtype.

    Example:
      >>> Layout(((3, 4), (4,))).offsets
      (0, 12)
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype: tf.DType = tf.float32

    @classmethod
    def flat(cls, numel: int, dtype: tf.DType = tf.float32) -> "Layout":
        """A bucket holding one 1-D tensor of `numel` elements."""
        return cls(((int(numel),),), tf.as_dtype(dtype))

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def tensors(self) -> tuple[int, ...]:
        """Indices of the tensors that hold elements (zero-size ones carry nothing)."""
        return tuple(i for i, s in enumerate(self.sizes) if s > 0)


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
      replica: an integer that differs between the replicas of one reduction (across
        workers too); `replica_seed` mixes it into `seed` for noise that must be
        independent per replica (stochastic rounding).
      layout: the tensors the bucket holds; None: one flat tensor.
      mode: which of the compressor's `num_modes` static configurations this call
        builds (see `Compressor.mode`).
      errors: where `record_error` collects this replica's compression error terms;
        None: errors are not measured.
      chunks: set when this bucket is exchanged in two phases
        (`tf_gradsync.compression.two_phase`): its chunks and which one this replica
        owns; None: one round for the whole bucket.
      jit_compile: compile with XLA the compressor's stages it declares compile
        (`Compressor.xla_decode`, `xla_compress`; `tf_gradsync.compression.xla`).
    """

    state: Mapping[str, tf.Variable] = dataclasses.field(default_factory=dict)
    step: tf.Tensor | int = 0
    seed: tf.Tensor | Sequence[int] = (0, 0)
    num_replicas: int = 1
    replica: int = 0
    layout: Layout | None = None
    mode: int = 0
    errors: list | None = dataclasses.field(default=None, compare=False)
    chunks: Any = None
    jit_compile: bool = False

    def layout_of(self, x: tf.Tensor) -> Layout:
        """The bucket's layout, or one flat tensor of `x`'s length when none was given."""
        if self.layout is not None:
            if self.layout.numel != x.shape.num_elements():
                raise ValueError(f"layout holds {self.layout.numel} elements, the bucket "
                                 f"{x.shape.num_elements()}")
            return self.layout
        return Layout.flat(x.shape.num_elements(), x.dtype)

    def substate(self, prefix: str) -> dict[str, tf.Variable]:
        """The state kept under `prefix` (a wrapped compressor's, a chunk's), keyed
        without it."""
        if isinstance(self.state, NoState):
            return self.state
        return {k[len(prefix):]: v for k, v in self.state.items() if k.startswith(prefix)}

    def replica_seed(self) -> tf.Tensor:
        """`seed` with this replica mixed in: independent noise per replica."""
        seed = tf.convert_to_tensor(self.seed, tf.int64)
        return seed + tf.constant([0, (self.replica + 1) * 0x9E3779B1], tf.int64)

    def stage(self, fn, *args):
        """`xla.stage` in this context: `fn(*args)` compiled when it asks for it (for
        helpers that take a stage to run, e.g. `_selection.select`)."""
        return xla.stage(self, fn, *args)

    def record_error(self, x: tf.Tensor, approx: tf.Tensor | None, *,
                     error_sq: tf.Tensor | None = None,
                     norm_sq: tf.Tensor | None = None) -> None:
        """Records ||x - approx||^2 and ||x||^2 (x: what was compressed, approx: what
        this replica's payload decodes to, None when x was sent exactly) when errors
        are measured. `error_sq` and `norm_sq`, when the caller already has them (the
        residual's squared norm, say), are recorded instead of computing them again."""
        if self.errors is None:
            return
        wd = tf.float64 if x.dtype == tf.float64 else tf.float32
        x = tf.cast(x, wd)
        # Fused forms: one pass for the difference and its square, one for the norm.
        if error_sq is not None:
            err = tf.cast(error_sq, wd)
        elif approx is None:
            err = tf.zeros([], wd)
        else:
            err = tf.reduce_sum(tf.math.squared_difference(x, tf.cast(approx, wd)))
        norm = sum_of_squares(x) if norm_sq is None else tf.cast(norm_sq, wd)
        self.errors.append((err, norm))

    def keep_residual(self, residual: tf.Variable, x: tf.Tensor,
                      new: tf.Tensor | None = None) -> None:
        """Stores `new` = x - (what x's payload decodes to) as the error-feedback
        residual, or zeros when it is not finite, and records the compression error.
        `new` None: the residual already holds it (written in place).

        One read of `new` serves both: its squared norm is the compression error, and,
        a sum over every entry, it is not finite exactly when some entry is not (or,
        beyond 1e19 in float32, overflows: the residual then restarts, harmlessly). So
        a non-finite step (a NaN/Inf gradient) resets the residual without an
        elementwise check or select over the bucket.
        """
        error_sq = sum_of_squares(residual.read_value() if new is None else new)
        finite = tf.math.is_finite(error_sq)
        if new is None:
            when(~finite, lambda: residual.assign(tf.zeros_like(residual)))
        else:
            residual.assign(tf.cond(finite, lambda: new, lambda: tf.zeros_like(new)))
        self.record_error(x, None, error_sq=error_sq)


def when(pred: tf.Tensor, fn: Callable[[], Any]) -> None:
    """Runs `fn` (state updates) only when the bool scalar `pred` holds: a condition,
    not a select over a bucket, so a step that does not need the update makes no pass
    over memory for it."""
    def run():
        fn()
        return tf.constant(True)
    tf.cond(pred, run, lambda: tf.constant(False))


def sum_of_squares(x: tf.Tensor) -> tf.Tensor:
    """The sum of x's squared entries, in x's dtype: one pass, no squared copy, summed in
    blocks. A dot product of x with itself (a matrix product, one long running sum)
    read 1.6% low on 20M normal float32 entries, in 61 ms against 7 on 25M."""
    return 2 * tf.nn.l2_loss(x)


@dataclasses.dataclass(frozen=True)
class Message:
    """One round's payload and how it travels.

    Attributes:
      payload: the tensors to send, static shapes; for `SCATTER`, a tuple of such
        payloads, one per replica.
      transport: `SUM` (all-reduce), `GATHER` (all-gather) or `SCATTER` (all-to-all).
      like: for a `GATHER` whose payloads differ between replicas, one `tf.TensorSpec`
        tuple per replica describing its payload (None: every replica's payload has
        this one's shapes).
    """

    payload: Payload
    transport: str
    like: tuple | None = None

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

    def parts(self) -> tuple[Payload, ...]:
        """The payloads this message sends: one, or one per replica for `SCATTER`."""
        return tuple(self.payload) if self.transport == SCATTER else (self.payload,)


#: What a round receives: for SUM, the summed payload; for GATHER, every replica's payload.
Received = Any
Rounds = Generator[Message, Received, tf.Tensor]


class OptimizerAdvice(UserWarning):
    """`check_optimizer`'s advice: the optimizer would train better as
    `adapt_optimizer` rebuilds it."""


class OptimizerRefused(ValueError):
    """`check_optimizer`'s refusal: the compressor cannot train with the optimizer (dgc
    under Adam), whatever else the job is. Callers that try compressors (autotune's
    trials, the accuracy bench) pass over the refusing one."""

    # Raised while a step is traced, an error reaches the user through autograph, which
    # re-creates it as itself only where its constructor is Exception's (a subclass of
    # its own would arrive as a StagingError, no ValueError).
    __init__ = Exception.__init__


class NoState(collections.abc.Mapping):
    """The state of a memoryless call of `Compressor.codec()` (sizing a payload,
    re-compressing a reduced chunk): empty, and reading a field says why there is none."""

    def __init__(self, compressor: "Compressor"):
        self._name = type(compressor).__name__

    def __getitem__(self, key: str):
        raise KeyError(f"{self._name}.compress read its state {key!r} in a memoryless call "
                       "(of its codec(): sizing a payload, re-compressing a reduced chunk): "
                       "a compressor whose compress reads state returns a form that keeps "
                       "none from codec()")

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class Compressor(abc.ABC):
    """Base class of all compressors.

    A single-round compressor implements `compress` and `decompress` and declares:
      * `summable`: payloads from different replicas may be added elementwise and the
        sum decompresses to the sum of the inputs, so they are all-reduced; otherwise
        (the default) they are all-gathered and decompressed one by one.
      * `unbiased`: `E[decompress(compress(x))] == x` (False by default: a biased
        compressor without memory of its own is wrapped in `ErrorFeedback`).
      * `prescale`: divide the input by the number of replicas before compressing so
        that sums on the wire stay within the payload dtype's range (fp16);
        `prescales(dtype)` decides it per bucket dtype.
      * `floating_only`: reject non-floating input.
      * `exact`: decompresses to its input bit for bit, so its compression error is
        zero without measuring it (two passes over the bucket saved).
      * `has_own_memory`: keeps its own error memory (no `ErrorFeedback` around it).
      * `default_error_feedback`: whether `CompressedAllReduce` wraps it in
        `ErrorFeedback` by default; None: when it is biased and has no memory.
      * `splittable`: its gathered payloads may travel in two phases (each chunk a
        bucket of its own); a compressor whose `rounds` needs the whole bucket
        declares False.
      * `batched_decode`: `decompress` also takes payloads stacked along a leading
        axis (one row per replica, the same meta) and decodes every row at once, so
        `combine` sums gathered payloads without a copy of each decode into a stack.
      * `xla_decode`: its decodings (`decompress`, `combine`, `decode_chunks`) compile
        with XLA into fused loops, which the pipeline asks for (`Context.jit_compile`);
        `xla_compress`: its `compress` does (its meta holds no tensors); one whose
        statistics are reductions compiles the stage after them (`Context.stage`).
      * `accuracy`: what its library defaults cost in accuracy, from the convergence
        matrix (BENCHMARKS.md): "lossless" (as uncompressed training), "balanced"
        (within about a point on every measured recipe) or "aggressive" (more on
        some; the default for a compressor not measured there).

    A compressor with several static configurations (a warm-up stage, a ratio chosen
    at run time) declares `num_modes` and picks one per step in `mode`; each mode has
    payloads of fixed shapes, and the driver builds every mode's exchange and runs the
    one picked. Multi-round compressors override `rounds`.

    Example:
      >>> c = tf_gradsync.compression.get("fp16")
      >>> payload, meta = c.compress(tf.ones([4]), Context())
      >>> c.decompress(payload, meta).dtype
      tf.float32
    """

    name: ClassVar[str] = ""
    # Safe defaults: payloads that cannot be summed are gathered (correct for any
    # codec), and a biased codec gets error feedback.
    summable: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    prescale: ClassVar[bool] = False
    floating_only: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    has_own_memory: ClassVar[bool] = False
    default_error_feedback: ClassVar[bool | None] = None
    accuracy: ClassVar[str] = "aggressive"
    splittable: ClassVar[bool] = True
    batched_decode: ClassVar[bool] = False
    xla_decode: ClassVar[bool] = False
    xla_compress: ClassVar[bool] = False
    #: Static configurations picked at run time by `mode`.
    num_modes: int = 1
    #: Whether it has a one-round codec (`compress`), derived per class: one of its own
    #: rounds has none to wrap in error feedback or to cut into two phases.
    one_round: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.one_round = cls.compress is not Compressor.compress
        if "splittable" not in cls.__dict__ and not cls.one_round:
            cls.splittable = False
        if "state_spec" in cls.__dict__:
            cls.state_spec = _checked_state_spec(cls.__dict__["state_spec"])

    def state_spec(self, layout: Layout) -> dict[str, StateSpec]:
        """State this compressor keeps per bucket and replica (none by default)."""
        del layout
        return {}

    def report(self, states: Iterable[Mapping[str, tf.Variable]]) -> dict[str, float]:
        """Numbers for `CompressedAllReduce.stats()` read from its state: `states` yields
        one replica's state of each bucket built so far (`state_spec`'s names), looked
        up only as it is iterated. None by default; `Guard` counts the buckets it sends
        with its fallback."""
        del states
        return {}

    def rounds(self, x: tf.Tensor, ctx: Context) -> Rounds:
        """The round protocol: yields `Message`s, receives them exchanged, returns the sum.

        The default is one round of `encode`; the result is the decompressed sum
        (SUM) or the sum of every replica's decompressed payload (GATHER). A gathered
        bucket whose context has `chunks` is exchanged in two phases instead
        (`tf_gradsync.compression.two_phase`).

        Args:
          x: this replica's flat bucket.
          ctx: the call's `Context`.

        Returns:
          A generator; its return value is the reduced bucket (the sum over replicas
          of what their payloads decode to), identical on every replica.
        """
        if ctx.chunks is not None and not self.summable:
            from tf_gradsync.compression import two_phase  # pylint: disable=import-outside-toplevel
            return (yield from two_phase.rounds(self, x, ctx))
        payload, meta = self.encode(x, ctx)
        received = yield Message(payload, SUM if self.summable else GATHER)
        reduced = xla.decode(self, ctx, lambda r: self.combine(r, meta), received)
        self.observe(reduced, ctx)
        return reduced

    def encode(self, x: tf.Tensor, ctx: Context) -> tuple[Payload, Any]:
        """`compress` with whatever memory the compressor keeps, and its error recorded.

        `ErrorFeedback` overrides it to compress x plus its residual.
        """
        recorded = len(ctx.errors) if ctx.errors is not None else 0
        payload, meta = xla.compress(self, x, ctx)
        payload = tuple(payload)
        # `compress` may record the error of what it really compressed (DGC: its
        # accumulated velocity); otherwise x against what the payload decodes to.
        if ctx.errors is not None and len(ctx.errors) == recorded and not self.exact:
            # Decoded in one compiled loop where decodings compile (QSGD's 25M entries:
            # 13 bytes read or written per byte for the error as TensorFlow's ops).
            ctx.record_error(x, xla.decode(self, ctx, lambda p: self.decompress(p, meta),
                                           payload))
        return payload, meta

    def codec(self) -> "Compressor":
        """The memoryless codec of this compressor's payload (itself by default).

        Its `compress` gives payloads of this compressor's shapes and meaning without
        touching any state. Compressors whose `compress` updates state (DGC's
        momentum) return a stateless form.
        """
        return self

    def server_codec(self) -> "Compressor":
        """The memoryless codec a two-phase exchange re-compresses reduced chunks with
        (under the owner's error feedback); `codec()` by default.

        A sum of N payloads holds more than one payload: a compressor whose payload
        cannot carry it well (one bit per entry) names a richer codec here.
        """
        return self.codec()

    def combine(self, received: Received, meta: Any) -> tf.Tensor:
        """Decodes what a one-round exchange delivered into the reduced bucket."""
        if self.summable:
            return self.decompress(received, meta)
        if self.batched_decode and len(received) > 1 and xla.tracing():
            # Compiled, the stacked payloads are decoded and summed piece by piece.
            with xla.summing_payloads():
                summed = self.decompress(tuple(tf.stack(ts) for ts in zip(*received)), meta)
            return summed if summed.shape.rank == 1 else tf.reduce_sum(summed, 0)
        if len(received) <= 2:  # a + b == b + a: one add is the same sum everywhere
            parts = [self.decompress(p, meta) for p in received]
            return parts[0] if len(parts) == 1 else parts[0] + parts[1]
        # One reduction over the stacked parts, not add_n: Grappler rewrites an add_n
        # differently on each device (the local part may have another consumer), which
        # changes the summation order and lets replicas drift apart by a rounding error.
        if self.batched_decode:
            # The payloads are stacked (a quarter to a 32nd of the decodes' bytes), not
            # the decodes: 4 sign payloads of 25M entries summed in 133-152 ms instead
            # of 166-192, int8 in 89-92 instead of 101-114 (one core).
            decodes = self.decompress(tuple(tf.stack(ts) for ts in zip(*received)), meta)
        else:
            decodes = tf.stack([self.decompress(p, meta) for p in received])
        return tf.reduce_sum(decodes, 0)

    def decode_chunks(self, payloads: Sequence[Payload], metas: Sequence[Any], chunks
                      ) -> tf.Tensor:
        """The flat bucket from one payload per chunk (what a two-phase exchange
        gathers), `metas` and `chunks` (`two_phase.Chunks`) saying how each was cut:
        each chunk decoded, the decodes concatenated (by default)."""
        del chunks
        return tf.concat([self.decompress(p, m) for p, m in zip(payloads, metas)], 0)

    def observe(self, reduced: tf.Tensor, ctx: Context) -> None:
        """Sees this step's reduced bucket (a no-op by default).

        `reduced` is identical on every replica and worker, so state updated from it
        (e.g. what `mode` reads) stays identical everywhere; it affects the next step.
        """
        del reduced, ctx

    def compress(self, x: tf.Tensor, ctx: Context) -> tuple[Payload, Any]:
        """Compresses a flat bucket (single-round compressors).

        Args:
          x: 1-D floating tensor laid out as `ctx.layout`.
          ctx: the call's `Context`.

        Returns:
          `(payload, meta)`: payload tensors to send, and metadata that stays local and
          is identical on every replica for the same bucket, step and mode.
        """
        raise NotImplementedError(f"{type(self).__name__} has no single-round codec")

    def decompress(self, payload: Sequence[tf.Tensor], meta: Any) -> tf.Tensor:
        """Reconstructs a flat bucket (or the sum of buckets, for summed payloads)."""
        raise NotImplementedError(f"{type(self).__name__} has no single-round codec")

    def prescales(self, dtype: tf.DType) -> bool:
        """Whether a bucket of `dtype` is divided by the replica count before it is
        compressed: `prescale` by default."""
        del dtype
        return self.prescale

    def steady_mode(self) -> int:
        """The mode of this compressor's steady state, past its warm-ups: the one the
        cost model prices. The last mode by default."""
        return self.num_modes - 1

    def mode(self, ctx: Context) -> tf.Tensor | None:
        """This step's mode (int32 scalar tensor in [0, num_modes)), None with one mode.

        It must be equal on every replica and worker: derive it from the step or from
        state that only changes with reduced values (identical everywhere).
        """
        del ctx
        return None

    def sparse_values_dtype(self, dtype: tf.DType) -> tf.DType | None:
        """The dtype in which IndexedSlices values (embedding gradients) of `dtype` travel.

        Sparse gradients are gathered as indices and values, never densified; a
        compressor that rounds elementwise may say how their values travel. None (the
        default) sends them as they are.
        """
        del dtype
        return None

    def for_error_feedback(self) -> "Compressor":
        """The form of this compressor to use under error feedback (itself by default).

        Error feedback needs a reconstruction no larger than its input; an unbiased
        sparsifier that scales kept values up (random-k by n / k) returns its
        unscaled form here.
        """
        return self

    def send_interval(self) -> float:
        """How many steps an entry that matters typically waits between two sends
        under error feedback: 1.0 (the default) when every entry goes out every step,
        however coarsely; larger for payloads that leave entries out."""
        return 1.0

    def rms_step(self) -> float:
        """How far an optimizer that divides by a running root mean square moves an
        entry per step on this payload, relative to the dense gradient, for an entry
        sent every step whose gradient is mostly noise (steady state, error feedback
        included).

        Such an optimizer moves an entry by its mean over its root mean square. A
        payload that carries each entry's value (casts, int8, QSGD) keeps both: 1.0,
        the default. A coarser one can keep the mean (unbiased, or under error
        feedback) and raise the mean square: a scaled sign sends every entry at its
        block's scale, so an entry smaller than its neighbours swings between
        +-scale, and the optimizer crawls on it. Payloads that leave entries out are
        priced by `send_interval` instead.
        """
        return 1.0

    def learning_rate_scale(self, optimizer: Any) -> float:
        """By how much to multiply the learning rate `optimizer` trains with uncompressed.

        1.0, except under an optimizer that divides by a running root mean square (Adam
        and its kin, RMSprop, Adagrad: `divides_by_rms`): sqrt(K) / `rms_step()`, with K
        = `send_interval()`. For a payload whose entries wait K > 1 steps between sends:
        under error feedback such an entry arrives in bursts carrying K steps' worth of
        gradient; the optimizer's first moment sees the whole sum, its second moment K
        times the dense mean square, so the entry moves about sqrt(K) steps' worth per
        K steps. Scaling the values cannot help (these optimizers ignore scale); a
        learning rate sqrt(K) times larger restores the progress
        (`tests/test_compressors.py` measures both on Adam). Measured on the
        convergence matrix (BENCHMARKS.md): top-k at 1% under Adam ended 5.6 points
        below uncompressed training on a CNN, and level with it with the scale; the
        scaled sign (`rms_step` 0.8) 1.1 points below on the digits MLP over three
        seeds, 0.4 with it. `adapt_optimizer` applies the scale and, for sparse
        payloads, also turns the first moment off.

        Args:
          optimizer: the Keras optimizer (Keras 3 or tf_keras) that applies the
            gradients, or its name ("adam", "sgd", ...).

        Returns:
          The factor, >= 1.

        Example:
          >>> ops = tf_gradsync.CompressedAllReduce("topk")   # ratio 0.01
          >>> ops.learning_rate_scale(tf.keras.optimizers.Adam())
          4.641588833612778
        """
        if not divides_by_rms(optimizer):
            return 1.0
        return math.sqrt(max(self.send_interval(), 1.0)) / self.rms_step()

    def adapt_optimizer(self, optimizer: Any) -> Any:
        """`optimizer` rebuilt to train with this compressor as it would uncompressed.

        Under an optimizer that divides by a running root mean square, the copy trains
        at `learning_rate_scale` times the learning rate (sqrt(K) for a payload whose
        entries wait K steps between sends, `send_interval`; 1 / `rms_step` for coarse
        payloads that send every entry). Where entries wait (K > 1) at least half the
        window 1 / (1 - beta) of the optimizer's momentum, the momentum goes: Adam's first
        moment (`beta_1=0`), or SGD's and RMSprop's heavy ball (`momentum=0`,
        `nesterov=False`, the learning rate 1 / (1 - momentum) times larger, the
        long-run step of the momentum). Error feedback already
        accumulates what an entry missed and delivers it in one burst; a momentum
        spanning bursts spreads each over later steps and delays the entry's motion
        further. Measured on the convergence matrix (BENCHMARKS.md), top-k at 1%:
        under Adam at 3.16x the rate 3.3 points below uncompressed training on the MLP
        and 0.70 on the CNN in its sixth epoch, with beta_1 0 too 0.8 below and 1.1
        above; under SGD with momentum 0.9, 1.4 below on the MLP and the residual
        network (95% at epochs 11 and 13), adapted 0.0 and 1.1 below (epochs 4 and
        6), and adaptive's late descent to 1% on the MLP cost 10.6 points with the
        momentum and none without. Random-k at 50% (K = 2) keeps the momentum, with
        which it trained better (the residual network under Adam 1.4 below without,
        0.5 above with). Otherwise `optimizer` itself is returned.

        Args:
          optimizer: a Keras optimizer (Keras 3 or tf_keras), or its name. A
            `LossScaleOptimizer` (mixed precision) has its inner optimizer adapted
            and is wrapped again with the same loss-scale settings.

        Returns:
          An optimizer of the same class, or `optimizer` when nothing changes.

        Raises:
          ValueError: for a learning rate that is neither a number nor one of Keras'
            schedules (whose rates are scaled: ExponentialDecay, CosineDecay, ...), an
            optimizer that its `get_config()` cannot rebuild (a subclass's constructor
            argument left out), or an optimizer this compressor cannot train with even
            adapted (`check_optimizer`: dgc under Adam).

        Example:
          >>> ops = tf_gradsync.CompressedAllReduce("topk")
          >>> ops.adapt_optimizer(tf.keras.optimizers.Adam(1e-3))     # 4.64e-3, beta_1 0
          >>> ops.adapt_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))  # 0.5, momentum 0
        """
        if isinstance(optimizer, str):
            optimizer = tf.keras.optimizers.get(optimizer)
        mark = adaptation(optimizer)
        if mark is not None:
            if mark.by == self._adapts_as():
                return optimizer      # adapting twice would scale the rate twice
            raise ValueError(
                f"{type(applying_optimizer(optimizer)).__name__} was adapted for {mark.by} "
                f"already ({mark.factor:.3g}x its rate): adaptations do not compose; adapt "
                f"the optimizer as it trains uncompressed for {self!r}")
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is not None:
            # A loss-scale wrapper (mixed precision): its inner optimizer adapted and
            # wrapped again with the same settings.
            adapted = self.adapt_optimizer(inner)
            if adapted is inner:
                return optimizer
            settings = dict(optimizer.get_config())
            settings.pop("inner_optimizer")
            return type(optimizer)(adapted, **settings)
        factor, changes = self._optimizer_changes(optimizer)
        adapted = optimizer
        if factor != 1 or changes:
            config = optimizer_config(optimizer)
            lr = _scaled_rate(config.get("learning_rate"), factor)
            adapting = (f"{self!r} trains {type(optimizer).__name__} at {factor:.3g}x its "
                        f"learning rate with {changes}")
            if lr is None:
                raise ValueError(
                    f"{adapting}, but the rate is "
                    f"{config.get('learning_rate')!r}, neither a number nor one of Keras' "
                    f"schedules ({', '.join(_SCHEDULE_RATES)}): multiply its rates by "
                    f"{factor:.3g} and set {changes} yourself")
            config.update(changes, learning_rate=lr)
            try:
                adapted = type(optimizer).from_config(config)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{adapting}, but it cannot be rebuilt from its get_config() "
                    f"({type(e).__name__}: {e}): if get_config leaves a constructor "
                    "argument out, return it there, or make these changes yourself") from e
            _tf_compat.copy_weight_decay_exclusions(optimizer, adapted)
            setattr(adapted, _ADAPTED, Adaptation(self._adapts_as(), factor, changes,
                                                  lr if _number(lr) else None))
            _warn_steps_lost(optimizer)
        # What the first step would refuse (dgc under Adam) is refused here, before a
        # model is built around it.
        self.check_optimizer(adapted)
        return adapted

    def required_optimizer_changes(self, optimizer: Any) -> dict:
        """The config changes to `optimizer` without which `check_optimizer` refuses it
        (none by default): what even a wrapper that keeps the optimizer otherwise as
        it is (the guard) must make."""
        return {}

    def _adapts_as(self) -> str:
        """The compressor whose changes `adapt_optimizer` makes (its repr): optimizers it
        adapted are adapted alike by any compressor with the same."""
        return repr(self)

    def _optimizer_changes(self, optimizer: Any) -> tuple[float, dict]:
        """`adapt_optimizer`'s learning-rate factor and config changes for `optimizer`."""
        factor = self.learning_rate_scale(optimizer)
        config, k, changes = optimizer_config(optimizer), self.send_interval(), {}
        beta_1, momentum = config.get("beta_1"), config.get("momentum")
        # Only entries that wait between sends come in bursts: with every entry sent every
        # step (K = 1) a momentum of any window is kept.
        bursts = k > 1
        if (bursts and divides_by_rms(optimizer) and _positive(beta_1)
                and k >= 0.5 / (1 - beta_1)):
            changes["beta_1"] = 0.0
        if bursts and _positive(momentum) and momentum < 1 and k >= 0.5 / (1 - momentum):
            changes["momentum"] = 0.0
            factor /= 1 - momentum
            if config.get("nesterov"):
                changes["nesterov"] = False
        return factor, {**changes, **weight_decay_change(optimizer, factor)}

    def optimizer_unseen(self) -> None:
        """Called instead of `check_optimizer` when no optimizer applies the gradients
        being reduced (they are all-reduced by hand, before an `apply_gradients` that
        does not aggregate): a compressor that cannot train with some optimizers says
        so here. Nothing by default."""

    def sparse_unseen(self) -> None:
        """Called when embedding gradients (IndexedSlices) are reduced beside this
        compressor, gathered as they are: a compressor that does part of the
        optimizer's work on what it compresses (DGC's momentum) says what they miss.
        Nothing by default."""

    def check_optimizer(self, optimizer: Any) -> None:
        """Raises `OptimizerRefused` when this compressor cannot train with `optimizer`.

        Called once per traced synchronisation with the Keras optimizer applying the
        gradients (when one can be found), before anything is compressed; a
        compressor whose best setting depends on the optimizer settles it here
        (TernGrad's clipping bound). By default it warns when `adapt_optimizer` would
        change the optimizer and it did not come from there, since it cannot tell
        whether the user's settings already account for the compressor.
        """
        factor, changes = self._optimizer_changes(optimizer)
        if (factor != 1 or changes) and adaptation(optimizer) is None:
            what = ", ".join([f"{factor:.3g}x the learning rate"] * (factor != 1) +
                             [_described(changes)] * bool(changes))
            k = self.send_interval()
            slows = ("an optimizer dividing by a running root mean square slows and a "
                     "momentum delays further" if divides_by_rms(applying_optimizer(optimizer))
                     else "a momentum delays")
            why = (f"sends an entry about every {k:.3g} steps: error feedback delivers an "
                   f"entry's missed steps in bursts, which {slows} (or use a "
                   "compressor that sends every entry: int8, qsgd, sign, powersgd)" if k > 1
                   else f"moves an entry {self.rms_step():.2g} times as far per step as the "
                   "dense gradient under an optimizer dividing by a running root mean "
                   "square: its coarse values raise the mean square the optimizer divides by")
            warnings.warn(OptimizerAdvice(
                f"{self!r} {why}. With {type(applying_optimizer(optimizer)).__name__} it "
                f"trains best at {what} "
                "(CompressedAllReduce.adapt_optimizer(optimizer) rebuilds it so; an optimizer "
                "adapted before and loaded from a file is no longer known as adapted: its "
                "rate is already scaled, and adapting it again would scale it twice)"),
                stacklevel=2)

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


class Wrapper(Compressor):
    """A compressor around another one, `inner`, whose payload it sends.

    How the payload travels, the checks and the sparse values' dtype are the inner
    compressor's; subclasses change what is compressed or when.
    """

    def __init__(self, inner: Compressor):
        self.inner = inner
        self.accuracy = inner.accuracy
        self.splittable = inner.splittable
        self.summable, self.unbiased = inner.summable, inner.unbiased
        self.has_own_memory = inner.has_own_memory
        self.prescale = inner.prescale
        self.floating_only = inner.floating_only
        self.xla_decode, self.xla_compress = inner.xla_decode, inner.xla_compress

    def check_input(self, x: tf.Tensor) -> None:
        self.inner.check_input(x)

    def check_optimizer(self, optimizer: Any) -> None:
        self.inner.check_optimizer(optimizer)

    def optimizer_unseen(self) -> None:
        self.inner.optimizer_unseen()

    def sparse_unseen(self) -> None:
        self.inner.sparse_unseen()

    def _optimizer_changes(self, optimizer: Any) -> tuple[float, dict]:
        return self.inner._optimizer_changes(optimizer)  # pylint: disable=protected-access

    def _adapts_as(self) -> str:
        # A wrapper that changes the optimizer as its inner compressor does (a warm-up,
        # error feedback) adapts as that one; one with changes of its own (the guard) not.
        if type(self)._optimizer_changes is Wrapper._optimizer_changes:
            return self.inner._adapts_as()  # pylint: disable=protected-access
        return repr(self)

    def required_optimizer_changes(self, optimizer: Any) -> dict:
        return self.inner.required_optimizer_changes(optimizer)

    def send_interval(self) -> float:
        return self.inner.send_interval()

    def rms_step(self) -> float:
        return self.inner.rms_step()

    def steady_mode(self) -> int:
        # The inner compressor's modes come last (a warm-up's dense mode before them).
        return self.num_modes - self.inner.num_modes + self.inner.steady_mode()

    def sparse_values_dtype(self, dtype: tf.DType) -> tf.DType | None:
        return self.inner.sparse_values_dtype(dtype)

    def prescales(self, dtype: tf.DType) -> bool:
        return self.inner.prescales(dtype)

    def decompress(self, payload: Sequence[tf.Tensor], meta: Any) -> tf.Tensor:
        return self.inner.decompress(payload, meta)

    def combine(self, received: Received, meta: Any) -> tf.Tensor:
        return self.inner.combine(received, meta)

    def codec(self) -> Compressor:
        return self.inner.codec()

    def server_codec(self) -> Compressor:
        return self.inner.server_codec()


#: Optimizer settings of a running mean square the update is divided by: Adam's kin
#: (beta_2), RMSprop and Adadelta (rho), Adagrad (its accumulator).
_MEAN_SQUARE = ("beta_2", "rho", "initial_accumulator_value")


#: Keras' own learning-rate schedules (Keras 3 and tf_keras), each with the settings
#: that are rates: the schedule is linear in them, so scaling them scales every step's
#: rate. The others (decay rates, steps, `alpha`) are factors or counts.
_SCHEDULE_RATES = {
    "ExponentialDecay": ("initial_learning_rate",),
    "InverseTimeDecay": ("initial_learning_rate",),
    "PolynomialDecay": ("initial_learning_rate", "end_learning_rate"),
    "PiecewiseConstantDecay": ("values",),
    "CosineDecay": ("initial_learning_rate", "warmup_target"),
    "CosineDecayRestarts": ("initial_learning_rate",),
}


def _scaled_rate(rate: Any, factor: float) -> Any:
    """An optimizer config's `learning_rate` times `factor`: a number, or a serialized
    Keras schedule (`_SCHEDULE_RATES`) with its rates scaled; None for anything else."""
    if _number(rate):
        return float(rate) * factor
    if not (isinstance(rate, dict) and rate.get("class_name") in _SCHEDULE_RATES
            and isinstance(rate.get("config"), dict)):
        return None
    config = dict(rate["config"])
    for key in _SCHEDULE_RATES[rate["class_name"]]:
        value = config.get(key)
        if isinstance(value, (list, tuple)):
            config[key] = [float(v) * factor for v in value]
        elif _number(value):
            config[key] = float(value) * factor
    return dict(rate, config=config)


def _number(value: Any) -> bool:
    """Whether an optimizer setting is a plain number (not a bool, schedule or tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def weight_decay_change(optimizer: Any, factor: float) -> dict:
    """`{"weight_decay": ...}` keeping Keras' weight decay per step under a rate scaled by
    `factor` (it is decoupled and steps with the rate: w -= w * wd * lr), or {}: no
    decay, no factor, or an optimizer from elsewhere, whose decay may not step with the
    rate (tensorflow_addons' AdamW decays by an absolute amount)."""
    weight_decay = optimizer_config(optimizer).get("weight_decay")
    native = type(optimizer).__module__.split(".")[0] in ("keras", "tf_keras")
    if factor == 1 or not native or not _positive(weight_decay):
        return {}
    return {"weight_decay": weight_decay / factor}


def _positive(value: Any) -> bool:
    """Whether an optimizer setting is a number above 0."""
    return _number(value) and value > 0


#: Attribute `Compressor.adapt_optimizer` sets on the optimizers it builds: an `Adaptation`.
_ADAPTED = "_tf_gradsync_adapted"


@dataclasses.dataclass(frozen=True)
class Adaptation:
    """What `Compressor.adapt_optimizer` did to an optimizer: for which compressor (`by`,
    the repr of the one whose changes they are), the learning-rate `factor`, the other
    config `changes`, and the rate it set where the rate is a number (None for a
    schedule)."""
    by: str
    factor: float
    changes: dict
    learning_rate: float | None


def adaptation(optimizer: Any) -> Adaptation | None:
    """What `adapt_optimizer` did to `optimizer` (the one computing the update, inside a
    loss-scale wrapper), or None for an optimizer it did not build."""
    return getattr(applying_optimizer(optimizer), _ADAPTED, None)


def _warn_steps_lost(optimizer: Any) -> None:
    """Warns that `optimizer`'s steps do not carry over to the copy adapted from it."""
    steps = _tf_compat.optimizer_steps(optimizer)
    if steps:
        warnings.warn(
            f"adapt_optimizer builds a new {type(optimizer).__name__}: the {steps} steps this "
            "one has taken do not carry over (its iterations, which learning-rate schedules "
            "read, restart at 0, and its slots, momentum or moments, start empty); adapt "
            "the optimizer before training or restoring a checkpoint", stacklevel=4)


def check_adapted_rate(optimizer: Any) -> None:
    """Warns when an optimizer `adapt_optimizer` built trains at the rate it was adapted
    from, the uncompressed one, with the rest of the adaptation (momentum off) in place:
    a checkpoint of a run without the adaptation restored into it, or a callback that
    sets absolute rates (`LearningRateScheduler` with a function of the epoch alone),
    wrote the rate variable. Other rates (a relative callback's, a decayed rate resumed)
    are taken as meant. Called when a step is traced, with the rate it starts from."""
    mark = adaptation(optimizer)
    if mark is None or mark.learning_rate is None or mark.factor == 1:
        return
    rate = optimizer_config(optimizer).get("learning_rate")
    if _number(rate) and math.isclose(rate * mark.factor, mark.learning_rate, rel_tol=1e-5):
        kept = f" ({_described(mark.changes)} kept)" if mark.changes else ""
        warnings.warn(OptimizerAdvice(
            f"{type(applying_optimizer(optimizer)).__name__} was adapted for {mark.by} to "
            f"learning rate {mark.learning_rate:.4g} ({mark.factor:.3g}x its own) but trains "
            f"at its own, {rate:.4g}{kept}: a checkpoint of a run without the adaptation "
            "restored after it, or a callback that sets rates (LearningRateScheduler), "
            f"wrote the rate. Set rates {mark.factor:.3g}x what they are uncompressed "
            "(optimizer.learning_rate after a restore, the schedule of the callback)"),
            stacklevel=2)


def _described(changes: dict) -> str:
    """Config changes as `name=value, ...`."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) and v else f"{k}={v}"
                     for k, v in changes.items())


def applying_optimizer(optimizer: Any) -> Any:
    """The optimizer that computes the update: a loss-scale wrapper's inner one
    (`LossScaleOptimizer.inner_optimizer` of Keras 3 and tf_keras, which mixed
    precision puts around the user's), else `optimizer` itself."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def optimizer_config(optimizer: Any) -> dict:
    """The config of the optimizer that computes the update (`applying_optimizer`),
    read eagerly; {} when it has none.

    The optimizer checks run while a step is traced, and the config reads the
    optimizer's variables (the learning rate)."""
    try:
        with tf.init_scope():
            return dict(applying_optimizer(optimizer).get_config())
    except Exception:  # pylint: disable=broad-except
        return {}


def optimizer_momentum(optimizer: Any) -> tuple[str, float]:
    """The name and value of the momentum an optimizer applies: SGD's `momentum`, the
    first-moment decay `beta_1` of Adam and its kin; 0 when none (or unknown)."""
    config = optimizer_config(optimizer)
    for name in ("momentum", "beta_1"):
        value = config.get(name)
        if _positive(value):
            return name, float(value)
    return "momentum", 0.0


def divides_by_rms(optimizer: Any) -> bool:
    """Whether `optimizer` (a Keras optimizer, or a name `tf.keras.optimizers.get`
    knows, such as "adam") divides its update by a running root mean square of the
    gradients (Adam, AdamW, Nadam, Adamax, Lamb, RMSprop, Adagrad, Adadelta).

    Told by its config: a mean-square setting next to the `epsilon` that guards the
    division (Lion has a beta_2 but no division, so no epsilon); Adafactor's factored
    mean square (`beta_2_decay`, `epsilon_1`; under `relative_step`, its default, Keras
    caps the rate at 1/sqrt(step), which a scaled rate meets sooner); Ftrl's accumulator
    under its default `learning_rate_power` of -0.5 (a square root). The factor was
    measured under Adam (`learning_rate_scale`); the others share its division."""
    if isinstance(optimizer, str):
        optimizer = tf.keras.optimizers.get(optimizer)
    config = optimizer_config(optimizer)
    return (("epsilon" in config and any(k in config for k in _MEAN_SQUARE))
            or ("epsilon_1" in config and "beta_2_decay" in config)
            or config.get("learning_rate_power") == -0.5)


def nbytes(tensors: Sequence[tf.Tensor]) -> int:
    """Total bytes of `tensors`, which must have static shapes (payloads always do)."""
    total = 0
    for t in tensors:
        n = t.shape.num_elements()
        if n is None:
            raise ValueError(f"payload tensors need static shapes, got {t.shape}")
        total += n * t.dtype.size
    return total


def replica_id(device: str) -> int:
    """A stable integer for a device string, distinct across the devices of a job."""
    return zlib.crc32(tf.DeviceSpec.from_string(device).to_string().encode()) % (1 << 30)


_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str):
    """Class decorator that makes a compressor available to `get(name)`.

    The class must implement `compress` and `decompress` (or override `rounds`). A
    class defined again under the same module and name (a notebook cell run twice, a
    reloaded module) replaces the one registered before.

    Raises:
      TypeError: without a name (`@register` bare), or for a class that is no
        `Compressor` or lacks its codec.
      ValueError: for a name that another class holds, or a class registered under
        another name.

    Example:
      >>> @register("scaled_sign")
      ... class ScaledSign(Compressor): ...
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register takes the compressor's name, as @register('mine'); "
                        f"got {name!r}")

    def wrap(cls: type[Compressor]) -> type[Compressor]:
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            raise TypeError(f"register({name!r}) decorates a Compressor subclass, got {cls!r}")
        missing = [m for m in ("compress", "decompress")
                   if getattr(cls, m) is getattr(Compressor, m)]
        if missing and cls.rounds is Compressor.rounds and cls.encode is Compressor.encode:
            raise TypeError(f"compressor {name!r} ({cls.__qualname__}) does not implement "
                            f"{' and '.join(missing)}: a one-round compressor implements "
                            "compress and decompress, one of several rounds overrides rounds")
        old = _REGISTRY.get(name)
        if old is not None and old is not cls and (old.__module__, old.__qualname__) != (
                cls.__module__, cls.__qualname__):
            raise ValueError(f"compressor name {name!r} is already registered, to "
                             f"{old.__module__}.{old.__qualname__}")
        own = cls.__dict__.get("name")
        if own and own != name and _REGISTRY.get(own) is cls:
            raise ValueError(f"{cls.__qualname__} is already registered as {own!r}; a class "
                             f"has one name (subclass it to register it as {name!r})")
        if old is not None and old is not cls:
            warnings.warn(f"compressor {name!r} redefined: {cls.__module__}.{cls.__qualname__} "
                          "replaces the class registered before", stacklevel=2)
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def _checked_state_spec(state_spec: Callable) -> Callable:
    """`state_spec` that names the compressor when it returns anything but a mapping of
    names to `StateSpec`s (the state would otherwise fail to build far from it)."""
    @functools.wraps(state_spec)
    def checked(self, layout):
        specs = state_spec(self, layout)
        if not (isinstance(specs, Mapping) and all(
                isinstance(k, str) and isinstance(v, StateSpec) for k, v in specs.items())):
            raise TypeError(f"{type(self).__name__}.state_spec must return a dict of names to "
                            f"StateSpec(shape, dtype[, initializer]), got {specs!r}")
        return specs
    return checked


def check_decoded(compressor: "Compressor", y, x: tf.Tensor) -> None:
    """Raises a ValueError naming `compressor` unless `y`, what it decoded of a bucket
    `x`, has `x`'s shape and dtype (the unpack, the residual and the error measurement
    would otherwise fail far from the compressor, or a gradient come back in another
    dtype)."""
    if not (tf.is_tensor(y) and y.dtype == x.dtype and y.shape.is_compatible_with(x.shape)):
        got = f"{y.dtype.name} {y.shape}" if tf.is_tensor(y) else repr(y)
        raise ValueError(f"{compressor!r} decoded a bucket of {x.dtype.name} {x.shape} into "
                         f"{got}: decompress (or rounds) must give the bucket's shape "
                         "and dtype")


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
        hint = ""
        if isinstance(name, str) and name.split(":")[0] in _REGISTRY:
            hint = (f"; settings go in arguments: compression.get({name.split(':')[0]!r}, "
                    "key=value, ...), as an instance to CompressedAllReduce")
        elif isinstance(name, type) and issubclass(name, Compressor):
            # The class itself, not called: a natural slip when coming from Horovod, whose
            # compressors are classes.
            hint = f"; pass an instance, {name.__name__}(...), or a registered name"
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(names())}{hint}")
    cls = _REGISTRY[name]
    params = [p.name for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"compressor {name!r} got unknown arguments {unknown}; "
                         f"valid arguments: {params or 'none'}")
    return cls(**kwargs)
