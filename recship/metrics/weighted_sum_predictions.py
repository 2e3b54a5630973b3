"""The weighted sum of the predictions, sum(w * prediction) (NaN predictions count 0). Keys ``weighted_sum_predictions-{task}|lifetime_weighted_sum_predictions`` and ``|window_weighted_sum_predictions``; weights None
counts every sample as 1."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def compute_weighted_predictions_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * torch.nan_to_num(predictions, 0), dim=-1)


def get_weighted_sum_prediction_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor]
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(labels)
    return {"weighted_predictions_sum": compute_weighted_predictions_sum(labels, predictions, weights)}


class WeightedSumPredictionsMetricComputation(SumsComputation):
    _NAME = MetricName.WEIGHTED_SUM_PREDICTIONS
    _SUMS = ("weighted_predictions_sum",)
    _NEEDS = ("predictions",)
    _states = staticmethod(get_weighted_sum_prediction_states)


class WeightedSumPredictionsMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.WEIGHTED_SUM_PREDICTIONS
    _computation_class: Type[RecMetricComputation] = WeightedSumPredictionsMetricComputation
