"""The weighted averages of the labels and of the predictions. Keys ``average-{task}|lifetime_label_average``,
``|lifetime_prediction_average``, ``|window_label_average``, ``|window_prediction_average``."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

LABEL_SUM = "label_sum"
PREDICTION_SUM = "prediction_sum"
WEIGHTED_NUM_SAMPLES = "weighted_num_samples"


def compute_average(weighted_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, weighted_sum / weighted_num_samples).double()


def get_average_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {
        LABEL_SUM: torch.sum(labels * weights, dim=-1),
        PREDICTION_SUM: torch.sum(predictions * weights, dim=-1),
        WEIGHTED_NUM_SAMPLES: torch.sum(weights, dim=-1),
    }


class AverageMetricComputation(SumsComputation):
    _SUMS = (LABEL_SUM, PREDICTION_SUM, WEIGHTED_NUM_SAMPLES)

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_average_states(labels, predictions, weights)

    def _compute(self) -> List[MetricComputationReport]:
        labels = self._reports(MetricName.LABEL_AVERAGE, compute_average, LABEL_SUM, WEIGHTED_NUM_SAMPLES)
        predictions = self._reports(MetricName.PREDICTION_AVERAGE, compute_average, PREDICTION_SUM, WEIGHTED_NUM_SAMPLES)
        return [labels[0], predictions[0], labels[1], predictions[1]]


class AverageMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.AVERAGE
    _computation_class: Type[RecMetricComputation] = AverageMetricComputation
