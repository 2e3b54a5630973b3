"""CPUCommsRecMetricModule: the part of the CPU-offloaded metric module that gathers: it holds copies of the
metrics, loads a ``MetricStateSnapshot`` of the local states into them, all-gathers and reduces them
(``get_pre_compute_states``), and computes on the result. Its computations never sync by themselves."""

import copy
import logging
from typing import Any, Dict

import torch.nn as nn

from recship.metrics.metric_module import RecMetricModule
from recship.metrics.metric_state_snapshot import MetricStateSnapshot
from recship.metrics.metrics_config import RecComputeMode
from recship.metrics.rec_metric import RecMetric, RecMetricComputation, RecMetricList

logger: logging.Logger = logging.getLogger(__name__)


class CPUCommsRecMetricModule(RecMetricModule):
    """Takes RecMetricModule's arguments; its ``rec_metrics`` are fresh copies of the given ones (with their
    options, without their states), so the training thread's metrics are never touched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rec_metrics = self._clone_rec_metrics()
        for metric in self.rec_metrics.metrics:
            for computation in metric.computations:
                computation._to_sync = False

    def load_local_metric_state_snapshot(self, state_snapshot: MetricStateSnapshot) -> None:
        """Load this rank's states (and throughput counter) from a snapshot, before the gather."""
        for metric in self.rec_metrics.metrics:
            mode = metric._compute_mode
            if mode in (RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION):
                self._load_metric_states(mode.name, metric.computations[0], state_snapshot.metric_states)
            for task, computation in zip(metric._tasks, metric.computations):
                self._load_metric_states(task.name, computation, state_snapshot.metric_states)
        if state_snapshot.throughput_metric is not None:
            self.throughput_metric = state_snapshot.throughput_metric

    def _load_metric_states(self, prefix: str, computation: nn.Module, metric_states: Dict[str, Any]) -> None:
        assert isinstance(computation, RecMetricComputation)
        set_update_called(computation)
        computation._computed = None
        name = f"{prefix}_{type(computation).__name__}"
        for attr in computation._reductions:
            key = f"{name}_{attr}"
            if key in metric_states:
                setattr(computation, attr, metric_states[key])

    def _clone_rec_metrics(self) -> RecMetricList:
        # TorchRec rebuilds each metric from its constructor's common arguments, which drops the metric's own
        # options (include_logloss, number_of_classes, ...); a deep copy keeps them. Process groups are shared.
        clones = []
        for metric in self.rec_metrics.metrics:
            assert isinstance(metric, RecMetric)
            memo = {id(c.process_group): c.process_group for c in metric.computations if c.process_group is not None}
            clone = copy.deepcopy(metric, memo)
            clone.reset()
            clones.append(clone)
        return RecMetricList(clones)


def set_update_called(computation: RecMetricComputation) -> None:
    """Mark a computation as updated (its states were loaded, not accumulated here)."""
    computation._update_count = max(computation._update_count, 1)
