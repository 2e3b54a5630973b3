"""Accuracy at a threshold: the weighted share of samples with (prediction >= threshold) == label. Keys
``accuracy-{task}|lifetime_accuracy`` and ``|window_accuracy``; ``RecMetricDef(arguments={"threshold": t})``."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import ThresholdSumsComputation

THRESHOLD = "threshold"


def compute_accuracy(accuracy_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, accuracy_sum / weighted_num_samples).double()


def compute_accuracy_sum(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    return torch.sum(weights * ((predictions.double() >= threshold) == labels), dim=-1)


def get_accuracy_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor], threshold: float = 0.5
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(predictions)
    return {
        "accuracy_sum": compute_accuracy_sum(labels, predictions, weights, threshold),
        "weighted_num_samples": torch.sum(weights, dim=-1),
    }


class AccuracyMetricComputation(ThresholdSumsComputation):
    _NAME = MetricName.ACCURACY
    _SUMS = ("accuracy_sum", "weighted_num_samples")
    _states = staticmethod(get_accuracy_states)
    _value = staticmethod(compute_accuracy)


class AccuracyMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.ACCURACY
    _computation_class: Type[RecMetricComputation] = AccuracyMetricComputation
