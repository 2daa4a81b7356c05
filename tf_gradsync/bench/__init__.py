"""Benchmarks: `python -m tf_gradsync.bench <suite>` (see `__main__.py`)."""
