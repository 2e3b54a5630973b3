"""Precision at a threshold: weighted true positives / (true + false positives), a prediction >= threshold
counting as positive (0 where nothing is predicted positive). Keys ``precision-{task}|lifetime_precision`` and
``|window_precision``."""

from typing import Callable, Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import ThresholdSumsComputation

THRESHOLD = "threshold"


def compute_precision(num_true_positives: torch.Tensor, num_false_positives: torch.Tensor) -> torch.Tensor:
    predicted = num_true_positives + num_false_positives
    return torch.where(predicted == 0.0, 0.0, num_true_positives / predicted.double())


def compute_true_pos_sum(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    return torch.sum(weights * ((predictions.double() >= threshold) * labels), dim=-1)


def compute_false_pos_sum(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    return torch.sum(weights * ((predictions.double() >= threshold) * (1 - labels)), dim=-1)


def _true_pos_and(
    name: str,
    count: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    labels: torch.Tensor,
    predictions: torch.Tensor,
    weights: Optional[torch.Tensor],
    threshold: float,
) -> Dict[str, torch.Tensor]:
    """{"true_pos_sum": ..., name: count(...)}, [n_tasks] each (weights None: all ones); precision's and recall's
    states."""
    if weights is None:
        weights = torch.ones_like(predictions)
    return {
        "true_pos_sum": compute_true_pos_sum(labels, predictions, weights, threshold),
        name: count(labels, predictions, weights, threshold),
    }


def get_precision_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor], threshold: float = 0.5
) -> Dict[str, torch.Tensor]:
    return _true_pos_and("false_pos_sum", compute_false_pos_sum, labels, predictions, weights, threshold)


class PrecisionMetricComputation(ThresholdSumsComputation):
    _NAME = MetricName.PRECISION
    _SUMS = ("true_pos_sum", "false_pos_sum")
    _states = staticmethod(get_precision_states)
    _value = staticmethod(compute_precision)


class PrecisionMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.PRECISION
    _computation_class: Type[RecMetricComputation] = PrecisionMetricComputation
