"""NE with every weight taken as 1 (the weights given are ignored). Keys
``unweighted_ne-{task}|lifetime_unweighted_ne`` and ``|window_unweighted_ne``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _ne_of_sums, _NESumsComputation, get_ne_states
from recship.metrics.ne import compute_cross_entropy as compute_cross_entropy
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.rec_metric import pt2_compile_callable as pt2_compile_callable  # TorchRec's module has it


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float,
    allow_missing_label_with_zero_weight: bool = False,
) -> torch.Tensor:
    """With ``allow_missing_label_with_zero_weight`` any task of zero samples makes the result [eta]."""
    if allow_missing_label_with_zero_weight and not weighted_num_samples.all():
        return torch.tensor([eta])
    return _ne_of_sums(ce_sum, weighted_num_samples, pos_labels, neg_labels, eta)


def get_unweighted_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    """NE's sums with every weight 1 (``weights`` ignored)."""
    return get_ne_states(labels, predictions, torch.ones_like(labels), eta)


class UnweightedNEMetricComputation(_NESumsComputation):
    _NAME = MetricName.UNWEIGHTED_NE
    _states = staticmethod(get_unweighted_ne_states)
    _value = staticmethod(compute_ne)


class UnweightedNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.UNWEIGHTED_NE
    _computation_class: Type[RecMetricComputation] = UnweightedNEMetricComputation
