"""AUC over the last ``window_size`` samples (per rank; all ranks' windows together after the reduction):
the weighted area under the ROC curve, by the trapezoid rule over the samples sorted by descending prediction.

    x_k = sum_{j<=k} w_j (1 - y_j),  y_k = sum_{j<=k} w_j y_j,  AUC = trapz(y, x) / (x_n * y_n)

0.5 when either class has no weight. Tied predictions are ordered as ``torch.argsort(descending=True)`` orders
them, as in TorchRec (so ties are not given half credit). The states are buffers of the window's samples, lists of
[n_tasks, b] tensors, reduced across ranks by concatenation along the samples. Key ``auc-{task}|window_auc`` (and
``|window_grouped_auc``, the mean of the per-group AUCs, with ``grouped_auc`` and a ``grouping_keys`` model output).
"""

import logging
from functools import partial
from typing import Any, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sample_window import GROUPING_KEYS, LABELS, PREDICTIONS, REQUIRED_INPUTS, WEIGHTS  # TorchRec's names here
from recship.metrics.sample_window import SampleWindowComputation, _concat_if_needed, _window_mean_over_groups

logger: logging.Logger = logging.getLogger(__name__)


def _compute_auc_helper(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, apply_bin: bool = False
) -> torch.Tensor:
    """AUC of one task's [N] samples (``apply_bin``: labels binarised at >= 0.039)."""
    order = torch.argsort(predictions, descending=True, dim=-1)
    sorted_labels = torch.index_select(labels, dim=0, index=order)
    if apply_bin:
        sorted_labels = torch.ge(sorted_labels, 0.039).to(dtype=sorted_labels.dtype)
    sorted_weights = torch.index_select(weights, dim=0, index=order)
    if sorted_weights.numel() == 0:
        return torch.tensor(0.5, device=sorted_weights.device)
    cum_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=0)
    cum_tp = torch.cumsum(sorted_weights * sorted_labels, dim=0)
    return torch.where(cum_fp[-1] * cum_tp[-1] == 0, 0.5, torch.trapz(cum_tp, cum_fp) / cum_fp[-1] / cum_tp[-1])


def compute_auc(
    n_tasks: int,
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    apply_bin: bool = False,
) -> torch.Tensor:
    """[n_tasks] AUCs from lists of [n_tasks, b] tensors (concatenated along the samples)."""
    preds, labs, wts = _concat_if_needed(predictions, labels, weights)
    return torch.cat([_compute_auc_helper(p, l, w, apply_bin).view(1) for p, l, w in zip(preds, labs, wts)])


def compute_auc_per_group(
    n_tasks: int,
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    grouping_keys: torch.Tensor,
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of each group's AUC (0.5 with no group)."""
    return _window_mean_over_groups(_compute_auc_helper, predictions, labels, weights, grouping_keys)


class AUCMetricComputation(SampleWindowComputation):
    """Window AUC over [n_tasks, B] updates.

    Args:
        grouped_auc (bool): also report the mean per-group AUC (needs ``grouping_keys`` in ``required_inputs``).
        apply_bin (bool): binarise the labels at 0.039.
    """

    _GROUPED_NAME = "grouped_auc"

    def __init__(
        self, *args: Any, grouped_auc: bool = False, apply_bin: bool = False, fused_update_limit: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(*args, grouped=grouped_auc, fused_update_limit=fused_update_limit, **kwargs)
        self._apply_bin = apply_bin

    def _compute(self) -> List[MetricComputationReport]:
        compute = partial(compute_auc, apply_bin=self._apply_bin)
        return self._window_reports(MetricName.AUC, compute, MetricName.GROUPED_AUC, compute_auc_per_group)


class AUCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.AUC
    _computation_class: Type[RecMetricComputation] = AUCMetricComputation

    _grouping_option = "grouped_auc"
