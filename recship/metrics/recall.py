"""Recall at a threshold: weighted true positives / (true positives + false negatives). As in TorchRec a
positive predicted exactly at the threshold counts both as a true positive (>=) and as a false negative (<=).
Keys ``recall-{task}|lifetime_recall`` and ``|window_recall``."""

from typing import Dict, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.precision import _true_pos_and
from recship.metrics.precision import compute_true_pos_sum as compute_true_pos_sum  # TorchRec's recall module has it
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import ThresholdSumsComputation

THRESHOLD = "threshold"


def compute_recall(num_true_positives: torch.Tensor, num_false_negitives: torch.Tensor) -> torch.Tensor:
    positives = num_true_positives + num_false_negitives
    return torch.where(positives == 0.0, 0.0, num_true_positives / positives)


def compute_false_neg_sum(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    return torch.sum(weights * ((predictions.double() <= threshold) * labels), dim=-1)


def get_recall_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor], threshold: float = 0.5
) -> Dict[str, torch.Tensor]:
    return _true_pos_and("false_neg_sum", compute_false_neg_sum, labels, predictions, weights, threshold)


class RecallMetricComputation(ThresholdSumsComputation):
    _NAME = MetricName.RECALL
    _SUMS = ("true_pos_sum", "false_neg_sum")
    _states = staticmethod(get_recall_states)
    _value = staticmethod(compute_recall)


class RecallMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.RECALL
    _computation_class: Type[RecMetricComputation] = RecallMetricComputation
