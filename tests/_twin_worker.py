"""Worker of a multi-worker test: twin reductions of one shape in one step (a second
model whose gradient is zero) and a loss all-reduced by hand, three steps, under
tf_gradsync.MultiWorkerMirroredStrategy with top-k; writes <out>/worker_<rank>.json.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_twin_worker.py OUT
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_gradsync as gs


def main(out: str) -> None:
    ops = gs.CompressedAllReduce("topk", timeout_seconds=60)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    rank = strategy.cluster_resolver.task_id

    @tf.function
    def step(seed):
        def fn():
            ctx = tf.distribute.get_replica_context()
            g = tf.random.stateless_normal([64, 50], [seed, rank])
            first = ctx.all_reduce("SUM", [g, g[0]])
            second = ctx.all_reduce("SUM", [tf.zeros_like(g), tf.zeros_like(g[0])])
            loss = ctx.all_reduce("SUM", tf.reduce_sum(g))
            return first, second, loss
        return strategy.run(fn)

    steps = []
    for seed in range(3):
        first, second, loss = step(tf.constant(seed))
        steps.append({"first": first[0].numpy().tolist(),
                      "second": float(np.abs(second[0].numpy()).sum()
                                      + np.abs(second[1].numpy()).sum()),
                      "loss": float(loss.numpy()),
                      "own_loss": float(tf.reduce_sum(
                          tf.random.stateless_normal([64, 50], [seed, rank])).numpy())})
    with open(os.path.join(out, f"worker_{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": steps, "synchronisations": ops.stats()["steps"]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
