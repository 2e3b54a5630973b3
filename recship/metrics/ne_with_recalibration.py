"""NE of recalibrated predictions (see ``recship.metrics.calibration_with_recalibration``): each prediction p
becomes p / (p + (1 - p) / c) first. Keys ``recalibrated_ne-{task}|lifetime_ne`` and ``|window_ne`` (and the
log loss with ``include_logloss``, which TorchRec 1.8.0 drops here: its constructor loses the flag)."""

from typing import Any, Dict, Type

import torch

from recship.metrics.calibration_with_recalibration import _recalibrate
from recship.metrics.metrics_namespace import MetricNamespace
from recship.metrics.ne import NEMetricComputation, get_ne_states
from recship.metrics.rec_metric import RecMetric, RecMetricComputation


class RecalibratedNEMetricComputation(NEMetricComputation):
    """Args: include_logloss, allow_missing_label_with_zero_weight: as NE; recalibration_coefficient (float): the
    negatives' sampling rate c."""

    def __init__(
        self,
        *args: Any,
        include_logloss: bool = False,
        allow_missing_label_with_zero_weight: bool = False,
        recalibration_coefficient: float = 1.0,
        **kwargs: Any,
    ) -> None:
        self._recalibration_coefficient = recalibration_coefficient
        super().__init__(
            *args,
            include_logloss=include_logloss,
            allow_missing_label_with_zero_weight=allow_missing_label_with_zero_weight,
            **kwargs,
        )

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        coef = self._recalibration_coefficient * torch.ones_like(predictions)
        return get_ne_states(labels, _recalibrate(predictions, coef), weights, self.eta)


class RecalibratedNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.RECALIBRATED_NE
    _computation_class: Type[RecMetricComputation] = RecalibratedNEMetricComputation
