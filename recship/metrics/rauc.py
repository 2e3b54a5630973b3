"""Regression AUC: the share of sample pairs that the predictions order as the labels do. The samples are sorted
by (prediction, label) and the labels' inversions counted (merge sort): RAUC = 1 - inversions / (n (n - 1) / 2).
Weights are not used. Over the window of samples, as AUC. Key ``rauc-{task}|window_rauc`` (and
``|window_grouped_rauc`` with ``grouped_rauc``).
"""

import logging
from typing import Any, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sample_window import GROUPING_KEYS, LABELS, PREDICTIONS, REQUIRED_INPUTS, WEIGHTS  # TorchRec's names here
from recship.metrics.sample_window import SampleWindowComputation, _concat_if_needed, _window_mean_over_groups

logger: logging.Logger = logging.getLogger(__name__)


def count_reverse_pairs_divide_and_conquer(input: List[float]) -> float:
    """The share of pairs (i < j) with input[i] > input[j]; sorts ``input`` in place."""
    n = len(input)
    return divide(input, 0, n - 1) / (n * (n - 1) / 2)


def divide(input: List[float], low: int, high: int) -> int:
    """Inversions in input[low..high], which ends sorted (merge sort)."""
    if low >= high:
        return 0
    mid = low + (high - low) // 2
    return divide(input, low, mid) + divide(input, mid + 1, high) + conquer_and_count(input, low, mid, high)


def conquer_and_count(input: List[float], left_index: int, mid_index: int, right_index: int) -> int:
    """Merge the sorted runs input[left..mid] and input[mid+1..right]; the pairs across them out of order."""
    left, right = input[left_index : mid_index + 1], input[mid_index + 1 : right_index + 1]
    i = j = inversions = 0
    k = left_index
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            input[k] = left[i]
            i += 1
        else:  # right[j] is below every remaining left element
            input[k] = right[j]
            j += 1
            inversions += len(left) - i
        k += 1
    rest = left[i:] + right[j:]
    input[k : k + len(rest)] = rest
    return inversions


def _compute_rauc_helper(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ordered = [label for label, _ in sorted(zip(labels.tolist(), predictions.tolist()), key=lambda x: (x[1], x[0]))]
    if len(ordered) < 2:  # no pair (TorchRec divides by zero here)
        return torch.tensor(0.5)
    return torch.tensor(1 - count_reverse_pairs_divide_and_conquer(ordered))


def compute_rauc(
    n_tasks: int, predictions: List[torch.Tensor], labels: List[torch.Tensor], weights: List[torch.Tensor]
) -> torch.Tensor:
    """[n_tasks] RAUCs from lists of [n_tasks, b] tensors."""
    preds, labs, wts = _concat_if_needed(predictions, labels, weights)
    return torch.cat([_compute_rauc_helper(p, l, w).view(1) for p, l, w in zip(preds, labs, wts)])


def compute_rauc_per_group(
    n_tasks: int,
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    grouping_keys: torch.Tensor,
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of each group's RAUC (0.5 with no group)."""
    return _window_mean_over_groups(_compute_rauc_helper, predictions, labels, weights, grouping_keys)


class RAUCMetricComputation(SampleWindowComputation):
    """Window RAUC. Args: grouped_rauc (bool): also report the mean per-group RAUC."""

    _GROUPED_NAME = "grouped_rauc"

    def __init__(self, *args: Any, grouped_rauc: bool = False, fused_update_limit: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, grouped=grouped_rauc, fused_update_limit=fused_update_limit, **kwargs)

    def _compute(self) -> List[MetricComputationReport]:
        return self._window_reports(MetricName.RAUC, compute_rauc, MetricName.GROUPED_RAUC, compute_rauc_per_group)


class RAUCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.RAUC
    _computation_class: Type[RecMetricComputation] = RAUCMetricComputation

    _grouping_option = "grouped_rauc"
