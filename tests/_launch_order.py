"""Worker of a multi-worker test: two all-reduces with tokens of their own, which the two
workers launch in opposite orders (each holds back a different one for a second). Writes
both sums to <out>/order_<rank>.json.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_launch_order.py --out=DIR
"""

import argparse
import json
import os
import time

import tensorflow as tf

import tf_gradsync as gs
from tf_gradsync import _tf_compat
from tf_gradsync.algorithms import collective

FIRST_KEY = 0x6A6000   # far from the keys the library allocates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = gs.MultiWorkerMirroredStrategy()
    device = strategy.extended.worker_devices[0]
    gkey = collective.group_key(("launch order test",))

    def held_back(x):
        def sleep(v):
            time.sleep(1.0)
            return v
        return tf.py_function(sleep, [x], x.dtype)

    @tf.function
    def both():
        sums = []
        for i, name in enumerate("ab"):
            x = tf.constant([float(rank + 1), 10.0 * (i + 1)])
            # Worker 0 holds back b, worker 1 holds back a: opposite launch orders.
            if i != rank:
                x = held_back(x)
            with tf.device(device), collective.ordered_apart(name):
                sums.append(_tf_compat.collective_all_reduce(
                    x, 2, gkey, FIRST_KEY + i, collective.ordering_token(device), timeout=30))
        return sums

    a, b = both()
    with open(os.path.join(args.out, f"order_{rank}.json"), "w") as f:
        json.dump({"a": a.numpy().tolist(), "b": b.numpy().tolist()}, f)


if __name__ == "__main__":
    main()
