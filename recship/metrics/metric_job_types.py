"""The jobs an asynchronous metric module queues for its worker thread: an update (model outputs), a
synchronization marker (compute here, once the updates before it are in) and a compute (a snapshot of the states
and the Future to resolve with the values)."""

import concurrent.futures
from typing import Any, Dict, Union

import torch

from recship.metrics.metric_state_snapshot import MetricStateSnapshot

MetricValue = Union[torch.Tensor, float]


class MetricUpdateJob:
    """``model_out`` and the trainer's ``kwargs`` for one update; ``merged_count`` updates merged into it."""

    __slots__ = ["model_out", "kwargs", "merged_count"]

    def __init__(self, model_out: Dict[str, torch.Tensor], kwargs: Dict[str, Any], merged_count: int = 1) -> None:
        self.model_out = model_out
        self.kwargs = kwargs
        self.merged_count = merged_count


class MetricComputeJob:
    """Compute from ``metric_state_snapshot`` and resolve ``future`` with the values."""

    __slots__ = ["future", "metric_state_snapshot"]

    def __init__(
        self, future: "concurrent.futures.Future[Dict[str, MetricValue]]", metric_state_snapshot: MetricStateSnapshot
    ) -> None:
        self.future = future
        self.metric_state_snapshot = metric_state_snapshot


class SynchronizationMarker:
    """Where in the update queue the ranks synchronize to compute; becomes a MetricComputeJob for ``future``."""

    __slots__ = "future"

    def __init__(self, future: "concurrent.futures.Future[Dict[str, MetricValue]]") -> None:
        self.future = future
