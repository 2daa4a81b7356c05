"""Worker of tests/test_drift.py: trains a small model with a custom loop under
tf_gradsync.MultiWorkerMirroredStrategy and writes a fingerprint of the weights after
every step (the exact bytes, hashed) to <out>/fingerprints_<rank>.json."""

import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_gradsync as gs


def main(out: str, compression: str, options: str, steps: int) -> None:
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    ops = gs.CompressedAllReduce(gs.compression.get(compression, **json.loads(options)))
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(64, "tanh"),
                                     tf.keras.layers.Dense(4)])
        opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    rng = np.random.default_rng(100 + rank)   # each worker sees different data

    @tf.function
    def step(bx, by):
        def fn(bx, by):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(bx) - by) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(fn, (bx, by))

    prints = []
    for _ in range(steps):
        step(tf.constant(rng.normal(size=(8, 16)), tf.float32),
             tf.constant(rng.normal(size=(8, 4)), tf.float32))
        digest = hashlib.sha256()
        for w in model.get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
        prints.append(digest.hexdigest())
    with open(os.path.join(out, f"fingerprints_{rank}.json"), "w") as f:
        json.dump({"fingerprints": prints, "stats": ops.stats()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
