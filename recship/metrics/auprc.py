"""Area under the precision-recall curve, weighted, over the window's samples: sorted by descending prediction,
one (recall, precision) point per distinct prediction, integrated with left rectangles (Riemann) from recall 0 at
precision 1. Key ``auprc-{task}|window_auprc`` and ``|lifetime_auprc``.

As in TorchRec: the window starts with one zero sample (prediction 0, label 0, weight 0) that stays until
``window_size`` newer samples push it out; the "lifetime" value is the weight-averaged mean of the window values
of every ``compute()``/``local_compute()`` so far (it depends on how often one computes), the same for all tasks.
"""

import logging
from typing import Any, Dict, List, Optional, Type

import torch
import torch.nn.functional as F

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException
from recship.metrics.sample_window import GROUPING_KEYS, LABELS, PREDICTIONS, REQUIRED_INPUTS, WEIGHTS  # TorchRec's names here
from recship.metrics.sample_window import SampleWindowComputation, _mean_over_groups

logger: logging.Logger = logging.getLogger(__name__)

LIFETIME_WEIGHTED_AUPRC = "lifetime_weighted_auprc"
LIFETIME_WEIGHT = "lifetime_weight"


def _riemann_integral(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -torch.sum((x[1:] - x[:-1]) * y[:-1])


def _compute_auprc_helper(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(predictions, descending=True, dim=-1)
    thresholds = torch.index_select(predictions, dim=0, index=order)
    sorted_labels = torch.index_select(labels, dim=0, index=order)
    sorted_weights = torch.index_select(weights, dim=0, index=order)
    last_of_each_value = F.pad(thresholds.diff(dim=0) != 0, [0, 1], value=1.0)
    num_tp = torch.cumsum(sorted_weights * sorted_labels, dim=0)[last_of_each_value]
    num_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=0)[last_of_each_value]
    precision = torch.cat([(num_tp / (num_tp + num_fp)).flip(0), num_tp.new_ones(1)])
    recall = torch.cat([(num_tp / num_tp[-1]).flip(0), num_tp.new_zeros(1)])
    return _riemann_integral(torch.nan_to_num(recall, 0.0), torch.nan_to_num(precision, 1.0))


def compute_auprc(n_tasks: int, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n_tasks] AUPRCs of [n_tasks, N] tensors."""
    return torch.cat([_compute_auprc_helper(p, l, w).view(1) for p, l, w in zip(predictions, labels, weights)])


def compute_auprc_per_group(
    n_tasks: int, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, grouping_keys: torch.Tensor
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of each group's AUPRC (0.5 with no group)."""
    if grouping_keys.numel() != 0 and grouping_keys[0] == -1:
        grouping_keys = grouping_keys[1:]
        predictions, labels, weights = predictions[:, 1:], labels[:, 1:], weights[:, 1:]
    return _mean_over_groups(_compute_auprc_helper, predictions, labels, weights, grouping_keys)


class AUPRCMetricComputation(SampleWindowComputation):
    """AUPRC over the window. Args: grouped_auprc (bool): also report the mean per-group AUPRC.

    Keeps its window as one [n_tasks, N] tensor per state whose placeholder sample stays until pushed out."""

    def __init__(self, *args: Any, grouped_auprc: bool = False, fused_update_limit: int = 0, **kwargs: Any) -> None:
        if grouped_auprc and fused_update_limit > 0:
            raise RecMetricException("Grouped AUPRC and Fused Update Limit cannot be enabled together yet.")
        super().__init__(*args, grouped=grouped_auprc, **kwargs)
        self._lifetime_weighted_auprc = torch.tensor(0.0, dtype=torch.float64)
        self._lifetime_weight = torch.tensor(0.0, dtype=torch.float64)

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights: [n_tasks, B]."""
        predictions, weights = self._given(predictions, weights)
        held = getattr(self, PREDICTIONS)[0].size(-1)
        start_index = max(held + predictions.size(-1) - self._window_size, 0)
        for name, value in ((PREDICTIONS, predictions), (LABELS, labels), (WEIGHTS, weights)):
            buffer = getattr(self, name)
            buffer[0] = torch.cat([buffer[0][:, start_index:], value.float()], dim=-1)
        if self._grouped:
            self._add_grouping_keys(kwargs, start_index)

    def _compute(self) -> List[MetricComputationReport]:
        predictions, labels, weights = (getattr(self, name)[0] for name in (PREDICTIONS, LABELS, WEIGHTS))
        window_auprc = compute_auprc(self._n_tasks, predictions, labels, weights)
        window_weight = weights.sum()
        device = window_auprc.device
        self._lifetime_weighted_auprc = self._lifetime_weighted_auprc.to(device) + (window_auprc * window_weight).sum()
        self._lifetime_weight = self._lifetime_weight.to(device) + window_weight * self._n_tasks
        lifetime = torch.where(
            self._lifetime_weight > 0,
            self._lifetime_weighted_auprc / self._lifetime_weight,
            torch.tensor(0.5, device=device, dtype=torch.float64),
        )
        reports = [
            MetricComputationReport(MetricName.AUPRC, MetricPrefix.WINDOW, window_auprc),
            MetricComputationReport(MetricName.AUPRC, MetricPrefix.LIFETIME, lifetime.expand(self._n_tasks)),
        ]
        if self._grouped:
            reports.append(
                MetricComputationReport(
                    MetricName.GROUPED_AUPRC,
                    MetricPrefix.WINDOW,
                    compute_auprc_per_group(self._n_tasks, predictions, labels, weights, getattr(self, GROUPING_KEYS)[0]),
                )
            )
        return reports


class AUPRCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.AUPRC
    _computation_class: Type[RecMetricComputation] = AUPRCMetricComputation

    _grouping_option = "grouped_auprc"
