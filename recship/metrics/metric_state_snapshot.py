"""MetricStateSnapshot: a copy of every metric computation's states (list states reduced to one tensor first)
and of the throughput counter, taken at one moment so that they can be gathered or computed elsewhere while
training goes on updating the originals. Keys ``{task or compute mode}_{computation class}_{state}``."""

import copy
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from recship.metrics.metrics_config import RecComputeMode
from recship.metrics.rec_metric import RecMetricComputation, RecMetricList
from recship.metrics.throughput import ThroughputMetric


class MetricStateSnapshot:
    """Args: metric_states (Dict[str, Any]): the copied states; throughput_metric (Optional[ThroughputMetric]): a
    deep copy of the throughput counter."""

    def __init__(self, metric_states: Dict[str, Any], throughput_metric: Optional[ThroughputMetric]) -> None:
        self.metric_states = metric_states
        self.throughput_metric = throughput_metric

    @classmethod
    def from_metrics(
        cls, rec_metrics: RecMetricList, throughput_metric: Optional[ThroughputMetric] = None
    ) -> "MetricStateSnapshot":
        states: Dict[str, Any] = {}
        for metric in rec_metrics.metrics:
            mode = metric._compute_mode
            if mode in (RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION):
                _load_into_reduced_states(mode.name, metric.computations[0], states)
            else:
                for task, computation in zip(metric._tasks, metric.computations):
                    _load_into_reduced_states(task.name, computation, states)
        return cls(states, copy.deepcopy(throughput_metric) if throughput_metric else None)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in value]
    return value


def _load_into_reduced_states(prefix: str, computation: nn.Module, reduced_states: Dict[str, Any]) -> None:
    assert isinstance(computation, RecMetricComputation)
    name = f"{prefix}_{type(computation).__name__}"
    for attr, reduce_fx in computation._reductions.items():
        value = getattr(computation, attr)
        if callable(reduce_fx) and isinstance(value, list):
            value = reduce_fx(value)  # a list state (AUC's buffers) as one concatenated tensor
        reduced_states[f"{name}_{attr}"] = _clone(value)
