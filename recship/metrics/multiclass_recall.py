"""Multiclass recall at k: the weighted share of samples whose label is among the k + 1 highest predicted classes,
for k = 0 .. n_classes - 1. Predictions [B, n_classes], labels [B] class ids; ``RecMetricDef(arguments=
{"number_of_classes": C})``. Keys ``multiclass_recall-{task}|lifetime_multiclass_recall`` and
``|window_multiclass_recall``, each value [n_classes] per task."""

import logging
from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation

logger: logging.Logger = logging.getLogger(__name__)


def compute_true_positives_at_k(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, n_classes: int
) -> torch.Tensor:
    """Cumulative weighted hits at ranks 0 .. n_classes - 1: predictions [B, C] or [T, B, C], labels and weights
    [B] or [T, B] -> [C] or [T, C]."""
    ranks = torch.argsort(predictions, dim=-1, descending=True)
    hits = torch.zeros(1, device=predictions.device) if predictions.ndim == 2 else torch.zeros(
        predictions.shape[0], 1, device=predictions.device
    )
    columns = []
    for k in range(n_classes):
        at_k = (labels.unsqueeze(-1) == ranks[..., k : k + 1]) * weights.unsqueeze(-1)
        hits = hits + at_k.sum(dim=-2)
        columns.append(hits)
    return torch.cat(columns, dim=-1)


def compute_multiclass_recall_at_k(tp_at_k: torch.Tensor, total_weights: torch.Tensor) -> torch.Tensor:
    return tp_at_k / total_weights.unsqueeze(-1)


def get_multiclass_recall_states(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, n_classes: int
) -> Dict[str, torch.Tensor]:
    return {
        "tp_at_k": compute_true_positives_at_k(predictions, labels, weights, n_classes),
        "total_weights": torch.sum(weights, dim=-1),
    }


class MulticlassRecallMetricComputation(RecMetricComputation):
    """Takes ``number_of_classes`` (required) among its keyword arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "number_of_classes" not in kwargs:
            raise ValueError("MulticlassRecallMetric needs number_of_classes (RecMetricDef.arguments)")
        self._n_classes: int = kwargs.pop("number_of_classes")
        super().__init__(*args, **kwargs)
        self._add_state(
            "tp_at_k", torch.zeros(self._n_tasks, self._n_classes, dtype=torch.double), add_window_state=True,
            dist_reduce_fx="sum", persistent=True,
        )
        self._add_state(
            "total_weights", torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=True,
            dist_reduce_fx="sum", persistent=True,
        )

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions [n_tasks, B, C], labels and weights [n_tasks, B]."""
        predictions, weights = self._given(predictions, weights)
        self._add_sums(get_multiclass_recall_states(predictions, labels, weights, self._n_classes), predictions.shape[-2])

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(
                MetricName.MULTICLASS_RECALL, MetricPrefix.LIFETIME, compute_multiclass_recall_at_k(self.tp_at_k, self.total_weights)
            ),
            MetricComputationReport(
                MetricName.MULTICLASS_RECALL,
                MetricPrefix.WINDOW,
                compute_multiclass_recall_at_k(self.get_window_state("tp_at_k"), self.get_window_state("total_weights")),
            ),
        ]


class MulticlassRecallMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.MULTICLASS_RECALL
    _computation_class: Type[RecMetricComputation] = MulticlassRecallMetricComputation

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
