"""The weighted average of the predictions, sum(w * prediction) / sum(w). Keys
``weighted_avg-{task}|lifetime_weighted_avg`` and ``|window_weighted_avg``.

As in TorchRec, the window counts each update as ``labels.shape[0]`` samples (the number of tasks of the
computation, not the batch size), so the window holds the last ``window_size / n_tasks`` updates.
"""

from typing import Any, Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation


def get_mean(value_sum: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
    return value_sum / num_samples


class WeightedAvgMetricComputation(SumsComputation):
    _NAME = MetricName.WEIGHTED_AVG
    _SUMS = ("weighted_sum", "weighted_num_samples")
    _value = staticmethod(get_mean)

    def _num_samples(self, labels: torch.Tensor, predictions: torch.Tensor) -> int:
        return labels.shape[0]

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        assert weights is not None
        return {"weighted_sum": (predictions * weights).sum(dim=-1), "weighted_num_samples": weights.sum(dim=-1)}


class WeightedAvgMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.WEIGHTED_AVG
    _computation_class: Type[RecMetricComputation] = WeightedAvgMetricComputation
