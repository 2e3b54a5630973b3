"""Hindsight target precision: over 1000 thresholds evenly spaced on [0, 1], the first (lowest) threshold whose
precision reaches ``target_precision``, and the precision and recall there. Keys
``hindsight_target_pr-{task}|lifetime_hindsight_target_pr`` (the threshold's index), ``|lifetime_hindsight_target_
precision``, ``|lifetime_hindsight_target_recall`` and their window versions. One task per computation (the
states are per threshold).

TorchRec 1.8.0 reports the index as ``torch.Tensor(idx)``, an uninitialised tensor of idx elements; recship
reports the index itself, as a float64 [1] tensor.
"""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

TARGET_PRECISION = "target_precision"
THRESHOLD_GRANULARITY = 1000


def compute_precision(num_true_positives: torch.Tensor, num_false_positives: torch.Tensor) -> torch.Tensor:
    predicted = num_true_positives + num_false_positives
    return torch.where(predicted == 0.0, 0.0, num_true_positives / predicted.double())


def compute_recall(num_true_positives: torch.Tensor, num_false_negitives: torch.Tensor) -> torch.Tensor:
    positives = num_true_positives + num_false_negitives
    return torch.where(positives == 0.0, 0.0, num_true_positives / positives)


def compute_threshold_idx(num_true_positives: torch.Tensor, num_false_positives: torch.Tensor, target_precision: float) -> int:
    """The first threshold index whose precision is at least the target (the last index if none)."""
    reached = compute_precision(num_true_positives, num_false_positives) >= target_precision
    hits = torch.nonzero(reached[:THRESHOLD_GRANULARITY])
    return int(hits[0]) if hits.numel() else THRESHOLD_GRANULARITY - 1


def _per_threshold(values: torch.Tensor, predictions: torch.Tensor, above: bool) -> torch.Tensor:
    """[THRESHOLD_GRANULARITY]: for each threshold t, the sum of ``values`` where prediction >= t (``above``) or
    <= t. predictions and values: [1, B] (one task) or [B]."""
    predictions, values = predictions.double().reshape(-1), values.reshape(-1)
    thresholds = torch.linspace(0, 1, steps=THRESHOLD_GRANULARITY)
    out = torch.zeros(THRESHOLD_GRANULARITY, dtype=torch.double)
    for i, threshold in enumerate(thresholds):
        out[i] = torch.sum(values * ((predictions >= threshold) if above else (predictions <= threshold)), -1)
    return out


def compute_true_pos_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _per_threshold(weights * labels, predictions, above=True)


def compute_false_pos_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _per_threshold(weights * (1 - labels), predictions, above=True)


def compute_false_neg_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _per_threshold(weights * labels, predictions, above=False)


def get_pr_states(labels: torch.Tensor, predictions: torch.Tensor, weights: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    if weights is None:
        weights = torch.ones_like(predictions)
    return {
        "true_pos_sum": compute_true_pos_sum(labels, predictions, weights),
        "false_pos_sum": compute_false_pos_sum(labels, predictions, weights),
        "false_neg_sum": compute_false_neg_sum(labels, predictions, weights),
    }


class HindsightTargetPRMetricComputation(RecMetricComputation):
    """Args: target_precision (float): the precision to reach."""

    def __init__(self, *args: Any, target_precision: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._n_tasks != 1:
            raise ValueError("HindsightTargetPRMetric keeps one task per computation: use UNFUSED_TASKS_COMPUTATION")
        for name in ("true_pos_sum", "false_pos_sum", "false_neg_sum"):
            self._add_state(name, torch.zeros(THRESHOLD_GRANULARITY, dtype=torch.double), add_window_state=True,
                            dist_reduce_fx="sum", persistent=True)
        self._target_precision = target_precision

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        if predictions is None:
            raise RecMetricException("Inputs 'predictions' should not be None for HindsightTargetPRMetricComputation update")
        self._add_sums(get_pr_states(labels, predictions, weights), predictions.shape[-1])

    def _compute(self) -> List[MetricComputationReport]:
        reports = []
        for span, state in ((MetricPrefix.LIFETIME, lambda n: getattr(self, n)), (MetricPrefix.WINDOW, self.get_window_state)):
            tp, fp, fn = state("true_pos_sum"), state("false_pos_sum"), state("false_neg_sum")
            idx = compute_threshold_idx(tp, fp, self._target_precision)
            reports.append((span, idx, compute_precision(tp[idx], fp[idx]), compute_recall(tp[idx], fn[idx])))
        out = [MetricComputationReport(MetricName.HINDSIGHT_TARGET_PR, span, torch.tensor([float(idx)], dtype=torch.double))
               for span, idx, _, _ in reports]
        out += [MetricComputationReport(MetricName.HINDSIGHT_TARGET_PRECISION, span, p) for span, _, p, _ in reports]
        out += [MetricComputationReport(MetricName.HINDSIGHT_TARGET_RECALL, span, r) for span, _, _, r in reports]
        return out


class HindsightTargetPRMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.HINDSIGHT_TARGET_PR
    _computation_class: Type[RecMetricComputation] = HindsightTargetPRMetricComputation
