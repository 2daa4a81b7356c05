"""Gradient compressors, looked up by name with `get(name, **kwargs)`."""

from tf_gradsync.compression.base import (Compressor, Context, RoundCompressor, StateSpec, get, names,
                                          nbytes, register)
# Importing the modules registers their compressors.
from tf_gradsync.compression.none import NoCompression
from tf_gradsync.compression.cast import BFloat16, Float16

__all__ = [
    "BFloat16", "Compressor", "Context", "Float16", "NoCompression", "RoundCompressor", "StateSpec",
    "get", "names", "nbytes", "register",
]
