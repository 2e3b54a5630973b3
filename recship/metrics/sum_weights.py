"""The sum of the weights. Keys ``sum_weights-{task}|lifetime_sum_weights`` and ``|window_sum_weights``; weights None
counts every sample as 1."""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def compute_weighted_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights, dim=-1)


def get_weighted_sum_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor]
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(labels)
    return {"weighted_sum": compute_weighted_sum(labels, predictions, weights)}


class SumWeightsMetricComputation(SumsComputation):
    _SUMS = ("weighted_sum",)
    _NEEDS = ("predictions",)

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_weighted_sum_states(labels, predictions, weights)

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(MetricName.SUM_WEIGHTS, lambda total: total, *self._SUMS)


class SumWeightsMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SUM_WEIGHTS
    _computation_class: Type[RecMetricComputation] = SumWeightsMetricComputation
