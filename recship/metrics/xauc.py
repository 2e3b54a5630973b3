"""XAUC: the weighted share of sample pairs (within each batch) that the predictions order as the labels do, ties
agreeing with ties; each pair weighs w_i * w_j. Keys ``xauc-{task}|lifetime_xauc`` and ``|window_xauc``.
Pairs are formed inside a batch only, so the value depends on the batching (as in TorchRec); O(B^2) per batch."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

ERROR_SUM = "error_sum"
WEIGHTED_NUM_PAIRS = "weighted_num_pairs"


def compute_xauc(error_sum: torch.Tensor, weighted_num_pairs: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_pairs == 0.0, 0.0, error_sum / weighted_num_pairs).double()


def compute_error_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n_tasks]: the weight of the pairs i < j ordered alike by prediction and label."""
    predictions = predictions.double()
    sums = []
    for p, y, w in zip(predictions, labels, weights):
        dp = p[:, None] - p[None, :]
        dy = y[:, None] - y[None, :]
        agree = ((dp > 0) & (dy > 0)) | ((dp < 0) & (dy < 0)) | ((dp == 0) & (dy == 0))
        sums.append(torch.sum(torch.triu(w[:, None] * w[None, :] * agree.double(), diagonal=1)).view(1))
    return torch.cat(sums)


def compute_weighted_num_pairs(weights: torch.Tensor) -> torch.Tensor:
    """[n_tasks]: sum over pairs i < j of w_i * w_j."""
    return torch.cat([torch.sum(torch.triu(w[:, None] * w[None, :], diagonal=1)).view(1) for w in weights])


def get_xauc_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {ERROR_SUM: compute_error_sum(labels, predictions, weights), WEIGHTED_NUM_PAIRS: compute_weighted_num_pairs(weights)}


class XAUCMetricComputation(SumsComputation):
    _NAME = MetricName.XAUC
    _SUMS = (ERROR_SUM, WEIGHTED_NUM_PAIRS)
    _states = staticmethod(get_xauc_states)
    _value = staticmethod(compute_xauc)


class XAUCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.XAUC
    _computation_class: Type[RecMetricComputation] = XAUCMetricComputation
