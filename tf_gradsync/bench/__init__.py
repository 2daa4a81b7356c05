"""Benchmarks: `python -m tf_gradsync.bench <suite>` (see `__main__.py`)."""

from __future__ import annotations


def ops_from_spec(spec: str, **ops_kwargs):
    """Builds a `CompressedAllReduce` from `name` or `name:key=value:...` (values parsed as
    YAML); the keys `error_feedback`, `warmup_steps`, `exchange`, `guard`, `bucket_bytes` and
    `jit_compile` go to `CompressedAllReduce`, the others to the compressor (e.g.
    `powersgd:rank=8:start_iter=0`, `sign:exchange=two_phase`).

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
    import yaml  # pylint: disable=import-outside-toplevel
    import tf_gradsync as gs  # pylint: disable=import-outside-toplevel
    name, *args = spec.split(":")
    kwargs = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ValueError(f"bad compressor argument {arg!r} in {spec!r}; "
                             "expected name:key=value[:key=value...]")
        kwargs[key] = yaml.safe_load(value)
    # PowerSGD's own error_feedback argument belongs to the compressor.
    error_feedback = kwargs.pop("error_feedback", None) if name != "powersgd" else None
    for key in ("warmup_steps", "exchange", "guard", "bucket_bytes", "jit_compile"):
        if key in kwargs:
            ops_kwargs[key] = kwargs.pop(key)
    return gs.CompressedAllReduce(gs.compression.get(name, **kwargs),
                                  error_feedback=error_feedback, **ops_kwargs)
