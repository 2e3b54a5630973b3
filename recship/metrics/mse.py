"""Mean squared error, its root, and (``include_r_squared``) R^2 = 1 - SSE / (sum(w y^2) - sum(w y)^2 / sum(w)),
all weighted. Keys ``mse-{task}|lifetime_mse``, ``|lifetime_rmse``, ``|window_mse``, ``|window_rmse`` (and
``|lifetime_r_squared``, ``|window_r_squared``)."""

from typing import Any, Dict, List, Tuple, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

ERROR_SUM = "error_sum"
WEIGHTED_NUM_SAMPLES = "weighted_num_samples"
LABEL_SUM = "label_sum"
LABEL_SQUARED_SUM = "label_squared_sum"


def compute_mse(error_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, error_sum / weighted_num_samples).double()


def compute_rmse(error_sum: torch.Tensor, weighted_num_samples: torch.Tensor) -> torch.Tensor:
    return torch.where(weighted_num_samples == 0.0, 0.0, torch.sqrt(error_sum / weighted_num_samples)).double()


def compute_r_squared(
    error_sum: torch.Tensor, weighted_num_samples: torch.Tensor, label_sum: torch.Tensor, label_squared_sum: torch.Tensor
) -> torch.Tensor:
    """1 - SSE / total sum of squares (1 where the labels do not vary)."""
    total = label_squared_sum.double() - torch.square(label_sum.double()) / weighted_num_samples.double()
    return torch.where(total == 0.0, 1.0, 1.0 - error_sum / total).double()


def compute_error_sum(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * torch.square(labels - predictions.double()), dim=-1)


def get_mse_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {
        ERROR_SUM: compute_error_sum(labels, predictions, weights),
        WEIGHTED_NUM_SAMPLES: torch.sum(weights, dim=-1),
        LABEL_SUM: torch.sum(weights * labels, dim=-1),
        LABEL_SQUARED_SUM: torch.sum(weights * torch.square(labels), dim=-1),
    }


class MSEMetricComputation(SumsComputation):
    """Args: include_r_squared (bool): also report R^2 (its label sums are then persistent)."""

    _SUMS: Tuple[str, ...] = (ERROR_SUM, WEIGHTED_NUM_SAMPLES, LABEL_SUM, LABEL_SQUARED_SUM)

    def __init__(self, *args: Any, include_r_squared: bool = False, **kwargs: Any) -> None:
        self._include_r_squared = include_r_squared
        super().__init__(*args, **kwargs)

    def _is_persistent(self, name: str) -> bool:
        return name in (ERROR_SUM, WEIGHTED_NUM_SAMPLES) or self._include_r_squared

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_mse_states(labels, predictions, weights)

    def _compute(self) -> List[MetricComputationReport]:
        mse = self._reports(MetricName.MSE, compute_mse, ERROR_SUM, WEIGHTED_NUM_SAMPLES)
        rmse = self._reports(MetricName.RMSE, compute_rmse, ERROR_SUM, WEIGHTED_NUM_SAMPLES)
        reports = [mse[0], rmse[0], mse[1], rmse[1]]
        if self._include_r_squared:
            reports += self._reports(MetricName.R_SQUARED, compute_r_squared, *self._SUMS)
        return reports


class MSEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.MSE
    _computation_class: Type[RecMetricComputation] = MSEMetricComputation
