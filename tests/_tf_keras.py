"""Runs a test script under tf_keras (Keras 2), or Keras 3, in a fresh interpreter.

`TF_USE_LEGACY_KERAS` is read when TensorFlow is first imported, so a suite that has
imported it with Keras 3 reaches tf_keras only in another process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *argv: str, timeout: float = 600, legacy: bool = True) -> str:
    """Runs `script` (dedented) with `argv` under tf_keras (Keras 3 with `legacy` false),
    the project and its examples importable; asserts it succeeded and returns its
    standard output."""
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "examples")])
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1" if legacy else "0",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *argv], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def lines(stdout: str, tag: str = "RESULT") -> list[list[str]]:
    """The words after `tag` of each line of `stdout` that starts with it."""
    return [line.split()[1:] for line in stdout.splitlines() if line.startswith(tag + " ")]
