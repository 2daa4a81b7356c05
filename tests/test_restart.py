"""Resuming after a worker dies: launcher restarts plus Keras BackupAndRestore.

A 2-worker job loses worker 1 at a step drawn (seeded) from the steps of the run; the
launcher restarts both workers once and they resume from the last epoch backup. The
result is compared with an uninterrupted run of the same job. Exit codes without
restarts and with exhausted restarts are tested in tests/test_launch.py.
"""

import random
import re

import numpy as np
import pytest

from _multiworker import assert_same_weights, launch, orphans, results

EPOCHS = 5
STEPS_PER_EPOCH = 23          # 1,437 training digits, global batch 64 (last batch partial)
SEED = 20240611


@pytest.mark.slow
def test_job_resumes_from_backup_after_a_worker_dies(tmp_path):
    die_at = random.Random(SEED).randrange(EPOCHS * STEPS_PER_EPOCH)
    args = ("--compression=fp16", f"--epochs={EPOCHS}")
    plain, plain_out, _ = launch(tmp_path / "plain", 2, *args, timeout=300)
    assert plain.returncode == 0, plain.stdout[-3000:]
    backup = tmp_path / "backup"
    proc, out, elapsed = launch(tmp_path / "killed", 2, *args, f"--backup_dir={backup}",
                                f"--die_at_step={die_at}", launcher_args=["--restarts=1"],
                                timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"[1] worker 1: exiting at step {die_at}" in proc.stdout
    assert re.search(r"\[launch\] attempt 0 failed with exit code 3 \(worker 1(; worker 0 "
                     r"still running)?\); restarting", proc.stderr)

    weights, res = results(out, 2)
    assert_same_weights(weights)
    want_weights, want = results(plain_out, 2)
    # The second attempt trained only the epochs after the chief's last backup: from
    # the one the step belongs to, or the next one if the chief finished it first.
    epoch = die_at // STEPS_PER_EPOCH
    resumed = res[0]["epochs_run"][0]
    assert resumed in (epoch, epoch + 1) and res[0]["epochs_run"] == list(range(resumed, EPOCHS))
    assert want[0]["epochs_run"] == list(range(EPOCHS))
    # The backup carries the ops' state (track_state), step counter included: the
    # resumed job counts every step once, as the uninterrupted one does.
    assert res[0]["stats"]["steps"] == want[0]["stats"]["steps"] == EPOCHS * STEPS_PER_EPOCH
    gap = abs(res[0]["accuracy"] - want[0]["accuracy"])
    drift = max(float(np.abs(a - b).max()) for a, b in zip(weights[0], want_weights[0]))
    print(f"worker 1 died at step {die_at} (epoch {epoch}); resumed at epoch {resumed}; done in "
          f"{elapsed:.0f} s; accuracy {res[0]['accuracy']:.4f} vs {want[0]['accuracy']:.4f} "
          f"uninterrupted; largest weight difference {drift:.3g}")
    assert gap <= 0.02
    # Weights, optimizer state and data order are restored exactly, and fp16 is
    # deterministic: the resumed run repeats the uninterrupted one bit for bit.
    assert drift == 0.0
    assert orphans(out) == ""
    assert not list(backup.glob("worker_*")), "BackupAndRestore deletes its backup at the end"
