"""Logs a value given as the label: ``scalar-{task}|lifetime_scalar`` is the mean label of the last update,
``|window_scalar`` the mean of the per-update means over the window (each update counts ``labels.shape[0]``
samples, the number of tasks, as in TorchRec). Reduced across ranks by the mean."""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation


class ScalarMetricComputation(RecMetricComputation):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("labels", "window_count"):
            self._add_state(
                name, torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=True, dist_reduce_fx="mean",
                persistent=False,
            )

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        states = {
            "labels": labels.mean(dim=-1),
            "window_count": torch.ones(self._n_tasks, device=labels.device, dtype=torch.double),
        }
        for name, value in states.items():
            setattr(self, name, value)  # the lifetime value is the latest one
            self._aggregate_window_state(name, value, labels.shape[0])

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(MetricName.SCALAR, MetricPrefix.LIFETIME, self.labels),
            MetricComputationReport(
                MetricName.SCALAR, MetricPrefix.WINDOW, self.get_window_state("labels") / self.get_window_state("window_count")
            ),
        ]


class ScalarMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SCALAR
    _computation_class: Type[RecMetricComputation] = ScalarMetricComputation
