"""Accuracy at a threshold: the weighted share of samples with (prediction >= threshold) == label. Keys
``accuracy-{task}|lifetime_accuracy`` and ``|window_accuracy``; ``RecMetricDef(arguments={"threshold": t})``."""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

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


class AccuracyMetricComputation(SumsComputation):
    """Args: threshold (float): a prediction at or above it counts as positive."""

    _SUMS = ("accuracy_sum", "weighted_num_samples")
    _NEEDS = ("predictions",)

    def __init__(self, *args: Any, threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = threshold

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_accuracy_states(labels, predictions, weights, self._threshold)

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(MetricName.ACCURACY, compute_accuracy, *self._SUMS)


class AccuracyMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.ACCURACY
    _computation_class: Type[RecMetricComputation] = AccuracyMetricComputation
