"""Step time of a large model on N local workers: stock MultiWorkerMirroredStrategy
against tf_gradsync.MultiWorkerMirroredStrategy, each run started by the launcher.

Worker entry point (also used by the `cluster` suite):
`python -m tf_gradsync.bench.multiworker --mode=stock|compute|autotune|<compressor>
[--ifname=IF]`,
or `--mode=probe --probe_modes=fp16,topk` for the cost model's measurements.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Sequence

import numpy as np
from absl import flags

from tf_gradsync.bench import KEEP_BUFFERS_ENV, models, ops_from_spec

flags.DEFINE_integer("workers", 2, "multiworker: number of local workers.", lower_bound=1)
flags.DEFINE_integer("params", 25_000_000, "multiworker, cluster: model parameters.", lower_bound=1)
flags.DEFINE_integer("steps", 10, "multiworker, cluster: timed steps per run.", lower_bound=1)
flags.DEFINE_enum("model", "dense", list(models.NAMES),
                  "multiworker, cluster: dense (--params weights in one layer), mlp (in "
                  "four), resnet50 or transformer.")
flags.DEFINE_integer("batch", None, "multiworker, cluster: examples per worker and step "
                     "(default: 16; resnet50 8, transformer 8 sequences).", lower_bound=1)
flags.DEFINE_integer("image_size", 224, "multiworker, cluster: resnet50 image size.", lower_bound=1)
FLAGS = flags.FLAGS
#: The mode whose ops `tf_gradsync.autotune` chooses.
AUTOTUNE = "autotune"
#: Figure (see figure.py): step time relative to stock.
PLOT = ("mode", "vs_stock", "step time / stock")


def probe(modes: list[str], numel: int) -> dict:
    """A probing job's part (the cost model's measurements, on the cluster of the runs):
    exact all-reduces of `autotuning.PROBE_BYTES` through TensorFlow's
    collectives (seconds each), an all-to-all of tiny parts as two phases run it
    (`autotuning.probe_all_to_all`), and each mode's bucket data path on `numel`
    elements and an eighth of that (`plan.calibrate_codecs`), timed by each worker in
    its turn while the others wait, on one core: its rate (`throughput_one_core`) and
    its seconds per call (`call_s_one_core`), which the cost model scales by the cores
    each worker gets in the runs (`costmodel.predict`'s `cpu_share`). Timed all at
    once, unsynchronised, a worker's calls met the others' tracing or timing by chance:
    the same compressor's rate moved 2-3x between sittings. With no `modes`, the link
    alone."""
    import tensorflow as tf
    import tf_gradsync as gs
    from tf_gradsync import autotuning, plan
    tf.get_logger().setLevel("ERROR")
    strategy = gs.MultiWorkerMirroredStrategy()
    seconds = autotuning.probe_link(strategy)
    all_to_all = autotuning.probe_all_to_all(strategy, timeout=60)
    rates = calls = None
    for turn in range(strategy.num_workers if modes else 0):
        _barrier(strategy)
        if turn == strategy.worker_index:
            with _one_core():
                rates, calls = plan.calibrate_codecs(modes, numel)
    _barrier(strategy)
    return {"mode": "probe", "probe_bytes": list(autotuning.PROBE_BYTES), "probe_s": seconds,
            "all_to_all_s": all_to_all, "throughput_one_core": rates, "call_s_one_core": calls,
            "alone": True}


@contextlib.contextmanager
def _one_core():
    """Runs the block with every thread of this process on one core (the first it may
    use), as when the workers of a run share the cores: TensorFlow's thread pools
    otherwise spread a lone worker's ops over cores it will not have to itself."""
    allowed = os.sched_getaffinity(0)

    def pin(cpus):
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), cpus)
            except OSError:     # the thread has ended
                pass
    pin({min(allowed)})
    try:
        yield
    finally:
        pin(allowed)


def _barrier(strategy) -> None:
    """Returns once every worker has called it (an exact all-reduce of one number)."""
    import tensorflow as tf
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(0.0)), axis=None).numpy()


def worker(mode: str, params: int, steps: int, batch: int, ifname: str | None = None,
           model: str = "dense", image_size: int = 224,
           candidates: Sequence[str] | None = None) -> dict:
    """One worker's part of a run: a model of `models` on synthetic data.

    Args:
      mode: "stock" (tf.distribute.MultiWorkerMirroredStrategy), "compute" (the same
        step with no communication at all), "autotune" (ours, with the ops
        `tf_gradsync.autotune` chooses among `candidates`), or a compressor spec (ours;
        see `tf_gradsync.bench.ops_from_spec`).
      params: model parameters (a square Dense layer, so rounded to a square).
      steps: timed steps, after one untimed step that traces and warms up.
      batch: examples per step.
      ifname: a network interface whose kernel tx counter is read around the timed
        steps (e.g. the worker's link inside its network namespace).
      model: a name of `models.NAMES`.
      image_size: resnet50's input size.
      candidates: "autotune": compressor names to choose from (default: every one).

    Returns:
      `mode`, `model`, `params`, `median_s`, `items_per_s` (images, tokens or examples
      per second over all workers) and `unit`; with `ifname`, `tx_bytes_per_step`; for ours,
      `bytes_per_step` (`last_bytes_sent` of `ops.stats()`), `payload_bytes` (the
      payload tensors of one step's buckets, all rounds) and `server_payload_bytes`
      (the same with the codec owners re-compress with in two phases); for
      "autotune", `decision`: what it chose, predicted and measured in its trials.
    """
    import tensorflow as tf
    import tf_gradsync as gs
    from tf_gradsync import _tf_compat, costmodel
    tf.get_logger().setLevel("ERROR")
    ops, barrier = None, None
    if mode == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif mode == "compute":
        strategy = tf.distribute.get_strategy()
        # The step communicates nothing; a multi-worker strategy only lines the workers
        # up before timing, so that they compute at the same time (the contention for
        # cores and memory bandwidth is part of the floor being measured).
        if "TF_CONFIG" in os.environ:
            barrier = tf.distribute.MultiWorkerMirroredStrategy()
    elif mode == AUTOTUNE:
        strategy = gs.MultiWorkerMirroredStrategy()
    else:
        ops = ops_from_spec(mode)
        strategy = gs.MultiWorkerMirroredStrategy(cross_device_ops=ops)
    with strategy.scope():
        work = models.build(model, batch, params, image_size)
    decision = None
    if mode == AUTOTUNE:
        # The trials time the job's own training step, each with the optimizer its ops
        # adapt (which keeps SGD's momentum for some compressors and not for others).
        ops = gs.autotune(strategy, work.model, compute=work.compute_step(strategy),
                          make_step=lambda trial: work.train_step(strategy,
                                                                  _optimizer(strategy, trial)),
                          accuracy="aggressive", compressors=candidates, timeout_seconds=300)
        d = ops.decision
        decision = {"compressor": d.compressor, "exchange": d.exchange,
                    "bucket_bytes": d.bucket_bytes, "predicted_step_s": d.predicted_step_s,
                    "measured_step_s": d.measured_step_s, "trials": d.trials,
                    "runoff": d.runoff, "ops": repr(ops.compressor)}   # guarded or not
    if ops is not None:     # every row times its steady state, past any warm-up
        ops.start_at_step(costmodel.STEADY_STEP)
    net, step = work.model, work.train_step(strategy, _optimizer(strategy, ops))

    step().numpy()
    if barrier is not None:
        _barrier(barrier)
    tx_start = _tx_bytes(ifname)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    workers = strategy.num_replicas_in_sync if barrier is None else barrier.num_replicas_in_sync
    trainable = list(net.trainable_variables)
    # Embedding tables get IndexedSlices gradients, which are gathered, not bucketed.
    dense = _tf_compat.dense_gradient_weights(net)
    out = {"mode": mode, "model": model, "median_s": median,
           "params": sum(int(np.prod(v.shape)) for v in trainable),
           # What a bucketed all-reduce carries: embedding tables' gradients are sparse.
           "dense_params": sum(int(np.prod(v.shape)) for v in dense),
           "items_per_s": work.items * workers / median, "unit": work.unit}
    if ifname:
        out["tx_bytes_per_step"] = (_tx_bytes(ifname) - tx_start) / steps
    specs = [(v.shape, v.dtype) for v in dense]
    out["specs"] = [[list(map(int, sh)), tf.as_dtype(dt).name] for sh, dt in specs]
    if ops is not None:
        out["bytes_per_step"] = ops.stats()["last_bytes_sent"]
        out["payload_bytes"] = payload_bytes(ops.compressor, specs, ops.bucket_bytes)
        # What owners send back in two phases (int8 for the one-bit compressors).
        out["server_payload_bytes"] = payload_bytes(ops.compressor.server_codec(), specs,
                                                    ops.bucket_bytes)
    if decision is not None:
        out["decision"] = decision
    return out


def _optimizer(strategy, ops=None):
    """The jobs' SGD with momentum 0.9, adapted to `ops` as users do (dgc, for one,
    brings its own momentum)."""
    import tensorflow as tf
    with strategy.scope():
        opt = tf.keras.optimizers.SGD(1e-3, momentum=0.9)
        return opt if ops is None else ops.adapt_optimizer(opt)


def payload_bytes(compressor, specs, bucket_bytes: int) -> int:
    """Bytes of the payload tensors one replica produces for gradients of `specs`.

    Computed apart from the pipeline's counters, from the tensors the compressor builds
    for each bucket of the same plan (every round, for multi-round compressors), past
    any warm-up (`costmodel.model_payloads`).
    """
    from tf_gradsync import costmodel
    return sum(n for b in costmodel.model_payloads(compressor, specs, bucket_bytes, 1)
               for _, n in b.rounds)


def _tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def run() -> tuple[list[dict], list[str]]:
    """The suite: stock, then each of --compressors (default none, fp16), as ratios."""
    modes = ["stock", *(FLAGS.compressors or ["none", "fp16"])]
    rows = run_jobs(modes, FLAGS.workers, FLAGS.params, FLAGS.steps, batch_size(FLAGS.model),
                    FLAGS.model, FLAGS.image_size)
    for r in rows:
        r["vs_stock"] = r["median_s"] / rows[0]["median_s"]
    return rows, ["mode", "model", "params", "median_s", "vs_stock", "items_per_s", "unit",
                  "bytes_per_step"]


def batch_size(model: str) -> int:
    """--batch, or the default per model."""
    if FLAGS.batch is not None:
        return FLAGS.batch
    return {"dense": 16, "mlp": 16}.get(model, 8)


def run_jobs(modes, workers: int, params: int, steps: int, batch: int, model: str = "dense",
             image_size: int = 224) -> list[dict]:
    """Runs each mode as a separate job, one after the other; returns rank 0's results."""
    rows = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **KEEP_BUFFERS_ENV)
    for mode in modes:
        cmd = [sys.executable, "-m", "tf_gradsync.launch", f"--num_workers={workers}", "--",
               "-m", "tf_gradsync.bench.multiworker", f"--mode={mode}", f"--params={params}",
               f"--steps={steps}", f"--batch={batch}", f"--model={model}",
               f"--image_size={image_size}"]
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
    p.add_argument("--ifname", default=None)
    p.add_argument("--model", default="dense", choices=models.NAMES)
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--probe_modes", default="", help="probe: compressor specs, comma-separated")
    p.add_argument("--probe_numel", type=int, default=4_000_000)
    p.add_argument("--candidates", default="",
                   help="autotune: compressor names to choose from (default: every one)")
    a = p.parse_args()
    if a.mode == "probe":
        result = probe([m for m in a.probe_modes.split(",") if m], a.probe_numel)
    else:
        result = worker(a.mode, a.params, a.steps, a.batch, a.ifname, a.model, a.image_size,
                        [c for c in a.candidates.split(",") if c] or None)
    print("RESULT " + json.dumps(result), flush=True)
