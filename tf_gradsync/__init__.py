"""tf_gradsync: compressed, bucketed gradient synchronisation for tf.distribute.

The public names load on first use: importing the package (as `python -m
tf_gradsync.launch` does before it starts the workers) does not import TensorFlow,
which takes about ten seconds on a small machine.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

#: Public name -> (module, attribute in it; None for the module itself).
_EXPORTS = {
    "BucketPlan": ("tf_gradsync.bucketing", "BucketPlan"),
    "CompressedAllReduce": ("tf_gradsync.cross_device_ops", "CompressedAllReduce"),
    "MultiWorkerMirroredStrategy": ("tf_gradsync.strategy", "MultiWorkerMirroredStrategy"),
    "SyncConfig": ("tf_gradsync.config", "SyncConfig"),
    "algorithms": ("tf_gradsync.algorithms", None),
    "autotune": ("tf_gradsync.autotuning", "autotune"),
    "callbacks": ("tf_gradsync.callbacks", None),
    "compression": ("tf_gradsync.compression", None),
    "load_config": ("tf_gradsync.config", "load_config"),
    "logical_cpus": ("tf_gradsync.devices", "logical_cpus"),
    "parse_config": ("tf_gradsync.config", "parse_config"),
    "plan_buckets": ("tf_gradsync.bucketing", "plan_buckets"),
    "presets": ("tf_gradsync.config", "presets"),
    "track_state": ("tf_gradsync.checkpoint", "track_state"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")   # other submodules
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BucketPlan",
    "CompressedAllReduce",
    "MultiWorkerMirroredStrategy",
    "SyncConfig",
    "algorithms",
    "autotune",
    "callbacks",
    "compression",
    "load_config",
    "logical_cpus",
    "parse_config",
    "plan_buckets",
    "presets",
    "track_state",
]
