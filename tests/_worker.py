"""Worker of the multi-worker tests: trains a small regression model with a custom loop
under tf_gradsync.MultiWorkerMirroredStrategy and writes, to <out>/worker_<rank>.json,
a fingerprint of the weights (their exact bytes, hashed) after every step, the final
weights and the ops' statistics. Optionally resumes from and saves a tf.train.Checkpoint
that holds the model, the optimizer and the ops' compression state.

    python -m tf_gradsync.launch --num_workers=2 -- tests/_worker.py --out=DIR \
        --compression=topk --options='{"ratio": 0.05}' --steps=30 [--first_step=N]
        [--exchange=two_phase] [--rank1_compression=fp16]
        [--restore=PREFIX] [--save=DIR]

With --compression=autotune the ops come from `tf_gradsync.autotune` (each worker
reports a different compute time; the decision is written out too).
"""

import argparse
import hashlib
import io
import json
import os

import numpy as np
import tensorflow as tf

import _regression  # tests/_regression.py, next to this script
from _multiworker import ROOT, run_launcher
import tf_gradsync as gs
from tf_gradsync import launch as gs_launch


def launch(out, *args, workers: int = 2, chief: bool = False) -> list[dict]:
    """Runs this script on `workers` local workers (from a test); returns their results
    in TensorFlow's order. With `chief`, the first task is a chief (the rest workers
    0, 1, ...), as in TF_CONFIGs written for Keras."""
    script = [os.path.abspath(__file__), f"--out={out}", *args]
    if not chief:
        proc, _ = run_launcher(script[0], workers, *script[1:], timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    else:
        addresses = [f"127.0.0.1:{p}" for p in gs_launch.free_ports(workers)]
        cluster = {"chief": addresses[:1], "worker": addresses[1:]}
        configs = [{"cluster": cluster, "task": {"type": t, "index": i}}
                   for t, i in [("chief", 0)] + [("worker", i) for i in range(workers - 1)]]
        log = io.StringIO()
        job = gs_launch.Job(script, configs, grace_seconds=3, out=log,
                            env={"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert job.wait(timeout=300) == 0, log.getvalue()[-6000:]
    return [json.loads(open(os.path.join(out, f"worker_{r}.json")).read()) for r in range(workers)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--compression", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--exchange", default="auto")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--first_step", type=int, default=0)
    p.add_argument("--restore", default=None, help="checkpoint prefix; {rank} is replaced")
    p.add_argument("--save", default=None, help="checkpoint directory; {rank} is replaced")
    p.add_argument("--rank1_compression", default=None, help="task 1's compressor instead")
    a = p.parse_args()
    if a.rank1_compression and json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        a.compression, a.options = a.rank1_compression, "{}"
    decision = None
    if a.compression == "autotune":
        strategy = gs.MultiWorkerMirroredStrategy()
        rank = strategy.worker_index
        model, opt = _regression.model_and_optimizer(strategy, 16, 4)
        ops = gs.autotune(strategy, model, compute=0.001 * (rank + 1), accuracy="aggressive",
                          calibrate_numel=20_000, **json.loads(a.options))
        with strategy.scope():    # what the pick trains best with (DGC drops momentum)
            opt = ops.adapt_optimizer(opt)
        decision = {k: v for k, v in vars(ops.decision).items() if k != "link"}
        link = ops.decision.link
        decision["link"] = [link.latency_s, link.bytes_per_s, link.round_s]
    elif a.compression == "stock":      # only to meet a worker of other ops at the start
        gs.MultiWorkerMirroredStrategy()
        raise SystemExit("a worker without ops met workers that agree with it")
    else:
        ops = gs.CompressedAllReduce(gs.compression.get(a.compression, **json.loads(a.options)),
                                     exchange=a.exchange)
        strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
        rank = strategy.worker_index
        model, opt = _regression.model_and_optimizer(strategy, 16, 4)
    step = _regression.train_step(strategy, model, opt)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, gradsync=ops)
    if a.restore:
        ckpt.restore(a.restore.format(rank=rank))

    prints = []
    for s in range(a.first_step, a.first_step + a.steps):
        rng = np.random.default_rng([rank, s])   # each worker and step: its own data
        step(tf.constant(rng.normal(size=(8, 16)), tf.float32),
             tf.constant(rng.normal(size=(8, 4)), tf.float32))
        digest = hashlib.sha256()
        for w in model.get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
        prints.append(digest.hexdigest())
    if a.save:
        ckpt.write(os.path.join(a.save.format(rank=rank), "ckpt"))
    with open(os.path.join(a.out, f"worker_{rank}.json"), "w") as f:
        json.dump({"fingerprints": prints, "stats": ops.stats(), "decision": decision,
                   "weights": [w.tolist() for w in model.get_weights()]}, f)


if __name__ == "__main__":
    main()
