"""Step time on a simulated cluster: each worker in its own network namespace behind a
rate-limited link (see `netns`), stock MultiWorkerMirroredStrategy against ours.

Per (workers, rate): a probing job (the cost model's measurements of the link and of
each compressor's throughput), the compute-only floor (the same step with no
communication, on N concurrent processes, since they share the cores and memory
bandwidth), stock, then each compressor, then the link probed again; each row carries
the cost model's prediction of its step (`predicted_s`) next to the measured one, and
a breakdown of the measured step (`breakdown`: compute, codec, wire, waiting). Workers run
`tf_gradsync.bench.multiworker`'s worker with a TF_CONFIG of namespace addresses and
read their link's kernel tx counter around the timed steps. `autotune` among the
compressors adds a last row whose ops `tf_gradsync.autotune` chooses among the others;
`vs_best` is each row's step over the fastest compressor row's. Since that fastest row
is the luckiest of many single jobs, `--rematch=R` then runs the fastest row's mode and
autotune again, alternating, R jobs each, and gives autotune's row `rematch` (their
steps) and `vs_best_rematch` (the ratio of their medians): a comparison of equals.
Needs root. Everything created (namespaces, links, bridge, processes) is removed on
return, on error, on SIGINT/SIGTERM and at exit; leftovers of a killed run are removed
at the next start.

    python -m tf_gradsync.bench cluster --cluster_workers=2,4 --rate=100mbit,1gbit
"""

from __future__ import annotations

import atexit
import io
import json
import os
import signal
import statistics
import sys
from typing import Sequence

import numpy as np
from absl import flags

from tf_gradsync import launch
from tf_gradsync.algorithms import cost
from tf_gradsync.bench import KEEP_BUFFERS_ENV, multiworker, netns, ops_from_spec

flags.DEFINE_list("cluster_workers", ["2", "4"], "cluster: worker counts.")
flags.DEFINE_list("rate", ["1gbit"], "cluster: link rates, tc style (100mbit, 1gbit, 10gbit).")
flags.DEFINE_string("delay", None, "cluster: one-way latency added to each link (needs netem).")
flags.DEFINE_integer("cluster_timeout", 900, "cluster: seconds one run may take.", lower_bound=1)
flags.DEFINE_integer("rematch", 0, "cluster: with autotune, jobs of the fastest compressor row's "
                     "mode and of autotune run again, alternating, each this many times.",
                     lower_bound=0)
FLAGS = flags.FLAGS

#: PowerSGD built without its dense warm-up, as in the sittings BENCHMARKS.md records
#: (every row starts past its warm-up, so plain `powersgd` would time the steady state too).
DEFAULT_COMPRESSORS = ("none", "fp16", "int8", "sign", "topk", "powersgd:start_iter=0")
PLOT = ("mode", "speedup", "speed-up vs stock MWMS", "setup")
#: With --png, also `<png>_predicted.png`: the cost model's step against the measured one.
SCATTER = ("step_s", "predicted_s", "mode")
COLUMNS = ["setup", "workers", "rate", "mode", "exchange", "step_s", "speedup", "vs_compute",
           "compute_s", "codec_s", "wire_s", "waiting_s", "predicted_s", "prediction_error",
           "pick", "vs_best", "vs_best_rematch", "items_per_s", "stats_bytes", "wire_bytes",
           "wire_vs_stats", "ring_bound", "wire_vs_bound", "cores", "load"]
_PORT = 20000   # every namespace has its own ports, so all workers can use the same one
_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", **KEEP_BUFFERS_ENV}
_live: list[netns.Network] = []   # to remove if the run is cut short (also kills workers)


def run() -> tuple[list[dict], list[str]]:
    """The suite: every (workers, rate), rows as described in the module docstring.

    Exits with a message (status 1) for a bad flag, a missing privilege, or a delay
    this kernel cannot apply.
    """
    try:
        workers, rates, modes = _validate()
    except (ValueError, PermissionError, RuntimeError) as e:
        sys.exit(f"[bench] cluster: {e}")
    for name in netns.cleanup_stale():
        _log(f"removed {name}, left behind by an earlier run")
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    atexit.register(_cleanup)
    try:
        rows = []
        for n in workers:
            for rate in rates:
                rows += measure(n, rate, modes, FLAGS.params, FLAGS.steps, FLAGS.delay,
                                FLAGS.cluster_timeout, FLAGS.model, FLAGS.image_size,
                                FLAGS.rematch)
        return rows, COLUMNS
    finally:
        _cleanup()
        for s, h in old.items():
            signal.signal(s, h)


def measure(n: int, rate: str, modes: Sequence[str], params: int, steps: int,
            delay: str | None = None, timeout: float = 900, model: str = "dense",
            image_size: int = 224, rematch: int = 0) -> list[dict]:
    """Rows for one network: compute-only, stock, then each of `modes` (compressors).

    Args:
      n: workers.
      rate: link rate of every worker, tc style.
      modes: compressor specs, and "autotune" for a row whose ops `tf_gradsync.autotune`
        chooses among theirs (run last; its `decision` and `vs_best`, its step over
        the fastest of theirs, in the row).
      params: model parameters.
      steps: timed steps per run.
      delay: one-way link latency (needs netem), or None.
      timeout: seconds each run may take before its workers are stopped.
      model: a name of `models.NAMES` (`params` sizes the dense one).
      image_size: resnet50's input size.
      rematch: with autotune, jobs of the fastest compressor row's mode and of
        autotune run again, alternating, each this many times (`rematch_jobs`).

    Returns:
      One dict per mode with the keys of `COLUMNS`, and `params`.

    Raises:
      RuntimeError: if a run fails or times out (with the workers' last output).
    """
    cores = launch.cores()     # as the launcher shares them out among the workers
    load = os.getloadavg()[0]
    _log(f"{n} workers at {rate}: {cores} CPU cores shared by {n} workers (load average "
         f"{load:.1f} before starting); step times include that contention")
    rows = []
    # autotune chooses among the other rows' compressors, after them.
    order = [m for m in modes if m != multiworker.AUTOTUNE]
    names = [m.split(":")[0] for m in order]
    tune = [multiworker.AUTOTUNE] if multiworker.AUTOTUNE in modes else []
    with netns.Network(n, rate, delay) as net:
        _live.append(net)
        probes = _job(net, "probe", params, steps, timeout, model, image_size,
                      [f"--probe_modes={','.join(['none', *order])}",
                       f"--probe_numel={min(params, 25_000_000)}"])
        specs = None
        for mode in ["compute", "stock", *order, *tune]:
            extra = ([f"--candidates={','.join(dict.fromkeys(names))}"]
                     if mode == multiworker.AUTOTUNE and names else [])
            ranks = _job(net, mode, params, steps, timeout, model, image_size, extra)
            decision = ranks[0].get("decision")
            specs = specs or ranks[0]["specs"]
            row = {"workers": n, "rate": rate, "setup": f"{n} workers, {rate}",
                   "mode": {"compute": "compute-only", "stock": "stock MWMS"}.get(mode, mode),
                   "params": ranks[0]["params"], "cores": f"{cores}/{n}", "load": load,
                   "model": model, "items_per_s": sum(r["items_per_s"] for r in ranks) / n,
                   "unit": ranks[0]["unit"], "exchange": None,
                   "step_s": _step_s(ranks),
                   "wire_bytes": round(sum(r["tx_bytes_per_step"] for r in ranks) / n)}
            dense = 4 * ranks[0]["dense_params"]
            if mode == "stock":
                row["ring_bound"] = 2 * (n - 1) * dense // n
            elif mode != "compute":
                row["stats_bytes"] = ranks[0]["bytes_per_step"]
                payload = ranks[0]["payload_bytes"]
                server = ranks[0]["server_payload_bytes"]
                # Summable payloads: a ring all-reduce; others: a ring all-gather, or
                # (N-1)/N of the payload out and of the owners' re-compression back.
                ops = ops_from_spec(decision["compressor"] if decision else mode)
                if decision:
                    two = decision["exchange"] == "two_phase"
                else:   # what the model's largest bucket takes (the dense models have one)
                    import tensorflow as tf  # pylint: disable=import-outside-toplevel
                    from tf_gradsync.bucketing import plan_buckets  # pylint: disable=C0415
                    buckets = plan_buckets([(tuple(s), tf.as_dtype(d)) for s, d in specs],
                                           ops.bucket_bytes).buckets
                    largest = max(buckets, key=lambda b: b.numel).layout
                    two = ops.bucket_exchange(largest, n, across_workers=True) == "two_phase"
                summable = ops.compressor.summable
                row["exchange"] = ("all-reduce" if summable else
                                   "two-phase" if two else "gather")
                if decision:
                    row.update(mode=f"autotune: {decision['compressor']}", decision=decision)
                row["ring_bound"] = (2 * (n - 1) * payload // n if summable
                                     else (n - 1) * (payload + server) // n if two
                                     else (n - 1) * payload)
                row["wire_vs_stats"] = row["wire_bytes"] / max(row["stats_bytes"], 1)
            if "ring_bound" in row:
                row["wire_vs_bound"] = row["wire_bytes"] / max(row["ring_bound"], 1)
            rows.append(row)
            _log(f"{n} workers at {rate}, {row['mode']}: {row['step_s']:.3f} s/step, "
                 f"{row['wire_bytes']:,.0f} B/step on the wire")
        # The link probed again after the rows: a job's conditions on shared cores move
        # the probe by up to a quarter, so the link is priced as the rows' span saw it.
        link_probes = _job(net, "probe", params, steps, timeout, model, image_size)
        if tune and order and rematch > 0:
            def job(mode, extra):
                return _job(net, mode, params, steps, timeout, model, image_size, extra)
            rematch_jobs(rows, rematch, job, [f"--candidates={','.join(dict.fromkeys(names))}"])
        _live.remove(net)
    stock, compute = rows[1]["step_s"], rows[0]["step_s"]
    for row in rows:
        row["speedup"] = stock / row["step_s"]
        row["vs_compute"] = row["step_s"] / compute
    predict(rows, probes, specs, n, link_probes)
    # What the prediction was made from, so that a JSON can be predicted again
    # (`predict(rows, rows[0]["probes"], rows[0]["specs"], n, rows[0]["link_probes"])`)
    # under another model.
    rows[0].update(probes=probes, specs=specs, link_probes=link_probes)
    breakdown(rows, cost.parse_bandwidth(rate))
    return rows


def rematch_jobs(rows: list[dict], times: int, job, autotune_extra: Sequence[str]) -> None:
    """Times the fastest compressor row's mode and autotune again, alternately, `times`
    jobs each, and adds to autotune's row (the last) `rematch`, `{"best": mode,
    "best_s": [...], "autotune_s": [...], "autotune_picks": [...]}`, and
    `vs_best_rematch`, the median of autotune's steps over the median of the best's.

    The fastest of many rows, each one job, is the fastest of as many draws of the
    spread between jobs (10-30% on shared cores), so `vs_best` against it is biased
    against any single job; jobs of both run alternately are a comparison of equals.

    Args:
      rows: compute-only, stock, the compressor rows, autotune's row last.
      times: jobs of each.
      job: `job(mode, extra_flags)` runs one job: each rank's result dict.
      autotune_extra: autotune's job's flags.
    """
    best = min(rows[2:-1], key=lambda r: r["step_s"])["mode"]
    found: dict[str, list] = {"best_s": [], "autotune_s": [], "autotune_picks": []}
    for _ in range(times):
        for mode, key, extra in ((best, "best_s", ()),
                                 (multiworker.AUTOTUNE, "autotune_s", autotune_extra)):
            ranks = job(mode, extra)
            found[key].append(_step_s(ranks))
            _log(f"rematch, {mode}: {found[key][-1]:.3f} s/step")
        found["autotune_picks"].append(ranks[0]["decision"]["compressor"])  # autotune's job
    rows[-1]["rematch"] = dict(best=best, **found)
    rows[-1]["vs_best_rematch"] = (statistics.median(found["autotune_s"])
                                   / statistics.median(found["best_s"]))


def _step_s(ranks: list[dict]) -> float:
    """A job's step: its workers' median steps, averaged."""
    return sum(r["median_s"] for r in ranks) / len(ranks)


def breakdown(rows: list[dict], bytes_per_s: float) -> None:
    """Splits each measured step into where its time goes, all from this sitting:

    compute_s: the compute-only row's step;
    codec_s: compression and decoding (pack to unpack) at the throughput the probe
      measured (each worker alone, the cores' sharing charged), for this model's buckets
      and exchange (as the cost model prices it; 0 for stock, which sends the gradients
      as they are);
    wire_s: the bytes the kernel counted on the worker's link, at the link's rate;
    waiting_s: the rest: latency, waiting for the slowest peer, framework overhead,
      minus whatever ran overlapped (it can be negative when overlap hides more).
    """
    compute = rows[0]["step_s"]
    for row in rows:
        row["compute_s"] = compute
        row["codec_s"] = row.get("codec_s", 0.0)
        row["wire_s"] = row["wire_bytes"] / bytes_per_s
        row["waiting_s"] = row["step_s"] - row["compute_s"] - row["codec_s"] - row["wire_s"]


def predict(rows: list[dict], probes: list[dict], specs: list, n: int,
            link_probes: Sequence[dict] = ()) -> None:
    """Adds the cost model's `predicted_s` (and `prediction_error`, predicted over
    measured minus one) to the stock and compressor rows, and marks with `pick` the
    compressor row it predicts fastest (what `autotune` would choose among them).

    Its inputs are measured in the same sitting: the link fitted to the probing
    all-reduces and all-to-all (`autotuning.fit_link`), averaged over `probes` (before
    the rows) and `link_probes` (each rank's link-only probe after them), each
    compressor's data path timed by each worker alone on one core, as a rate and
    seconds per call (the cores' sharing among the N workers charged as the model's
    `cpu_share`, cores / N; older probes timed a rate alone, on all of a worker's
    threads, or by all workers at once, and are taken as they are), and the
    compute-only row's step as compute.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_gradsync import autotuning, costmodel  # pylint: disable=import-outside-toplevel
    linked = [*probes, *link_probes]
    seconds = np.mean([p["probe_s"] for p in linked], axis=0)
    # Probes from before the all-to-all was timed price its rounds at one latency.
    all_to_all = (float(np.mean([p["all_to_all_s"] for p in linked]))
                  if "all_to_all_s" in probes[0] else None)
    link = autotuning.fit_link(probes[0]["probe_bytes"], seconds, n, all_to_all)
    # One core's rates, where the probe timed them (the workers of the runs share the
    # cores, so none has TensorFlow's threads spread over several).
    key = "throughput_one_core" if probes[0].get("throughput_one_core") else "throughput"
    rates = {m: sum(p[key][m] for p in probes) / n for m in probes[0][key]}
    calls = {m: sum(p.get("call_s_one_core", {}).get(m, 0.0) for p in probes) / n
             for m in rates}
    specs = [(tuple(shape), tf.as_dtype(dtype)) for shape, dtype in specs]
    compute = rows[0]["step_s"]
    cores = int(str(rows[0].get("cores", n)).split("/")[0])
    share = min(1.0, cores / n) if probes[0].get("alone") else 1.0
    kinds = {"all-reduce": "ring", "two-phase": "two_phase", "gather": "gather", None: "ring"}
    for row in rows[1:]:
        decision = row.get("decision")
        spec = ("none" if row["mode"] == "stock MWMS" else
                decision["compressor"] if decision else row["mode"])
        ops = ops_from_spec(spec)
        bucket_bytes = decision["bucket_bytes"] if decision else ops.bucket_bytes
        payloads = costmodel.model_payloads(ops.compressor, specs, bucket_bytes, n)
        # autotune's pick is a plain name: the rate of the probed spec it names.
        probed = spec if spec in rates else next(
            (m for m in rates if m.split(":")[0] == spec), None)
        p = costmodel.predict(ops.compressor, payloads, kinds[row["exchange"]], n, link, compute,
                              rates.get(probed), cpu_share=share, jit_compile=ops.jit_compile,
                              call_s=calls.get(probed, 0.0))
        row["predicted_s"] = p.step_s
        row["codec_s"] = p.codec_s if row["mode"] != "stock MWMS" else 0.0
        row["prediction_error"] = p.step_s / row["step_s"] - 1
        row["link"] = [link.latency_s, link.bytes_per_s, link.round_s]
        row["pick"] = ""
    ours = [r for r in rows[2:] if "decision" not in r]
    if ours:
        min(ours, key=lambda r: r["predicted_s"])["pick"] = "*"
        # Each step over the fastest compressor row's: how far the model's pick, and
        # autotune's (the model's few fastest, timed on the job), are from the best.
        fastest = min(r["step_s"] for r in ours)
        for row in rows[1:]:
            row["vs_best"] = row["step_s"] / fastest


def _job(net: netns.Network, mode: str, params: int, steps: int, timeout: float,
         model: str = "dense", image_size: int = 224, extra: Sequence[str] = ()) -> list[dict]:
    """Runs one mode on every worker of `net`; each rank's result dict, by rank."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(_ENV, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    n = len(net.namespaces)
    configs = launch.tf_configs([f"{a}:{_PORT}" for a in net.addresses])
    cmd = ["-m", "tf_gradsync.bench.multiworker", f"--mode={mode}", f"--params={params}",
           f"--steps={steps}", f"--batch={multiworker.batch_size(model)}",
           f"--ifname={net.interface}", f"--model={model}", f"--image_size={image_size}", *extra]
    _log(f"{' '.join(cmd[1:])} on {n} namespaces")
    out = io.StringIO()
    job = launch.Job(cmd, configs, grace_seconds=5, out=out,
                     prefixes=[net.exec_prefix(i) for i in range(n)], env=env)
    try:
        code = job.wait(timeout)
    except TimeoutError as e:
        raise RuntimeError(f"{mode}: {e}\n{out.getvalue()[-3000:]}") from None
    finally:
        job.stop()   # a no-op once all exited; otherwise (e.g. on a signal) stops them
    if code:
        raise RuntimeError(f"{mode} failed with exit code {code}:\n{out.getvalue()[-3000:]}")
    results = {}
    for line in out.getvalue().splitlines():
        rank, _, rest = line.partition("] RESULT ")
        if rest:
            results[int(rank.lstrip("["))] = json.loads(rest)
    if sorted(results) != list(range(n)):
        raise RuntimeError(f"{mode}: results from ranks {sorted(results)} of {n}:\n"
                           f"{out.getvalue()[-3000:]}")
    return [results[r] for r in range(n)]


def _validate() -> tuple[list[int], list[str], list[str]]:
    """Checks every flag and the environment before anything is created."""
    workers = []
    for w in FLAGS.cluster_workers:
        if not w.isdigit() or not 2 <= int(w) <= 250:
            raise ValueError(f"--cluster_workers: bad value {w!r}; give integers in [2, 250]")
        workers.append(int(w))
    for r in FLAGS.rate:
        try:
            netns.parse_rate(r)
        except ValueError as e:
            raise ValueError(f"--rate: {e}") from None
    modes = list(FLAGS.compressors or DEFAULT_COMPRESSORS)
    for m in modes:
        if m != multiworker.AUTOTUNE:
            ops_from_spec(m)   # ValueError naming the valid compressors
    if FLAGS.params < 1 or FLAGS.steps < 1:
        raise ValueError(f"--params and --steps must be >= 1, got {FLAGS.params}, {FLAGS.steps}")
    netns.check_privileges()
    if FLAGS.delay is not None:
        netns.check_delay(FLAGS.delay)
    return workers, list(FLAGS.rate), modes


def _on_signal(signum, frame) -> None:
    # Ignore repeats so that the clean-up the exit unwinds into is not cut short.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    _log(f"got signal {signum}; stopping workers and removing the network")
    raise SystemExit(128 + signum)


def _cleanup() -> None:
    """Removes every live network and kills what runs in it (idempotent)."""
    while _live:
        _live.pop().teardown()


def _log(msg: str) -> None:
    print(f"[bench] cluster: {msg}", file=sys.stderr, flush=True)
