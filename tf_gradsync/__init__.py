"""tf_gradsync: compressed, bucketed gradient synchronisation for tf.distribute."""

from tf_gradsync import algorithms, compression
from tf_gradsync.autotuning import autotune
from tf_gradsync.bucketing import BucketPlan, plan_buckets
from tf_gradsync.checkpoint import track_state
from tf_gradsync.config import SyncConfig, load_config, parse_config
from tf_gradsync.devices import logical_cpus
from tf_gradsync.cross_device_ops import CompressedAllReduce
from tf_gradsync.strategy import MultiWorkerMirroredStrategy

__version__ = "0.1.0"

#: Submodules imported on first access (`gs.callbacks.CommunicationMonitor`, as Keras
#: users write `keras.callbacks.X`): they pull in Keras, which `import tf_gradsync`
#: itself does not need.
_LAZY = ("callbacks",)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # pylint: disable=import-outside-toplevel
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    "track_state",
]
