"""python -m tf_gradsync.bench <suite> [flags]

Suites (each a module of this package that defines its flags and `run()`):
  micro        compress+decompress throughput of every compressor (GB/s of float32
               input, one intra-op thread), payload bytes and ratio.
  multiworker  median step time of a ~25M-parameter model on N local workers:
               stock MultiWorkerMirroredStrategy and ours, side by side, as ratios.
  cluster      the same on workers in network namespaces behind rate-limited links (root).

Results print as a markdown table; --json writes them to a file.
"""

from __future__ import annotations

import importlib
import json
import os

from absl import app, flags

from tf_gradsync.bench import cluster, micro, multiworker  # noqa: F401  (define their flags)

#: Suite name -> module with `run() -> (rows, columns)`.
SUITES = {
    "micro": "tf_gradsync.bench.micro",
    "multiworker": "tf_gradsync.bench.multiworker",
    "cluster": "tf_gradsync.bench.cluster",
}

flags.DEFINE_list("compressors", None, "Compressor names (default: depends on the suite).")
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
FLAGS = flags.FLAGS


def table(rows, cols) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv):
    if len(argv) != 2 or argv[1] not in SUITES:
        raise app.UsageError(f"usage: python -m tf_gradsync.bench {{{','.join(SUITES)}}} [flags]; "
                             f"got {argv[1:]!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows, cols = importlib.import_module(SUITES[argv[1]]).run()
    print(table(rows, cols))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    app.run(main)
