"""The sum of the weights. Keys ``sum_weights-{task}|lifetime_sum_weights`` and ``|window_sum_weights``; weights None
counts every sample as 1."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
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
    _NAME = MetricName.SUM_WEIGHTS
    _SUMS = ("weighted_sum",)
    _NEEDS = ("predictions",)
    _states = staticmethod(get_weighted_sum_states)


class SumWeightsMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SUM_WEIGHTS
    _computation_class: Type[RecMetricComputation] = SumWeightsMetricComputation
