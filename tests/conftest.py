"""Test set-up: four logical CPU devices, configured before TensorFlow initialises."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gradsync as gs  # noqa: E402

DEVICES = gs.logical_cpus(4)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
tf.get_logger().setLevel("ERROR")


@pytest.fixture
def devices():
    return list(DEVICES)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end training runs (minutes, still run in CI)")
    # The suite has a time budget: every run reports its slowest tests.
    if not config.option.durations:
        config.option.durations = 25
