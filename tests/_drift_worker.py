"""Worker of tests/test_drift.py: trains a small model with a custom loop under
tf_gradsync.MultiWorkerMirroredStrategy and writes a fingerprint of the weights after
every step (the exact bytes, hashed) to <out>/fingerprints_<rank>.json."""

import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

import _regression  # tests/_regression.py, next to this script
import tf_gradsync as gs


def main(out: str, compression: str, options: str, steps: int) -> None:
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    ops = gs.CompressedAllReduce(gs.compression.get(compression, **json.loads(options)))
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    model, opt = _regression.model_and_optimizer(strategy, 16, 4)
    step = _regression.train_step(strategy, model, opt)
    rng = np.random.default_rng(100 + rank)   # each worker sees different data

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
