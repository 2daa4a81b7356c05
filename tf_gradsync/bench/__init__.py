"""Benchmarks: `python -m tf_gradsync.bench <suite>` (see `__main__.py`)."""

from __future__ import annotations

#: glibc's malloc told to serve every block from its heap and to keep what is freed: a
#: step's large buffers are then reused, not handed back to the kernel and faulted in
#: again on their next first touch (about 2.4 s per GiB on this project's VMs). Set in
#: the environment of every worker the suites start.
KEEP_BUFFERS_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "10000000000"}


def keep_freed_buffers() -> bool:
    """`KEEP_BUFFERS_ENV` for this process, set through `mallopt` (glibc reads the
    variables only at start). Returns whether it took effect (False off glibc)."""
    import ctypes  # pylint: disable=import-outside-toplevel
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4      # from glibc's malloc.h
    # mallopt takes an int: the largest threshold it can hold, 2 GiB, is as good as never.
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def ops_from_spec(spec: str, **ops_kwargs):
    """Builds a `CompressedAllReduce` from `name` or `name:key=value:...` (values parsed as
    YAML); the keys `error_feedback`, `warmup_steps`, `exchange`, `guard`, `bucket_bytes`,
    `jit_compile` and `sparse_as_dense` go to `CompressedAllReduce`, the others to the
    compressor (e.g. `powersgd:rank=8:start_iter=0`, `sign:exchange=two_phase`).

    Args:
      spec: the compressor and its arguments.
      **ops_kwargs: further arguments of `CompressedAllReduce` (e.g. `timeout_seconds`).

    Raises:
      ValueError: for an unknown name, an argument without `=`, or arguments the
        compressor rejects.

    Example:
      >>> ops_from_spec("sign:error_feedback=false").compressor.name
      'sign'
    """
    import tf_gradsync as gs  # pylint: disable=import-outside-toplevel
    name, kwargs, ops = split_spec(spec)
    return gs.CompressedAllReduce(gs.compression.get(name, **kwargs), **{**ops_kwargs, **ops})


def check_specs(specs, skip=()) -> None:
    """Builds the ops of every spec of a `--compressors` list but those in `skip`.

    Raises:
      ValueError: naming the flag and the spec of the list that is bad.
    """
    for spec in specs:
        if spec not in skip:
            try:
                ops_from_spec(spec)
            except ValueError as e:
                raise ValueError(f"--compressors={spec}: {e}") from None


#: Keys of a spec that go to `CompressedAllReduce` rather than to the compressor.
OPS_KEYS = ("error_feedback", "warmup_steps", "exchange", "guard", "bucket_bytes",
            "jit_compile", "sparse_as_dense")


def split_spec(spec: str) -> tuple[str, dict, dict]:
    """`name:key=value:...` -> `(name, the compressor's arguments, CompressedAllReduce's)`,
    values parsed as YAML; `OPS_KEYS` go to the ops, but for PowerSGD's own
    `error_feedback`.

    Raises:
      ValueError: for an argument without `=`, a key given twice or a value that is
        not YAML.
    """
    from tf_gradsync import config  # pylint: disable=import-outside-toplevel
    name, *args = spec.split(":")
    kwargs = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ValueError(f"bad compressor argument {arg!r} in {spec!r}; "
                             "expected name:key=value[:key=value...]")
        if key in kwargs:
            raise ValueError(f"{key} is given twice in {spec!r}")
        try:
            kwargs[key] = config.load_yaml(value)
        except ValueError:
            raise ValueError(f"{arg!r} in {spec!r}: {value!r} is no YAML value") from None
    ops = {k: kwargs.pop(k) for k in OPS_KEYS
           if k in kwargs and not (k == "error_feedback" and name == "powersgd")}
    return name, kwargs, ops
