"""NE with every weight taken as 1 (the weights given are ignored). Keys
``unweighted_ne-{task}|lifetime_unweighted_ne`` and ``|window_unweighted_ne``."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.ne import _compute_cross_entropy_norm
from recship.metrics.ne import compute_cross_entropy as compute_cross_entropy
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.rec_metric import pt2_compile_callable as pt2_compile_callable  # TorchRec's module has it
from recship.metrics.sums import SumsComputation


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
    mean_label = pos_labels / weighted_num_samples.double().clamp(min=eta)
    return ce_sum / _compute_cross_entropy_norm(mean_label, pos_labels, neg_labels, eta)


def get_unweighted_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    ones = torch.ones_like(labels)
    return {
        "cross_entropy_sum": torch.sum(compute_cross_entropy(labels, predictions, ones, eta), dim=-1),
        "weighted_num_samples": torch.sum(ones, dim=-1),
        "pos_labels": torch.sum(ones * labels, dim=-1),
        "neg_labels": torch.sum(ones * (1.0 - labels), dim=-1),
    }


class UnweightedNEMetricComputation(SumsComputation):
    _SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")

    def __init__(self, *args: Any, allow_missing_label_with_zero_weight: bool = False, **kwargs: Any) -> None:
        self._allow_missing_label_with_zero_weight = allow_missing_label_with_zero_weight
        super().__init__(*args, **kwargs)
        self.eta = 1e-12

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_unweighted_ne_states(labels, predictions, weights, self.eta)

    def _compute(self) -> List[MetricComputationReport]:
        def ne(ce: torch.Tensor, n: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
            return compute_ne(ce, n, pos, neg, self.eta, self._allow_missing_label_with_zero_weight)

        return self._reports(MetricName.UNWEIGHTED_NE, ne, *self._SUMS)


class UnweightedNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.UNWEIGHTED_NE
    _computation_class: Type[RecMetricComputation] = UnweightedNEMetricComputation
