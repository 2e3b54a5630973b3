"""The weighted number of positive labels, sum(w * label) (NaN labels count 0). Keys ``num_positive_samples-{task}|lifetime_num_positive_samples`` and ``|window_num_positive_samples``; weights None
counts every sample as 1."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def compute_weighted_pos_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * torch.nan_to_num(labels, 0), dim=-1)


def get_num_positive_sample_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor]
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(labels)
    return {"weighted_pos_sum": compute_weighted_pos_sum(labels, predictions, weights)}


class NumPositiveSamplesMetricComputation(SumsComputation):
    _NAME = MetricName.NUM_POSITIVE_SAMPLES
    _SUMS = ("weighted_pos_sum",)
    _NEEDS = ("predictions",)
    _states = staticmethod(get_num_positive_sample_states)


class NumPositiveSamplesMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NUM_POSITIVE_SAMPLES
    _computation_class: Type[RecMetricComputation] = NumPositiveSamplesMetricComputation
