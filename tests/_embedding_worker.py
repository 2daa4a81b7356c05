"""Worker of a multi-worker test: one `fit` step of a model with an Embedding table
under a compressor, then its `stats()` to <out>/embedding_<rank>.json.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_embedding_worker.py \
        --out=DIR --compression=SPEC
"""

import argparse
import json
import os

import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync.bench import ops_from_spec


def build():
    """Ten ids per example into a 2000 x 8 table, then a Dense layer (as test_plan's)."""
    ids = tf.keras.Input((10,), dtype="int32")
    rows = tf.keras.layers.Embedding(2000, 8, name="emb")(ids)
    return tf.keras.Model(ids, tf.keras.layers.Dense(4)(tf.keras.layers.Flatten()(rows)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compression", required=True)
    args = parser.parse_args()
    ops = ops_from_spec(args.compression, timeout_seconds=60)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    x = tf.random.stateless_uniform([16, 10], (1, 2), 0, 2000, tf.int32)
    model.fit(x, tf.zeros([16, 4]), batch_size=16, epochs=1, verbose=0)
    with open(os.path.join(args.out, f"embedding_{strategy.worker_index}.json"), "w") as f:
        json.dump(ops.stats(), f)


if __name__ == "__main__":
    main()
