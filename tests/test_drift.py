"""Replicas never drift: after every step, every replica and every worker holds
bit-identical weights, including with per-step random and adaptive decisions."""

import json

import numpy as np
import pytest
import tensorflow as tf

import _regression  # tests/_regression.py
import _worker  # tests/_worker.py
import tf_gradsync as gs

STEPS = 15
OPTIONS = {"topk": {"ratio": 0.05}, "randomk": {"ratio": 0.1}, "threshold": {"ratio": 0.05},
           "dgc": {"ratio": 0.05}, "powersgd": {"rank": 2}}


def _cases():
    for name in gs.compression.names():
        yield pytest.param(name, "auto", id=f"{name}-auto")
    for algorithm in ("ring", "tree", "collective"):
        for name in ("randomk", "topk"):
            yield pytest.param(name, algorithm, id=f"{name}-{algorithm}")


@pytest.mark.parametrize("name,algorithm", _cases())
def test_replicas_hold_identical_weights_after_every_step(name, algorithm, devices):
    ops = gs.CompressedAllReduce(gs.compression.get(name, **OPTIONS.get(name, {})),
                                 algorithm=algorithm, bucket_bytes=4096)
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    # dgc applies the momentum itself (and refuses an optimizer that does).
    model, opt = _regression.model_and_optimizer(strategy, 16, 4,
                                                 momentum=0.0 if name == "dgc" else 0.9)
    step = _regression.train_step(strategy, model, opt)

    def per_replica_batch(ctx):   # different data on every replica
        r = ctx.replica_id_in_sync_group
        return (tf.random.stateless_normal([8, 16], [r, step_no]),
                tf.random.stateless_normal([8, 4], [r + 100, step_no]))

    first = None
    for step_no in range(STEPS):
        step(*strategy.experimental_distribute_values_from_function(per_replica_batch))
        for v in model.trainable_variables:
            copies = [c.numpy() for c in v.value.values]   # the Keras variable wraps a MirroredVariable
            assert len(copies) == 4
            for c in copies[1:]:
                np.testing.assert_array_equal(copies[0], c, err_msg=f"{v.name} at step {step_no}")
        if first is None:
            first = [v.numpy() for v in model.trainable_variables]
    assert ops.stats()["steps"] == STEPS
    # It trained: the weights moved.
    assert any(np.abs(a - v.numpy()).max() > 0 for a, v in zip(first, model.trainable_variables))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ("randomk", "adaptive", "qsgd")
                                  if n in gs.compression.names()])
def test_workers_hold_identical_weights_after_every_step(name, tmp_path):
    runs = _worker.launch(tmp_path, f"--compression={name}",
                          f"--options={json.dumps(OPTIONS.get(name, {}))}", f"--steps={STEPS}")
    assert len(runs[0]["fingerprints"]) == STEPS
    for s, (a, b) in enumerate(zip(runs[0]["fingerprints"], runs[1]["fingerprints"])):
        assert a == b, f"workers differ after step {s}"
    assert len(set(runs[0]["fingerprints"])) == STEPS   # weights changed every step
    assert runs[0]["stats"]["compression_ratio"] > 1
