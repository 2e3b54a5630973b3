"""Calibration over serving traffic, with the count of examples of non-zero weight. Keys
``serving_calibration-{task}|lifetime_calibration``, ``|window_calibration`` and ``|total_examples``."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.calibration import CALIBRATION_DENOM, CALIBRATION_NUM, compute_calibration, get_calibration_states
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

NUM_EXAMPLES = "num_examples"
__all__ = ["CALIBRATION_DENOM", "CALIBRATION_NUM", "NUM_EXAMPLES", "ServingCalibrationMetric", "ServingCalibrationMetricComputation"]


class ServingCalibrationMetricComputation(SumsComputation):
    _SUMS = (CALIBRATION_NUM, CALIBRATION_DENOM)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_state(
            NUM_EXAMPLES, torch.zeros(self._n_tasks, dtype=torch.long), add_window_state=False, dist_reduce_fx="sum",
            persistent=True,
        )

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        assert weights is not None
        getattr(self, NUM_EXAMPLES).add_(torch.count_nonzero(weights, dim=-1))
        return get_calibration_states(labels, predictions, weights)

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(MetricName.CALIBRATION, compute_calibration, *self._SUMS) + [
            MetricComputationReport(MetricName.TOTAL_EXAMPLES, MetricPrefix.DEFAULT, getattr(self, NUM_EXAMPLES).detach())
        ]


class ServingCalibrationMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SERVING_CALIBRATION
    _computation_class: Type[RecMetricComputation] = ServingCalibrationMetricComputation
