"""Normalised MSE and RMSE: the model's MSE (RMSE) divided by that of always predicting 1 (0 where that is 0).
Keys ``nmse-{task}|lifetime_nmse``, ``|lifetime_nrmse``, ``|window_nmse``, ``|window_nrmse``."""

from typing import Any, Dict, List

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.mse import (
    ERROR_SUM,
    WEIGHTED_NUM_SAMPLES,
    MSEMetricComputation,
    compute_error_sum,
    compute_mse,
    compute_rmse,
    get_mse_states,
)
from recship.metrics.rec_metric import MetricComputationReport, RecMetric

CONST_PRED_ERROR_SUM = "const_pred_error_sum"


def compute_norm(model_error_sum: torch.Tensor, baseline_error_sum: torch.Tensor) -> torch.Tensor:
    return torch.where(baseline_error_sum == 0, torch.tensor(0.0), model_error_sum / baseline_error_sum).double()


def get_norm_mse_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {
        **get_mse_states(labels, predictions, weights),
        CONST_PRED_ERROR_SUM: compute_error_sum(labels, torch.ones_like(labels), weights),
    }


class NMSEMetricComputation(MSEMetricComputation):
    _SUMS = MSEMetricComputation._SUMS + (CONST_PRED_ERROR_SUM,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def _is_persistent(self, name: str) -> bool:
        return name == CONST_PRED_ERROR_SUM or super()._is_persistent(name)

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return get_norm_mse_states(labels, predictions, weights)

    def _compute(self) -> List[MetricComputationReport]:
        reports = []
        for prefix, state in ((MetricPrefix.LIFETIME, lambda s: getattr(self, s)), (MetricPrefix.WINDOW, self.get_window_state)):
            error, const_error, n = state(ERROR_SUM), state(CONST_PRED_ERROR_SUM), state(WEIGHTED_NUM_SAMPLES)
            reports.append(MetricComputationReport(MetricName.NMSE, prefix, compute_norm(compute_mse(error, n), compute_mse(const_error, n))))
            reports.append(MetricComputationReport(MetricName.NRMSE, prefix, compute_norm(compute_rmse(error, n), compute_rmse(const_error, n))))
        return reports


class NMSEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NMSE
    _computation_class = NMSEMetricComputation
