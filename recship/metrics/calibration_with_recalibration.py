"""Calibration of recalibrated predictions: with negatives downsampled by a rate c in training, a prediction p
becomes p / (p + (1 - p) / c) before the calibration sums (``recalibration_coefficient`` = c). Keys
``recalibrated_calibration-{task}|lifetime_calibration`` and ``|window_calibration``."""

from typing import Any, Dict, Optional, Type

import torch

from recship.metrics.calibration import CALIBRATION_DENOM, CALIBRATION_NUM, CalibrationMetricComputation, get_calibration_states
from recship.metrics.metrics_namespace import MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation

__all__ = ["CALIBRATION_DENOM", "CALIBRATION_NUM", "RecalibratedCalibrationMetric", "RecalibratedCalibrationMetricComputation"]


def _recalibrate(predictions: torch.Tensor, calibration_coef: Optional[torch.Tensor]) -> torch.Tensor:
    """p / (p + (1 - p) / c): a prediction of a model trained on negatives kept at rate c, for all negatives."""
    if calibration_coef is None:
        return predictions
    return predictions / (predictions + (1.0 - predictions) / calibration_coef)


class RecalibratedCalibrationMetricComputation(CalibrationMetricComputation):
    """Args: recalibration_coefficient (float): the negatives' sampling rate c."""

    def __init__(self, *args: Any, recalibration_coefficient: float = 1.0, **kwargs: Any) -> None:
        self._recalibration_coefficient = recalibration_coefficient
        super().__init__(*args, **kwargs)

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        coef = self._recalibration_coefficient * torch.ones_like(predictions)
        return get_calibration_states(labels, _recalibrate(predictions, coef), weights)


class RecalibratedCalibrationMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.RECALIBRATED_CALIBRATION
    _computation_class: Type[RecMetricComputation] = RecalibratedCalibrationMetricComputation
