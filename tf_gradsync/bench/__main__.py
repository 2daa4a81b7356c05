"""python -m tf_gradsync.bench <suite> [flags]

Suites (each a module of this package that defines its flags and `run()`):
  micro        compress+decompress throughput of every compressor (GB/s of float32
               input, one intra-op thread), payload bytes and ratio.
  multiworker  median step time of a ~25M-parameter model on N local workers:
               stock MultiWorkerMirroredStrategy and ours, side by side, as ratios.
  cluster      the same on workers in network namespaces behind rate-limited links (root).
  single_host  median step time under MirroredStrategy on 4 logical CPU devices: TensorFlow's
               cross-device ops and ours, interleaved in one process, as ratios.
  accuracy     digits trained with stock ops and each compressor: final test accuracy,
               deltas, time-to-accuracy, bytes per step.
  passes       bytes each mode's data path reads and writes per gradient byte, counted
               from the traced graph (with and without measuring comm_error).
  timeline     a tf.profiler trace of single_host's step: how much of each mode's bucket
               exchanges runs before backpropagation ends; --timeline_png draws it.

Results print as a markdown table; --json writes them to a file, --png draws the suite's
`PLOT` as a bar chart (see figure.py; needs matplotlib: pip install 'tf_gradsync[bench]').
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile

from absl import app, flags

from tf_gradsync.bench import check_specs, figure
# Suite modules define their flags when imported.
from tf_gradsync.bench import (accuracy, cluster, micro, multiworker, passes,  # noqa: F401
                               single_host, timeline)

#: Suite name -> module with `run() -> (rows, columns)`.
SUITES = {
    "micro": "tf_gradsync.bench.micro",
    "multiworker": "tf_gradsync.bench.multiworker",
    "cluster": "tf_gradsync.bench.cluster",
    "single_host": "tf_gradsync.bench.single_host",
    "accuracy": "tf_gradsync.bench.accuracy",
    "timeline": "tf_gradsync.bench.timeline",
    "passes": "tf_gradsync.bench.passes",
}

#: --compressors entries that are modes of a suite, not compressors.
MODES = ("stock", "compute", multiworker.AUTOTUNE)

flags.DEFINE_list("compressors", None, "Compressor names (default: depends on the suite).")
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
flags.DEFINE_string("png", None, "Write a bar chart of the suite's main metric to this PNG file.")
FLAGS = flags.FLAGS


def check_outputs(**paths) -> None:
    """Raises ValueError for an output flag (`json="/path/x.json"`) that cannot be
    written: its folder does not exist, it names a folder, or opening it fails (no
    permission, a read-only file system). Checked before a suite runs, so that minutes
    of measurement are not lost when its results are written; a file the check creates
    is removed again."""
    for flag, path in paths.items():
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"--{flag}={path}: folder {folder!r} does not exist")
        if os.path.isdir(path):
            raise ValueError(f"--{flag}={path} is a folder; name a file (e.g. "
                             f"{os.path.join(path, 'rows.' + flag)})")
        existed = os.path.exists(path)
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ValueError(f"--{flag}={path} cannot be written: {e.strerror}") from e
        if not existed:
            os.remove(path)


@contextlib.contextmanager
def written(flag: str, path: str):
    """Yields a temporary file beside `path` to write an output flag's file to, then
    moves it onto `path` in one step: a write that fails (a full disk) leaves what
    `path` held before, and exits with a message naming the flag, not a traceback. A
    path that is no regular file (/dev/stdout, a pipe) is written as it is."""
    tmp = None
    try:
        if not os.path.exists(path) or os.path.isfile(path):
            folder, name = os.path.split(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=os.path.splitext(name)[1],
                                       dir=folder)
            os.close(fd)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)     # as `open` would make it, not mkstemp's 0600
        yield tmp or path
        if tmp:
            os.replace(tmp, path)
    except OSError as e:
        raise SystemExit(f"--{flag}={path} could not be written ({e.strerror or e}); the "
                         "table above holds the results") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)


def write_json(flag: str, path: str, rows) -> None:
    """`rows` as JSON in `path`, whole or not at all (see `written`)."""
    with written(flag, path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)


def table(rows, cols) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(v):
    if v is None:
        return ""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv):
    if len(argv) != 2 or argv[1] not in SUITES:
        raise app.UsageError(f"usage: python -m tf_gradsync.bench {{{','.join(SUITES)}}} [flags]; "
                             f"got {argv[1:]!r}")
    suite = importlib.import_module(SUITES[argv[1]])
    # Everything that would fail after minutes of measuring is checked first.
    try:
        check_outputs(json=FLAGS.json, png=FLAGS.png, timeline_png=FLAGS.timeline_png)
        check_specs(FLAGS.compressors or (), skip=MODES)
        if hasattr(suite, "check"):
            suite.check()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows, cols = suite.run()
    print(table(rows, cols))
    if FLAGS.json:
        write_json("json", FLAGS.json, rows)
    if FLAGS.png:
        with written("png", FLAGS.png) as tmp:
            figure.write_png(rows, cols, tmp, getattr(suite, "PLOT", None), title=argv[1])
        if getattr(suite, "SCATTER", None):    # a prediction against measurement
            stem, _ = os.path.splitext(FLAGS.png)
            with written("png", f"{stem}_predicted.png") as tmp:
                figure.write_scatter(rows, tmp, suite.SCATTER, title=argv[1])
    return 0


def usage() -> str:
    """This docstring and every suite's flags, by the module that defines them (absl's
    --help shows only the flags of `__main__`, and exits 1)."""
    modules = [sys.modules[__name__], *map(importlib.import_module, SUITES.values())]
    return "\n\n".join([__doc__.strip(), "Flags:",
                        *filter(None, map(FLAGS.module_help, modules))])


if __name__ == "__main__":
    if any(a in ("-h", "-help", "--help", "--helpshort") for a in sys.argv[1:]):
        print(usage())
        sys.exit(0)
    app.run(main)
