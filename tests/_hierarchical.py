"""Worker of the hierarchical-exchange test: two logical CPU devices per worker, each
replica's values from a seed of its global member index, reduced through the ops of a
`tf_gradsync.MultiWorkerMirroredStrategy` for several compressor settings; writes, to
<out>/worker_<rank>.json, every result per step and the ops' bytes.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_hierarchical.py --out=DIR \
        --modes=fp16:auto,sign:two_phase --steps=3
"""

import argparse
import json
import os

import numpy as np

import tf_gradsync as gs

#: Two kernels and a vector: buckets of several tensors, a chunk boundary inside one.
SHAPES = ((64, 32), (32,), (300,))
LOCAL = 2


def values(member: int, step: int) -> list[np.ndarray]:
    """Member `member`'s values at `step` (the test computes the same)."""
    return [np.random.default_rng([member, step, k]).standard_normal(s).astype(np.float32)
            for k, s in enumerate(SHAPES)]


def reduce_fn(ops, devices):
    """A tf.function: per device a list of arrays -> per value, the means per device."""
    import tensorflow as tf
    from tf_gradsync import _tf_compat

    @tf.function
    def fn(per_device):
        placed = []
        for arrays, d in zip(per_device, devices):
            with tf.device(d):      # the values' devices tell the ops where replicas live
                placed.append([tf.identity(a) for a in arrays])
        pairs = [(_tf_compat.per_replica(list(v)), _tf_compat.per_replica(list(v)))
                 for v in zip(*placed)]
        return [list(m.values) for m in ops.batch_reduce(tf.distribute.ReduceOp.MEAN, pairs)]
    return fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--modes", required=True, help="compressor:exchange,...")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    gs.logical_cpus(LOCAL)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    runs = {}
    strategy = None
    for mode in a.modes.split(","):
        name, exchange = mode.split(":")
        ops = gs.CompressedAllReduce(name, exchange=exchange, timeout_seconds=60)
        if strategy is None:
            strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
        else:
            strategy.use_cross_device_ops(ops)
        devices = [f"/job:worker/replica:0/task:{rank}/device:CPU:{i}" for i in range(LOCAL)]
        fn = reduce_fn(ops, devices)
        results = []
        for step in range(a.steps):
            got = fn([values(rank * LOCAL + i, step) for i in range(LOCAL)])
            results.append([[t.numpy().tolist() for t in per_value] for per_value in got])
        runs[mode] = {"results": results, "bytes": ops.stats()["last_bytes_sent"]}
    with open(os.path.join(a.out, f"worker_{rank}.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
