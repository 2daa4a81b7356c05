"""Step time of a large model on N local workers: stock MultiWorkerMirroredStrategy
against tf_gradsync.MultiWorkerMirroredStrategy, each run started by the launcher.

Worker entry point: `python -m tf_gradsync.bench.multiworker --mode=stock|<compressor>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import flags

flags.DEFINE_integer("workers", 2, "multiworker: number of local workers.")
flags.DEFINE_integer("params", 25_000_000, "multiworker: model parameters.")
flags.DEFINE_integer("steps", 10, "multiworker: timed steps per run.")
FLAGS = flags.FLAGS


def worker(mode: str, params: int, steps: int, batch: int) -> dict:
    import tensorflow as tf
    import tf_gradsync as gs
    tf.get_logger().setLevel("ERROR")
    ops = None if mode == "stock" else gs.CompressedAllReduce(mode)
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if mode == "stock"
                else gs.MultiWorkerMirroredStrategy(cross_device_ops=ops))
    width = int(np.sqrt(params))
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((width,)), tf.keras.layers.Dense(width)])
        opt = tf.keras.optimizers.SGD(1e-3)
    x = tf.random.stateless_normal([batch, width], (1, 2))

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(fn), axis=None)

    step().numpy()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    out = {"mode": mode, "params": model.count_params(), "median_s": float(np.median(times))}
    if ops is not None:
        out["bytes_per_step"] = ops.stats()["last_bytes_sent"]
    return out


def run() -> tuple[list[dict], list[str]]:
    """The suite: stock, then each of --compressors (default none, fp16), as ratios."""
    modes = ["stock", *(FLAGS.compressors or ["none", "fp16"])]
    rows = run_jobs(modes, FLAGS.workers, FLAGS.params, FLAGS.steps, 16)
    for r in rows:
        r["vs_stock"] = r["median_s"] / rows[0]["median_s"]
    return rows, ["mode", "params", "median_s", "vs_stock", "bytes_per_step"]


def run_jobs(modes, workers: int, params: int, steps: int, batch: int) -> list[dict]:
    """Runs each mode as a separate job, one after the other; returns rank 0's results."""
    rows = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="10000000000")
    for mode in modes:
        cmd = [sys.executable, "-m", "tf_gradsync.launch", f"--num_workers={workers}", "--",
               "-m", "tf_gradsync.bench.multiworker", f"--mode={mode}", f"--params={params}",
               f"--steps={steps}", f"--batch={batch}"]
        print(f"[bench] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"{mode} failed:\n{out.stdout[-3000:]}")
        line = [l for l in out.stdout.splitlines() if l.startswith("[0] RESULT ")][-1]
        rows.append(json.loads(line[len("[0] RESULT "):]))
    return rows


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--params", type=int, default=25_000_000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    print("RESULT " + json.dumps(worker(a.mode, a.params, a.steps, a.batch)), flush=True)
