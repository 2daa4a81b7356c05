"""Splitting one host's CPU into several logical devices (for tests, examples, benches)."""

from __future__ import annotations

import numbers

import tensorflow as tf


def logical_cpus(n: int) -> list[str]:
    """Configures `n` logical CPU devices and returns their names.

    Must run before TensorFlow initialises its devices (before the first op); calling
    it again with the same `n` is harmless.

    Raises:
      ValueError: if `n` is not an integer >= 1.
      RuntimeError: if TensorFlow already initialised a different device layout.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"need an integer count of logical CPU devices >= 1, got {n!r}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise RuntimeError(
                f"TensorFlow already initialised {have} CPU devices; call logical_cpus({n}) "
                "before running any TensorFlow op") from None
    return [f"/cpu:{i}" for i in range(n)]
