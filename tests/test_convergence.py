"""Every registered compressor trains digits to within 2 points of uncompressed training."""

import pytest
import tensorflow as tf

import tf_gradsync as gs
import train_digits  # examples/train_digits.py

EPOCHS = 30


@pytest.fixture(scope="module")
def data():
    return train_digits.load_data(0)


@pytest.fixture(scope="module")
def baseline(data, devices_module):
    ops = gs.CompressedAllReduce("none")
    strategy = tf.distribute.MirroredStrategy(devices_module, cross_device_ops=ops)
    return train_digits.train(strategy, tf.keras, EPOCHS, 64, data=data)[1]


@pytest.fixture(scope="module")
def devices_module():
    return [f"/cpu:{i}" for i in range(4)]


# Settings for this 17k-parameter model: the library defaults, except where a default
# sized for large models is too aggressive here (random-k at 1% has 100x the variance of
# the gradient; PowerSGD's rank is per bucket, and this model is one bucket).
SETTINGS = {"randomk": {"ratio": 0.25}, "powersgd": {"rank": 16}}
KNOWN_GAPS = {
    "dgc": "DGC's momentum correction assumes SGD momentum; under Adam it ends ~4 points lower",
}


def cases():
    for name in gs.compression.names():
        if name == "none":
            continue
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name])] if name in KNOWN_GAPS else []
        yield pytest.param(name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("name", cases())
def test_compressor_converges_like_uncompressed(name, data, baseline, devices_module):
    # Biased compressors get error feedback by default.
    ops = gs.CompressedAllReduce(gs.compression.get(name, **SETTINGS.get(name, {})))
    strategy = tf.distribute.MirroredStrategy(devices_module, cross_device_ops=ops)
    _, acc = train_digits.train(strategy, tf.keras, EPOCHS, 64, data=data)
    stats = ops.stats()
    assert stats["compression_ratio"] > 1.0
    assert acc >= baseline - 0.02, (name, acc, baseline, stats["compression_ratio"])
