"""The servers and sidecars the train loop drives: serving, weight sync, capture control.

In: the learner's weights and policy versions. Out: servers answering with them, and sidecars that
hold the harness's calls while new weights go in. The loop's names are importable from here.
"""

from harnessrl.fleet.capture import Capture, LocalCapture, PodCapture
from harnessrl.fleet.serving import EmbeddedServing, Serving, copy_model, remote_serving
from harnessrl.fleet.sidecar import SidecarProcess, served_tokenizer

__all__ = [
    "Capture",
    "EmbeddedServing",
    "LocalCapture",
    "PodCapture",
    "Serving",
    "SidecarProcess",
    "copy_model",
    "remote_serving",
    "served_tokenizer",
]
