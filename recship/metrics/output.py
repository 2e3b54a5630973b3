"""Logs two model outputs as they are: the mean of ``latest_imp`` and of ``total_latest_imp`` (required inputs)
of the last update, summed across ranks. Keys ``output-{task}|output_latest_imp`` and
``|output_total_latest_imp``."""

from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

_OUTPUTS = ("latest_imp", "total_latest_imp")


class OutputMetricComputation(RecMetricComputation):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in _OUTPUTS:
            self._add_state(
                name, torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=False, dist_reduce_fx="sum",
                persistent=False,
            )

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        required = kwargs.get("required_inputs")
        if required is None or not all(name in required for name in _OUTPUTS):
            raise RecMetricException("OutputMetricComputation requires 'latest_imp' and 'total_latest_imp' in kwargs")
        for name in _OUTPUTS:
            setattr(self, name, required[name].float().mean(dim=-1, dtype=torch.double))  # type: ignore[index]

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(MetricName.OUTPUT, MetricPrefix.DEFAULT, getattr(self, name), f"_{name}")
            for name in _OUTPUTS
        ]


class OutputMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.OUTPUT
    _computation_class: Type[RecMetricComputation] = OutputMetricComputation

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: List[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        compute_on_all_ranks: bool = False,
        should_validate_update: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            world_size=world_size,
            my_rank=my_rank,
            batch_size=batch_size,
            tasks=tasks,
            compute_mode=compute_mode,
            window_size=window_size,
            fused_update_limit=fused_update_limit,
            compute_on_all_ranks=compute_on_all_ranks,
            should_validate_update=should_validate_update,
            process_group=process_group,
            **kwargs,
        )
        self._required_inputs.update(_OUTPUTS)
