"""Calibration-free NE: NE divided by the NE a perfectly calibrated constant would have, i.e. by the cross entropy
of the labels against the mean prediction m = sum(w q) / sum(w) (unclamped):

    cali_free_ne = NE / (-P log2(m) - (W - P) log2(1 - m))

Keys ``cali_free_ne-{task}|lifetime_cali_free_ne`` and ``|window_cali_free_ne``."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _compute_cross_entropy_norm
from recship.metrics.ne import compute_cross_entropy as compute_cross_entropy
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.rec_metric import pt2_compile_callable as pt2_compile_callable  # TorchRec's module has it
from recship.metrics.sums import SumsComputation


def _compute_ne(
    ce_sum: torch.Tensor, weighted_num_samples: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    mean_label = pos_labels / weighted_num_samples.double().clamp(min=eta)
    return ce_sum / _compute_cross_entropy_norm(mean_label, pos_labels, neg_labels, eta)


def compute_cali_free_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    weighted_sum_predictions: torch.Tensor,
    eta: float,
    allow_missing_label_with_zero_weight: bool = False,
) -> torch.Tensor:
    """With ``allow_missing_label_with_zero_weight`` any task of zero weight makes the result [eta]."""
    if allow_missing_label_with_zero_weight and not weighted_num_samples.all():
        return torch.tensor([eta])
    raw_ne = _compute_ne(ce_sum, weighted_num_samples, pos_labels, neg_labels, eta)
    mean_prediction = weighted_sum_predictions / weighted_num_samples
    return raw_ne / (
        -pos_labels * torch.log2(mean_prediction) - (weighted_num_samples - pos_labels) * torch.log2(1 - mean_prediction)
    )


def get_cali_free_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    return {
        "cross_entropy_sum": torch.sum(compute_cross_entropy(labels, predictions, weights, eta), dim=-1),
        "weighted_num_samples": torch.sum(weights, dim=-1),
        "pos_labels": torch.sum(weights * labels, dim=-1),
        "neg_labels": torch.sum(weights * (1.0 - labels), dim=-1),
        "weighted_sum_predictions": torch.sum(weights * predictions, dim=-1),
    }


class CaliFreeNEMetricComputation(SumsComputation):
    _SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels", "weighted_sum_predictions")

    def __init__(self, *args: Any, allow_missing_label_with_zero_weight: bool = False, **kwargs: Any) -> None:
        self._allow_missing_label_with_zero_weight = allow_missing_label_with_zero_weight
        super().__init__(*args, **kwargs)
        self.eta = 1e-12

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_cali_free_ne_states(labels, predictions, weights, self.eta)

    def _compute(self) -> List[MetricComputationReport]:
        def cali_free_ne(
            ce: torch.Tensor, n: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, predicted: torch.Tensor
        ) -> torch.Tensor:
            return compute_cali_free_ne(ce, n, pos, neg, predicted, self.eta, self._allow_missing_label_with_zero_weight)

        return self._reports(MetricName.CALI_FREE_NE, cali_free_ne, *self._SUMS)


class CaliFreeNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.CALI_FREE_NE
    _computation_class: Type[RecMetricComputation] = CaliFreeNEMetricComputation
