"""The weight of the samples whose label is NaN (missing). Keys ``num_missing_labels-{task}|lifetime_num_missing_labels`` and ``|window_num_missing_labels``; weights None
counts every sample as 1."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def compute_missing_label_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(torch.where(torch.isnan(labels), weights, 0), dim=-1)


def get_num_missing_labels_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor]
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(labels)
    return {"missing_label_sum": compute_missing_label_sum(labels, predictions, weights)}


class NumMissingLabelsMetricComputation(SumsComputation):
    _NAME = MetricName.NUM_MISSING_LABELS
    _SUMS = ("missing_label_sum",)
    _NEEDS = ("predictions",)
    _states = staticmethod(get_num_missing_labels_states)


class NumMissingLabelsMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NUM_MISSING_LABELS
    _computation_class: Type[RecMetricComputation] = NumMissingLabelsMetricComputation
