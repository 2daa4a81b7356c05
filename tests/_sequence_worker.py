"""Worker of a multi-worker test: `fit` on sequences of varying lengths (a Dense
kernel's gradient then has a static shape of [None, n]) under a compressor, then a
tensor of a shape known only when it runs all-reduced by hand; writes the stats after
each, the reduced tensor and a fingerprint of the weights to <out>/sequence_<rank>.json.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_sequence_worker.py \
        --out=DIR --compression=SPEC
"""

import argparse
import hashlib
import json
import os

import numpy as np
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync.bench import ops_from_spec

BATCHES = 4


def sequences() -> tf.data.Dataset:
    """BATCHES global batches of 8 sequences of 3 to 6 steps (a generator: Keras does not
    know the count, and meets the end of the data in a call of its own)."""
    def generate():
        rng = np.random.default_rng(0)
        for i in range(BATCHES):
            steps = 3 + i
            yield (rng.standard_normal((8, steps, 8)).astype("float32"),
                   rng.standard_normal((8, steps, 4)).astype("float32"))
    data = tf.data.Dataset.from_generator(generate, output_signature=(
        tf.TensorSpec((None, None, 8)), tf.TensorSpec((None, None, 4))))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return data.with_options(options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compression", required=True)
    args = parser.parse_args()
    ops = ops_from_spec(args.compression, timeout_seconds=60)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((None, 8)),
                                     tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(4)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
    model.fit(sequences(), epochs=1, verbose=0)
    after_fit = ops.stats()

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def by_hand(rows):
        def fn():
            ones = tf.ones(tf.stack([rows, 5]))     # static shape [None, 5]
            return tf.distribute.get_replica_context().all_reduce("sum", ones)
        return strategy.run(fn)

    reduced = strategy.experimental_local_results(by_hand(tf.constant(6)))[0]
    weights = b"".join(w.tobytes() for w in model.get_weights())
    with open(os.path.join(args.out, f"sequence_{strategy.worker_index}.json"), "w") as f:
        json.dump({"after_fit": after_fit, "after_hand": ops.stats(),
                   "reduced": reduced.numpy().tolist(),
                   "weights": hashlib.sha256(weights).hexdigest()}, f)


if __name__ == "__main__":
    main()
