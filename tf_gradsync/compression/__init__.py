"""Gradient compressors, looked up by name with `get(name, **kwargs)`."""

from tf_gradsync.compression.base import (GATHER, SCATTER, SUM, Adaptation, Compressor, Context,
                                          Layout, Message, OptimizerAdvice, OptimizerRefused,
                                          StateSpec, Wrapper, adaptation, get, names, nbytes,
                                          register)
from tf_gradsync.compression import driver, two_phase
# Importing the modules registers their compressors.
from tf_gradsync.compression.none import NoCompression
from tf_gradsync.compression.adaptive import Adaptive
from tf_gradsync.compression.cast import BFloat16, Float16
from tf_gradsync.compression.dgc import DGC
from tf_gradsync.compression.error_feedback import ErrorFeedback, with_error_feedback
from tf_gradsync.compression.guard import Guard
from tf_gradsync.compression.int8 import Int8
from tf_gradsync.compression.onebit import OneBit
from tf_gradsync.compression.powersgd import PowerSGD
from tf_gradsync.compression.qsgd import QSGD
from tf_gradsync.compression.randomk import RandomK
from tf_gradsync.compression.sign import Sign
from tf_gradsync.compression.terngrad import TernGrad
from tf_gradsync.compression.threshold import Threshold
from tf_gradsync.compression.topk import TopK
from tf_gradsync.compression.warmup import Warmup

__all__ = [
    "Adaptation", "Adaptive", "BFloat16", "Compressor", "Context", "DGC", "ErrorFeedback",
    "Float16", "GATHER", "Guard", "Int8", "Layout", "Message", "NoCompression", "OneBit",
    "OptimizerAdvice", "OptimizerRefused", "PowerSGD", "QSGD", "RandomK", "SCATTER", "SUM",
    "Sign", "StateSpec", "TernGrad", "Threshold", "TopK", "Warmup", "Wrapper", "adaptation",
    "driver", "get", "names", "nbytes", "register", "two_phase", "with_error_feedback",
]
