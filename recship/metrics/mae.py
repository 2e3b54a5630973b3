"""Mean absolute error, weighted: sum(w * |y - prediction|) / sum(w) (0 with no weight). Keys
``mae-{task}|lifetime_mae`` and ``|window_mae``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

ERROR_SUM = "error_sum"
WEIGHTED_NUM_SAMPLES = "weighted_num_samples"


def compute_mae(error_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, error_sum / weighted_num_samples).double()


def compute_error_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * torch.abs(labels - predictions.double()), dim=-1)


def get_mae_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {ERROR_SUM: compute_error_sum(labels, predictions, weights), WEIGHTED_NUM_SAMPLES: torch.sum(weights, dim=-1)}


class MAEMetricComputation(SumsComputation):
    _NAME = MetricName.MAE
    _SUMS = (ERROR_SUM, WEIGHTED_NUM_SAMPLES)
    _states = staticmethod(get_mae_states)
    _value = staticmethod(compute_mae)


class MAEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.MAE
    _computation_class: Type[RecMetricComputation] = MAEMetricComputation
