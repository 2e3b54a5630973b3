"""Precision at a threshold: weighted true positives / (true + false positives), a prediction >= threshold
counting as positive (0 where nothing is predicted positive). Keys ``precision-{task}|lifetime_precision`` and
``|window_precision``."""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

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


def get_precision_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor], threshold: float = 0.5
) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(predictions)
    return {
        "true_pos_sum": compute_true_pos_sum(labels, predictions, weights, threshold),
        "false_pos_sum": compute_false_pos_sum(labels, predictions, weights, threshold),
    }


class PrecisionMetricComputation(SumsComputation):
    """Args: threshold (float): a prediction at or above it counts as positive."""

    _SUMS = ("true_pos_sum", "false_pos_sum")
    _NEEDS = ("predictions",)

    def __init__(self, *args: Any, threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = threshold

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_precision_states(labels, predictions, weights, self._threshold)

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(MetricName.PRECISION, compute_precision, *self._SUMS)


class PrecisionMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.PRECISION
    _computation_class: Type[RecMetricComputation] = PrecisionMetricComputation
