"""Calibration-free NE: NE divided by the NE a perfectly calibrated constant would have, i.e. by the cross entropy
of the labels against the mean prediction m = sum(w q) / sum(w) (unclamped):

    cali_free_ne = NE / (-P log2(m) - (W - P) log2(1 - m))

Keys ``cali_free_ne-{task}|lifetime_cali_free_ne`` and ``|window_cali_free_ne``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _ne_of_sums, _NESumsComputation, get_ne_states
from recship.metrics.ne import compute_cross_entropy as compute_cross_entropy
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.rec_metric import pt2_compile_callable as pt2_compile_callable  # TorchRec's module has it


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
    raw_ne = _ne_of_sums(ce_sum, weighted_num_samples, pos_labels, neg_labels, eta)
    mean_prediction = weighted_sum_predictions / weighted_num_samples
    return raw_ne / (
        -pos_labels * torch.log2(mean_prediction) - (weighted_num_samples - pos_labels) * torch.log2(1 - mean_prediction)
    )


def get_cali_free_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    return {
        **get_ne_states(labels, predictions, weights, eta),
        "weighted_sum_predictions": torch.sum(weights * predictions, dim=-1),
    }


class CaliFreeNEMetricComputation(_NESumsComputation):
    _NAME = MetricName.CALI_FREE_NE
    _SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels", "weighted_sum_predictions")
    _states = staticmethod(get_cali_free_ne_states)
    _value = staticmethod(compute_cali_free_ne)


class CaliFreeNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.CALI_FREE_NE
    _computation_class: Type[RecMetricComputation] = CaliFreeNEMetricComputation
