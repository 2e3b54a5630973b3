"""Precision per label of a multi-label task whose predictions and labels are integers encoding label sets
(bit i, least significant first, is label i: 5 = labels {0, 2}). Keys
``multi_label_precision-{task}|lifetime_multi_label_precision{label name}`` and ``|window_...``;
``RecMetricDef(arguments={"num_labels": 3, "label_names": ["cat", "dog", "horse"]})``."""

from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation


def compute_multi_label_precision(num_true_positives: torch.Tensor, num_false_positives: torch.Tensor) -> torch.Tensor:
    total = num_true_positives + num_false_positives
    return torch.where(total == 0.0, torch.zeros_like(total), num_true_positives / total)


class MultiLabelPrecisionMetricComputation(RecMetricComputation):
    """Args: num_labels (int): the bits decoded per integer; label_names (Optional[List[str]]): one per label
    (default ``label_{i}``). Per label a [1] true positive and false positive sum (with window)."""

    def __init__(self, *args: Any, num_labels: int = 1, label_names: Optional[List[str]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._num_labels = num_labels
        self._label_names = [f"label_{i}" for i in range(num_labels)] if label_names is None else label_names
        if len(self._label_names) != num_labels:
            raise ValueError(f"multi-label precision: {len(self._label_names)} label_names for num_labels {num_labels}")
        for name in self._label_names:
            for state in (f"true_pos_sum_{name}", f"false_pos_sum_{name}"):
                self._add_state(state, torch.zeros(1, dtype=torch.double), add_window_state=True, dist_reduce_fx="sum",
                                persistent=True)

    @staticmethod
    def _decode_integer_to_labels(tensor: torch.Tensor, num_labels: int) -> torch.Tensor:
        """[N] integers -> [N, num_labels] int32 bits, least significant first."""
        powers = (2 ** torch.arange(num_labels, device=tensor.device)).to(tensor.dtype)
        return ((tensor.reshape(-1, 1) // powers) % 2).to(torch.int32)

    def _prepare_inputs(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        predictions = self._decode_integer_to_labels(predictions.flatten(), self._num_labels)
        labels = self._decode_integer_to_labels(labels.flatten(), self._num_labels)
        if weights is None:
            weights = torch.ones_like(predictions, dtype=torch.float32)
        else:
            weights = weights.flatten().unsqueeze(-1).expand(-1, self._num_labels)
        return predictions, labels, weights

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions and labels: integer-coded label sets, any shape (flattened)."""
        if predictions is None:
            raise ValueError("MultiLabelPrecisionMetricComputation.update needs predictions")
        self.to(predictions.device)
        predictions, labels, weights = self._prepare_inputs(predictions, labels, weights)
        for i, name in enumerate(self._label_names):
            p, y, w = predictions[:, i], labels[:, i], weights[:, i]
            sums = {f"true_pos_sum_{name}": torch.sum(w * (p * y)), f"false_pos_sum_{name}": torch.sum(w * (p * (1 - y)))}
            for state, value in sums.items():
                getattr(self, state).add_(value)
                self._aggregate_window_state(state, value, predictions.shape[0])

    def _compute(self) -> List[MetricComputationReport]:
        reports = []
        for name in self._label_names:
            tp, fp = f"true_pos_sum_{name}", f"false_pos_sum_{name}"
            reports.append(MetricComputationReport(
                MetricName.MULTI_LABEL_PRECISION, MetricPrefix.LIFETIME,
                compute_multi_label_precision(getattr(self, tp), getattr(self, fp)), name,
            ))
            reports.append(MetricComputationReport(
                MetricName.MULTI_LABEL_PRECISION, MetricPrefix.WINDOW,
                compute_multi_label_precision(self.get_window_state(tp), self.get_window_state(fp)), name,
            ))
        return reports


class MultiLabelPrecisionMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.MULTI_LABEL_PRECISION
    _computation_class: Type[RecMetricComputation] = MultiLabelPrecisionMetricComputation
