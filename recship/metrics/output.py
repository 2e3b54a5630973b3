"""Logs two model outputs as they are: the mean of ``latest_imp`` and of ``total_latest_imp`` (required inputs)
of the last update, summed across ranks. Keys ``output-{task}|output_latest_imp`` and
``|output_total_latest_imp``."""

from typing import Any, Dict, List, Optional, Set, Type

import torch

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

    def _get_option_required_inputs(self, options: Dict[str, Any]) -> Set[str]:
        return set(_OUTPUTS)
