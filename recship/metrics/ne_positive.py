"""NE of the positives: the cross entropy of the positive samples only, sum(-w * y * log2(q)), normalised by the
base rate's entropy as in NE. Keys ``ne_positive-{task}|lifetime_ne_positive`` and ``|window_ne_positive``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _label_sums, _ne_of_sums, _NESumsComputation
from recship.metrics.rec_metric import RecMetric, RecMetricComputation


def compute_cross_entropy_positive(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> torch.Tensor:
    predictions = predictions.double().clamp(min=eta, max=1 - eta)
    return -weights * labels * torch.log2(predictions)


def compute_ne_positive(
    ce_positive_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float,
    allow_missing_label_with_zero_weight: bool = False,
) -> torch.Tensor:
    """With ``allow_missing_label_with_zero_weight`` any task of zero weight makes the result [eta]."""
    if allow_missing_label_with_zero_weight and not weighted_num_samples.all():
        return torch.tensor([eta])
    return _ne_of_sums(ce_positive_sum, weighted_num_samples, pos_labels, neg_labels, eta)


def get_ne_positive_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    return {
        "cross_entropy_positive_sum": torch.sum(compute_cross_entropy_positive(labels, predictions, weights, eta), dim=-1),
        **_label_sums(labels, weights),
    }


class NEPositiveMetricComputation(_NESumsComputation):
    _NAME = MetricName.NE_POSITIVE
    _SUMS = ("cross_entropy_positive_sum", "weighted_num_samples", "pos_labels", "neg_labels")
    _states = staticmethod(get_ne_positive_states)
    _value = staticmethod(compute_ne_positive)


class NEPositiveMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NE_POSITIVE
    _computation_class: Type[RecMetricComputation] = NEPositiveMetricComputation
