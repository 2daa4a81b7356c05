"""Worker of multi-worker tests that `fit` a Keras model under a compressor and write
what they saw to <out>/<case>_<rank>.json:

- `embedding`: one step of a model with an Embedding table; the ops' `stats()`.
- `sequences`: an epoch over sequences of varying lengths (a Dense kernel's gradient
  then has a static shape of [None, n]), then a tensor of a shape known only when it
  runs all-reduced by hand; the stats after each, the reduced tensor and a fingerprint
  of the weights.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_fit_worker.py \
        --out=DIR --case=embedding --compression=SPEC
"""

import argparse
import hashlib
import json
import os

import numpy as np
import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync.bench import ops_from_spec

#: Global batches of the `sequences` case.
BATCHES = 4


def build():
    """Ten ids per example into a 2000 x 8 table, then a Dense layer (as test_plan's)."""
    ids = tf.keras.Input((10,), dtype="int32")
    rows = tf.keras.layers.Embedding(2000, 8, name="emb")(ids)
    return tf.keras.Model(ids, tf.keras.layers.Dense(4)(tf.keras.layers.Flatten()(rows)))


def embedding(strategy, ops) -> dict:
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    x = tf.random.stateless_uniform([16, 10], (1, 2), 0, 2000, tf.int32)
    model.fit(x, tf.zeros([16, 4]), batch_size=16, epochs=1, verbose=0)
    return ops.stats()


def sequences_data() -> tf.data.Dataset:
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


def sequences(strategy, ops) -> dict:
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((None, 8)),
                                     tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(4)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
    model.fit(sequences_data(), epochs=1, verbose=0)
    after_fit = ops.stats()

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def by_hand(rows):
        def fn():
            ones = tf.ones(tf.stack([rows, 5]))     # static shape [None, 5]
            return tf.distribute.get_replica_context().all_reduce("sum", ones)
        return strategy.run(fn)

    reduced = strategy.experimental_local_results(by_hand(tf.constant(6)))[0]
    weights = b"".join(w.tobytes() for w in model.get_weights())
    return {"after_fit": after_fit, "after_hand": ops.stats(),
            "reduced": reduced.numpy().tolist(),
            "weights": hashlib.sha256(weights).hexdigest()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, choices=["embedding", "sequences"])
    parser.add_argument("--compression", required=True)
    args = parser.parse_args()
    ops = ops_from_spec(args.compression, timeout_seconds=60)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    result = {"embedding": embedding, "sequences": sequences}[args.case](strategy, ops)
    with open(os.path.join(args.out, f"{args.case}_{strategy.worker_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
