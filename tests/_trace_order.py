"""Worker of a multi-worker test: two step functions over tensors of different shapes,
traced in opposite orders on the two workers, then a third one retraced on worker 1
alone (a Python argument of its own), all reduced through the compressed exchanges.
Writes every result to <out>/trace_<rank>.json.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_trace_order.py --out=DIR \
        --compression=NAME
"""

import argparse
import json
import os

import tensorflow as tf

import tf_gradsync as gs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compression", required=True)
    parser.add_argument("--exchange", default="auto")
    args = parser.parse_args()
    ops = gs.CompressedAllReduce(args.compression, exchange=args.exchange, timeout_seconds=60)
    strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    rank = strategy.worker_index

    def reducer(shape):
        @tf.function
        def step(scale):
            def fn():
                x = tf.reshape(tf.range(tf.reduce_prod(shape), dtype=tf.float32), shape)
                x = (x + 1.0) * float(rank + 1) * scale
                return tf.distribute.get_replica_context().all_reduce("SUM", x)
            return strategy.experimental_local_results(strategy.run(fn))[0]
        return step

    f, g, h = reducer([64]), reducer([16, 3]), reducer([40])
    # Traced in opposite orders: worker 0 f then g, worker 1 g then f.
    for fn in ([f, g] if rank == 0 else [g, f]):
        fn.get_concrete_function(1.0)
    out = {"f": f(1.0).numpy().tolist(), "g": g(1.0).numpy().tolist()}
    h(1.0)
    # Worker 1 alone traces h again (another Python argument), while worker 0 runs the
    # trace it has.
    out["h"] = h(1.0 if rank == 0 else 2.0).numpy().tolist()
    with open(os.path.join(args.out, f"trace_{rank}.json"), "w") as f_out:
        json.dump(out, f_out)


if __name__ == "__main__":
    main()
