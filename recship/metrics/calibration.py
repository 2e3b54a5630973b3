"""Calibration: sum(w * prediction) / sum(w * label), 0 where no weighted positives. 1 is calibrated.
Keys ``calibration-{task}|lifetime_calibration`` and ``|window_calibration``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

CALIBRATION_NUM = "calibration_num"
CALIBRATION_DENOM = "calibration_denom"


def compute_calibration(calibration_num: torch.Tensor, calibration_denom: torch.Tensor) -> torch.Tensor:
    return torch.where(calibration_denom <= 0.0, 0.0, calibration_num / calibration_denom).double()


def get_calibration_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor
) -> Dict[str, torch.Tensor]:
    return {
        CALIBRATION_NUM: torch.sum(predictions * weights, dim=-1),
        CALIBRATION_DENOM: torch.sum(labels * weights, dim=-1),
    }


class CalibrationMetricComputation(SumsComputation):
    _NAME = MetricName.CALIBRATION
    _SUMS = (CALIBRATION_NUM, CALIBRATION_DENOM)
    _states = staticmethod(get_calibration_states)
    _value = staticmethod(compute_calibration)


class CalibrationMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.CALIBRATION
    _computation_class: Type[RecMetricComputation] = CalibrationMetricComputation
