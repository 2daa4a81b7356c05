"""Monitoring of gradient communication: a Keras callback and a custom-loop helper.

`CommunicationMonitor` adds bytes per step, compression ratio, step time and
throughput to Keras logs and can write them to CSV, JSON lines and TensorBoard;
`StepMonitor` records the same numbers around the steps of a custom training loop.
`python -m tf_gradsync.report RUN.jsonl ...` plots the JSON-lines files of either.
"""

from tf_gradsync.callbacks._common import is_chief
from tf_gradsync.callbacks.communication_monitor import CommunicationMonitor
from tf_gradsync.callbacks.step_monitor import StepMonitor

__all__ = ["CommunicationMonitor", "StepMonitor", "is_chief"]
