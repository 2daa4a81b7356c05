"""Helpers for tests that start local multi-worker jobs through tf_gradsync.launch."""

import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multiworker_digits.py")
PARAMS = (64 * 128 + 128) + (128 * 64 + 64) + (64 * 10 + 10)   # the digits MLP


def launch(tmp_path, workers, *args, env=None, timeout=600, launcher_args=()):
    """Runs examples/multiworker_digits.py on `workers` local workers.

    Args:
      tmp_path: directory for the workers' output (`out/` below it).
      workers: number of workers.
      *args: flags of the example.
      env: extra environment variables.
      timeout: seconds before the launcher itself is killed.
      launcher_args: flags of the launcher (before `--`).

    Returns:
      `(completed process, output directory, seconds taken)`.
    """
    out = tmp_path / "out"
    proc, seconds = run_launcher(EXAMPLE, workers, f"--out={out}", *args, env=env,
                                 timeout=timeout, launcher_args=launcher_args)
    return proc, out, seconds


def run_launcher(script, workers, *args, env=None, timeout=600, launcher_args=()):
    """Runs `script` with `args` on `workers` local workers through tf_gradsync.launch.

    Returns:
      `(completed process, seconds taken)`.
    """
    cmd = [sys.executable, "-m", "tf_gradsync.launch", f"--num_workers={workers}",
           "--grace_seconds=3", *launcher_args, "--", str(script), *args]
    full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    start = time.monotonic()
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def results(out, workers):
    """Per worker: the final weights (list of arrays) and the result JSON."""
    weights = [list(np.load(out / f"weights_{r}.npz").values()) for r in range(workers)]
    res = [json.loads((out / f"result_{r}.json").read_text()) for r in range(workers)]
    return weights, res


def assert_same_weights(weights):
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_array_equal(a, b)


def orphans(marker) -> str:
    """Processes whose command line contains `marker` (e.g. the output directory)."""
    return subprocess.run(["pgrep", "-f", str(marker)], capture_output=True,
                          text=True).stdout.strip()
