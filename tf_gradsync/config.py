"""YAML presets -> a ready `CompressedAllReduce`.

A preset looks like::

    compression: topk
    compression_options: {ratio: 0.01}
    error_feedback: true
    bucket_bytes: 4194304
    algorithm: auto

Files are read with `yaml.safe_load`: no Python objects are ever constructed from input.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tf_gradsync import algorithms, compression

#: Buckets of about one large layer: each bucket's exchange starts as soon as its own
#: gradients exist (BENCHMARKS.md, timeline: one host 1.04x ReductionToOneDevice
#: against 1.41x with 32 MiB buckets, ResNet-50 on two workers 8% faster).
DEFAULT_BUCKET_BYTES = 4 * 2**20

#: Where the presets live: installed with the package, or configs/ of a source checkout.
_PRESET_DIRS = (Path(__file__).parent / "configs", Path(__file__).parent.parent / "configs")


def presets() -> list[str]:
    """Names of the presets shipped with the package (`load_config("fp16")`)."""
    return sorted({p.stem for d in _PRESET_DIRS if d.is_dir() for p in d.glob("*.yaml")})


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Validated settings of a `CompressedAllReduce` (see its arguments).

    Raises:
      ValueError: for an unknown compressor or algorithm, compressor options it does not
        take or accept, or a value outside its range; the message names the bad value
        and what is allowed.
    """

    compression: str = "none"
    compression_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    error_feedback: bool | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    algorithm: str = "auto"
    exchange: str = "auto"
    timeout_seconds: float | None = None
    warmup_steps: int = 0
    measure_error: bool = True
    guard: bool = False
    jit_compile: bool = True
    sparse_as_dense: bool = False

    def __post_init__(self):
        if self.compression not in compression.names():
            raise ValueError(f"unknown compression {self.compression!r}; valid names: "
                             f"{', '.join(compression.names())}")
        if not isinstance(self.compression_options, Mapping) or not all(
                isinstance(k, str) for k in self.compression_options):
            raise ValueError(f"compression_options must be a mapping of argument names to "
                             f"values, got {self.compression_options!r}")
        # Built once here so that a bad option fails when the preset is read, not later
        # when the ops are created; compressors are plain Python objects, cheap to build.
        try:
            built = compression.get(self.compression, **dict(self.compression_options))
        except ValueError as e:
            raise ValueError(f"compression_options of {self.compression}: {e}") from None
        compression.with_error_feedback(built, self.error_feedback if isinstance(
            self.error_feedback, bool) else None)
        check_settings(error_feedback=self.error_feedback, bucket_bytes=self.bucket_bytes,
                       algorithm=self.algorithm, exchange=self.exchange,
                       timeout_seconds=self.timeout_seconds, warmup_steps=self.warmup_steps,
                       measure_error=self.measure_error, guard=self.guard,
                       jit_compile=self.jit_compile, sparse_as_dense=self.sparse_as_dense)

    def build(self):
        """Returns a `CompressedAllReduce` with these settings."""
        from tf_gradsync.cross_device_ops import CompressedAllReduce
        return CompressedAllReduce(
            compression.get(self.compression, **dict(self.compression_options)),
            error_feedback=self.error_feedback, bucket_bytes=self.bucket_bytes,
            algorithm=self.algorithm, exchange=self.exchange,
            timeout_seconds=self.timeout_seconds, warmup_steps=self.warmup_steps,
            measure_error=self.measure_error, guard=self.guard, jit_compile=self.jit_compile,
            sparse_as_dense=self.sparse_as_dense)


def check_seconds(name: str, value) -> None:
    """Raises ValueError unless `value`, the setting `name`, is a positive, finite number
    of seconds or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not 0 < value < math.inf):
        raise ValueError(f"{name} must be a positive, finite number of seconds or None (null "
                         f"in YAML), got {value!r}")


def check_bucket_bytes(bucket_bytes) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) \
            or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")


def check_settings(*, error_feedback=None, bucket_bytes=DEFAULT_BUCKET_BYTES, algorithm="auto",
                   exchange="auto", timeout_seconds=None, warmup_steps=0,
                   measure_error=True, guard=False, jit_compile=True,
                   sparse_as_dense=False) -> None:
    """The checks of every setting of a `CompressedAllReduce` but the compressor: the
    one place they live, for the constructor and for presets alike.

    Raises:
      ValueError: naming the bad value and what is allowed.
    """
    if not (error_feedback is None or isinstance(error_feedback, (bool, np.bool_))):
        raise ValueError(f"error_feedback must be True, False or None (true, false or null "
                         f"in YAML), got {error_feedback!r}")
    check_bucket_bytes(bucket_bytes)
    algorithms.validate(algorithm)
    algorithms.validate_exchange(exchange)
    if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral)
            or warmup_steps < 0):
        raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
    check_seconds("timeout_seconds", timeout_seconds)
    for name, value in (("measure_error", measure_error), ("guard", guard),
                        ("jit_compile", jit_compile), ("sparse_as_dense", sparse_as_dense)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if guard and exchange == "two_phase":
        raise ValueError("guard=True watches each bucket's error whole, but "
                         "exchange='two_phase' cuts buckets into chunks; use exchange='auto' "
                         "or 'gather' with the guard, or guard=False")


def parse_config(source: str | os.PathLike | Mapping[str, Any]) -> SyncConfig:
    """Reads and validates a preset (a YAML path or a mapping).

    Args:
      source: path of a YAML file, or a mapping with the same keys.

    Returns:
      The validated `SyncConfig`.

    Raises:
      ValueError: for a source that is neither a path nor a mapping, a folder, a file
        that is not UTF-8 text, YAML that does not parse (or asks for Python objects:
        files are read with `yaml.safe_load`), an empty file or one without
        `compression`, a key given twice, unknown keys (listing the valid ones) or bad
        values; a file's errors start with its path (a folder's name it).
      FileNotFoundError: for a missing file that names no shipped preset (the message
        lists them).
    """
    if isinstance(source, Mapping):
        return _validated(dict(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"a preset is a YAML path or a mapping, got {source!r}")
    path = _preset_or(os.fspath(source))
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f.read())
        if data is None:
            raise ValueError("the preset is empty; give at least `compression: NAME`")
        if not isinstance(data, dict):
            raise ValueError(f"a preset must be a YAML mapping, got {type(data).__name__}")
        # A file is a preset of one compressor: none is not assumed.
        return _validated(data, named=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})"
                         ) from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _preset_or(path: str) -> str:
    """`path`, or the shipped preset it names when no such file exists: "fp16", or
    "configs/fp16.yaml" as a source checkout has it, from anywhere."""
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a folder; give a preset's YAML file or the name of a "
                         f"shipped preset: {', '.join(presets())}")
    if os.path.exists(path):
        return path
    name = Path(path).name.removesuffix(".yaml")
    if Path(path).parent.name in ("", "configs"):
        for d in _PRESET_DIRS:
            if (d / f"{name}.yaml").is_file():
                return str(d / f"{name}.yaml")
    raise FileNotFoundError(f"no preset file {path!r}; the shipped presets, by name: "
                            f"{', '.join(presets())}")


def _validated(data: dict, named: bool = False) -> SyncConfig:
    """`data` as a `SyncConfig`; with `named`, it must name its compressor (after
    unknown keys are refused: a misspelt `compression` is named as such)."""
    valid = [f.name for f in dataclasses.fields(SyncConfig)]
    unknown = sorted(set(data) - set(valid), key=str)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(valid)}")
    if named and "compression" not in data:
        raise ValueError(f"the preset names no compressor; give `compression: NAME` "
                         f"(valid names: {', '.join(compression.names())})")
    return SyncConfig(**data)


def load_yaml(text: str):
    """`yaml.safe_load`, refusing a key given twice in one mapping (YAML keeps the last
    one silently), and reading `1e-3` as a number (YAML 1.1, PyYAML's, wants a dot:
    `1.0e-3`; it read the small ratios users write as strings).

    Raises:
      ValueError: for text that does not parse, or a key given twice.
    """
    import yaml  # pylint: disable=import-outside-toplevel  (~20 ms; only for files)

    class Loader(yaml.SafeLoader):     # pylint: disable=too-many-ancestors
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
                                 list("-+0123456789."))

    def mapping(loader, node, deep=False):
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"key {twice[0]!r} is given twice (line {node.start_mark.line + 1})")
        return loader.construct_mapping(node, deep)
    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    loader = Loader(text)                           # a SafeLoader: no Python objects
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ValueError(f"not a valid YAML preset (plain YAML mappings only): {e}") from None
    finally:
        loader.dispose()


def load_config(source: str | os.PathLike | Mapping[str, Any]):
    """Loads a preset and returns a ready `CompressedAllReduce`.

    Args:
      source: path of a YAML file, the name of a shipped preset (`presets()`: "fp16",
        "topk-1pct", ...; "configs/fp16.yaml" finds it too) or an equivalent mapping
        (the constructor's arguments, where `compression` defaults to "none" as in
        `CompressedAllReduce`; a file must name it).

    Returns:
      A configured `tf_gradsync.CompressedAllReduce`.

    Example:
      >>> ops = tf_gradsync.load_config("fp16")
    """
    return parse_config(source).build()
