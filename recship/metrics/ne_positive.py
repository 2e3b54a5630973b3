"""NE of the positives: the cross entropy of the positive samples only, sum(-w * y * log2(q)), normalised by the
base rate's entropy as in NE. Keys ``ne_positive-{task}|lifetime_ne_positive`` and ``|window_ne_positive``."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _compute_cross_entropy_norm
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


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
    mean_label = pos_labels / weighted_num_samples.double().clamp(min=eta)
    return ce_positive_sum / _compute_cross_entropy_norm(mean_label, pos_labels, neg_labels, eta)


def get_ne_positive_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    return {
        "cross_entropy_positive_sum": torch.sum(compute_cross_entropy_positive(labels, predictions, weights, eta), dim=-1),
        "weighted_num_samples": torch.sum(weights, dim=-1),
        "pos_labels": torch.sum(weights * labels, dim=-1),
        "neg_labels": torch.sum(weights * (1.0 - labels), dim=-1),
    }


class NEPositiveMetricComputation(SumsComputation):
    _SUMS = ("cross_entropy_positive_sum", "weighted_num_samples", "pos_labels", "neg_labels")

    def __init__(self, *args: Any, allow_missing_label_with_zero_weight: bool = False, **kwargs: Any) -> None:
        self._allow_missing_label_with_zero_weight = allow_missing_label_with_zero_weight
        super().__init__(*args, **kwargs)
        self.eta = 1e-12

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_ne_positive_states(labels, predictions, weights, self.eta)

    def _compute(self) -> List[MetricComputationReport]:
        def ne_positive(ce: torch.Tensor, n: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
            return compute_ne_positive(ce, n, pos, neg, self.eta, self._allow_missing_label_with_zero_weight)

        return self._reports(MetricName.NE_POSITIVE, ne_positive, *self._SUMS)


class NEPositiveMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NE_POSITIVE
    _computation_class: Type[RecMetricComputation] = NEPositiveMetricComputation
