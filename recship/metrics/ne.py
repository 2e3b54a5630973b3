"""Normalized entropy: the weighted cross entropy of the predictions (bits) divided by the cross entropy of
always predicting the weighted base rate p = sum(w * y) / sum(w). Below 1 is better than the base rate.

    NE = sum_i w_i * H(y_i, q_i) / (P * -log2(p) + N * -log2(1 - p))

with q clamped to [eta, 1 - eta], P = sum(w * y), N = sum(w * (1 - y)), p clamped likewise and sum(w) clamped
below at eta (eta = 1e-12). Keys ``ne-{task}|lifetime_ne``, ``ne-{task}|window_ne`` (and ``|lifetime_logloss``,
``|window_logloss``: cross entropy per unit weight, with ``include_logloss``).
"""

from functools import partial
from typing import Any, Dict, List, Tuple, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def compute_cross_entropy(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> torch.Tensor:
    """Per-sample weighted binary cross entropy in bits, predictions (as float64) clamped to [eta, 1 - eta]."""
    predictions = predictions.double().clamp(min=eta, max=1 - eta)
    return -weights * labels * torch.log2(predictions) - weights * (1.0 - labels) * torch.log2(1.0 - predictions)


def _compute_cross_entropy_norm(
    mean_label: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    mean_label = mean_label.double().clamp(min=eta, max=1 - eta)
    return -pos_labels * torch.log2(mean_label) - neg_labels * torch.log2(1.0 - mean_label)


def _ne_of_sums(
    ce_sum: torch.Tensor, weighted_num_samples: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    """``ce_sum`` over the cross entropy of always predicting the weighted base rate (all [n_tasks])."""
    mean_label = pos_labels / weighted_num_samples.double().clamp(min=eta)
    return ce_sum / _compute_cross_entropy_norm(mean_label, pos_labels, neg_labels, eta)


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float,
    allow_missing_label_with_zero_weight: bool = False,
) -> torch.Tensor:
    """NE from the [n_tasks] sums; with ``allow_missing_label_with_zero_weight`` a task of zero weight gives eta."""
    ne = _ne_of_sums(ce_sum, weighted_num_samples, pos_labels, neg_labels, eta)
    if allow_missing_label_with_zero_weight and not weighted_num_samples.all():
        return torch.where(weighted_num_samples > 0, ne, eta)
    return ne


def compute_logloss(ce_sum: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float) -> torch.Tensor:
    """Cross entropy per unit of weight."""
    return ce_sum / (pos_labels + neg_labels).clamp(min=eta)


def get_ne_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, eta: float
) -> Dict[str, torch.Tensor]:
    """The batch's [n_tasks] sums: cross entropy, weight, weighted positives, weighted negatives."""
    return {
        "cross_entropy_sum": torch.sum(compute_cross_entropy(labels, predictions, weights, eta), dim=-1),
        **_label_sums(labels, weights),
    }


def _label_sums(labels: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The batch's [n_tasks] weight, weighted positives and weighted negatives."""
    return {
        "weighted_num_samples": torch.sum(weights, dim=-1),
        "pos_labels": torch.sum(weights * labels, dim=-1),
        "neg_labels": torch.sum(weights * (1.0 - labels), dim=-1),
    }


class _NESumsComputation(SumsComputation):
    """A metric of the NE family: ``_states(labels, predictions, weights, eta)`` gives a batch's sums (``_SUMS``),
    ``_value(*sums, eta=, allow_missing_label_with_zero_weight=)`` the value, reported as ``_NAME``.

    Args:
        allow_missing_label_with_zero_weight (bool): a task whose weight sums to zero reports eta, not inf/nan.
    """

    _SUMS: Tuple[str, ...] = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")

    def __init__(self, *args: Any, allow_missing_label_with_zero_weight: bool = False, **kwargs: Any) -> None:
        self._allow_missing_label_with_zero_weight = allow_missing_label_with_zero_weight
        super().__init__(*args, **kwargs)
        self.eta = 1e-12

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return self._states(labels, predictions, weights, self.eta)

    def _compute(self) -> List[MetricComputationReport]:
        value = partial(
            self._value, eta=self.eta, allow_missing_label_with_zero_weight=self._allow_missing_label_with_zero_weight
        )
        return self._reports(self._NAME, value, *self._SUMS)


class NEMetricComputation(_NESumsComputation):
    """NE over [n_tasks, B] predictions, labels and weights.

    Args:
        include_logloss (bool): also report the log loss.
        allow_missing_label_with_zero_weight (bool): a task whose weight sums to zero reports eta, not inf/nan.
    """

    _NAME = MetricName.NE
    _value = staticmethod(compute_ne)

    def __init__(
        self, *args: Any, include_logloss: bool = False, allow_missing_label_with_zero_weight: bool = False, **kwargs: Any
    ) -> None:
        self._include_logloss = include_logloss
        super().__init__(*args, allow_missing_label_with_zero_weight=allow_missing_label_with_zero_weight, **kwargs)
        self._states = self._maybe_compile(get_ne_states)  # compiled with enable_pt2_compile, as in TorchRec

    def _compute(self) -> List[MetricComputationReport]:
        reports = super()._compute()
        if self._include_logloss:
            reports += self._reports(
                MetricName.LOG_LOSS,
                lambda ce, pos, neg: compute_logloss(ce, pos, neg, self.eta),
                "cross_entropy_sum",
                "pos_labels",
                "neg_labels",
            )
        return reports


class NEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NE
    _computation_class: Type[RecMetricComputation] = NEMetricComputation
