"""Tower QPS: examples per second of one task's tower, for towers whose examples per step vary. Examples are
summed across ranks and the time lapse is the slowest rank's (max): ``qps-{task}|lifetime_qps``,
``|window_qps`` and ``|total_examples``. Nothing is timed during the first ``warmup_steps`` updates."""

import time
from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist

from recship.metrics.metrics_config import BatchSizeStage, RecComputeMode, RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import (
    MetricComputationReport,
    RecMetric,
    RecMetricComputation,
    RecMetricException,
    RecModelOutput,
)
from recship.metrics.throughput import StagedBatchSize

WARMUP_STEPS = 100
NUM_EXAMPLES = "num_examples"
WARMUP_EXAMPLES = "warmup_examples"
TIME_LAPSE = "time_lapse"


def _compute_tower_qps(num_examples: torch.Tensor, time_lapse: torch.Tensor) -> torch.Tensor:
    return torch.where(time_lapse <= 0.0, 0.0, num_examples / time_lapse).double()


def _max_reduction(state: torch.Tensor) -> torch.Tensor:
    return torch.max(state, dim=0).values


class TowerQPSMetricComputation(RecMetricComputation):
    """Takes ``warmup_steps`` among its keyword arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._warmup_steps: int = kwargs.pop("warmup_steps", WARMUP_STEPS)
        super().__init__(*args, **kwargs)
        self._add_state(NUM_EXAMPLES, torch.zeros(self._n_tasks, dtype=torch.long), add_window_state=True,
                        dist_reduce_fx="sum", persistent=True)
        self._add_state(WARMUP_EXAMPLES, torch.zeros(self._n_tasks, dtype=torch.long), add_window_state=False,
                        dist_reduce_fx="sum", persistent=True)
        self._add_state(TIME_LAPSE, torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=True,
                        dist_reduce_fx=_max_reduction, persistent=True)
        self._previous_ts = 0.0
        self._steps = 0

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """labels: [n_tasks, b]; b examples this step."""
        self._steps += 1
        count = labels.shape[-1]
        examples = torch.tensor(count, dtype=torch.long)
        getattr(self, NUM_EXAMPLES).add_(examples)
        ts = time.monotonic()
        if self._steps <= self._warmup_steps:
            getattr(self, WARMUP_EXAMPLES).add_(examples)
            if self._steps == self._warmup_steps:
                self._previous_ts = ts
            return
        self._aggregate_window_state(NUM_EXAMPLES, examples, count)
        lapse = torch.tensor(ts - self._previous_ts, dtype=torch.double)
        getattr(self, TIME_LAPSE).add_(lapse)
        self._aggregate_window_state(TIME_LAPSE, lapse, count)
        self._previous_ts = ts

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(
                MetricName.TOWER_QPS, MetricPrefix.LIFETIME, _compute_tower_qps(self.num_examples - self.warmup_examples, self.time_lapse)
            ),
            MetricComputationReport(
                MetricName.TOWER_QPS,
                MetricPrefix.WINDOW,
                _compute_tower_qps(self.get_window_state(NUM_EXAMPLES), self.get_window_state(TIME_LAPSE)),
            ),
            MetricComputationReport(MetricName.TOTAL_EXAMPLES, MetricPrefix.DEFAULT, self.num_examples.detach()),
        ]


class TowerQPSMetric(StagedBatchSize, RecMetric):
    """QPS per task tower. In the fused modes the labels are viewed as [-1, batch_size] (the batch size of the
    current stage with ``batch_size_stages``)."""

    _namespace: MetricNamespace = MetricNamespace.TOWER_QPS
    _computation_class: Type[RecMetricComputation] = TowerQPSMetricComputation

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: List[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        warmup_steps: int = WARMUP_STEPS,
        batch_size_stages: Optional[List[BatchSizeStage]] = None,
        **kwargs: Any,
    ) -> None:
        if fused_update_limit > 0:
            raise RecMetricException("Fused update is not supported for tower QPS")
        super().__init__(
            world_size=world_size,
            my_rank=my_rank,
            batch_size=batch_size,
            tasks=tasks,
            compute_mode=compute_mode,
            window_size=window_size,
            fused_update_limit=fused_update_limit,
            process_group=process_group,
            warmup_steps=warmup_steps,
            **kwargs,
        )
        self._init_batch_size_stages(batch_size_stages)

    def _update(
        self, *, predictions: Optional[RecModelOutput], labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        if self._batch_size_stages is not None:
            self._num_batch += 1
            self._batch_size = self._get_batch_size()
        with torch.no_grad():
            if self._compute_mode in (RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION):
                self._update_fused_qps(labels, weights)
                return
            for task, computation in zip(self._tasks, self.computations):
                if task.name not in labels:
                    continue
                task_labels = labels[task.name].view(1, -1)  # type: ignore[index]
                if self._should_validate_update:
                    valid = torch.ones(1, dtype=torch.bool, device=computation.has_valid_update.device)
                    if weights is not None and task.name in weights:
                        valid = torch.gt(torch.count_nonzero(weights[task.name].view(1, -1), dim=-1), 0)  # type: ignore[index]
                    if not valid[0]:
                        continue
                    computation.has_valid_update.logical_or_(valid)
                computation.update(predictions=None, labels=task_labels, weights=None)

    def _update_fused_qps(self, labels: RecModelOutput, weights: Optional[RecModelOutput]) -> None:
        if not isinstance(labels, torch.Tensor):
            labels = self._stack_tasks(labels, "labels")
        labels = labels.view(-1, self._batch_size)
        computation = self.computations[0]
        if not self._should_validate_update:
            computation.update(predictions=None, labels=labels, weights=None)
            return
        valid = torch.ones(len(self._tasks), dtype=torch.bool, device=computation.has_valid_update.device)
        if weights is not None:
            if not isinstance(weights, torch.Tensor):
                weights = self._stack_tasks(weights, "weights")
            valid = torch.gt(torch.count_nonzero(weights.view(-1, self._batch_size), dim=-1), 0)
        if torch.any(valid):
            computation.update(predictions=None, labels=labels, weights=None)
            computation.has_valid_update.logical_or_(valid)

    def _stack_tasks(self, per_task: Dict[str, torch.Tensor], what: str) -> torch.Tensor:
        """``{task name: [B]}`` -> ``[num_tasks, B]`` in task order; RecMetricException (TorchRec's text) when a
        task is missing or the tensors do not stack."""
        missing = [task.name for task in self._tasks if task.name not in per_task]
        if missing:
            raise RecMetricException(
                f"Failed to convert {what} to tensor for fused computation: no {what} for tasks {missing} "
                f"(the dict has keys {sorted(per_task)})")
        try:
            return torch.stack([per_task[task.name] for task in self._tasks])
        except RuntimeError as e:
            raise RecMetricException(f"Failed to convert {what} to tensor for fused computation: {e}") from e
