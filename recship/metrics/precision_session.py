"""Session-level precision: as session recall (``recship.metrics.recall_session``), weighted true positives /
weighted predicted positives, the top ``top_threshold`` of each session being the predicted positives. Keys
``precision_session_level-{task}|lifetime_precision_session_level`` and ``|window_...``."""

from typing import Dict, List, Type

import torch

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo, SessionMetricDef
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.recall_session import (
    NUM_TRUE_POS,
    _calc_num_true_pos,
    _ratio_or_nan,
    _SessionComputation,
    _SessionMetric,
    ranking_within_session,
)
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

NUM_FALSE_POS = "num_false_pos"
__all__ = ["NUM_FALSE_POS", "NUM_TRUE_POS", "PrecisionSessionMetric", "PrecisionSessionMetricComputation",
           "RecComputeMode", "RecMetric", "RecMetricException", "RecTaskInfo", "SessionMetricDef", "ranking_within_session"]


def _calc_num_false_pos(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * (1 - labels) * (predictions == 1).double(), dim=-1)


def _calc_precision(num_true_pos: torch.Tensor, num_false_pos: torch.Tensor) -> torch.Tensor:
    return _ratio_or_nan(num_true_pos, num_false_pos, "session precision")


class PrecisionSessionMetricComputation(_SessionComputation):
    _STATES = (NUM_TRUE_POS, NUM_FALSE_POS)

    def get_precision_states(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, session: torch.Tensor
    ) -> Dict[str, torch.Tensor]:
        predicted = self._top(predictions, session)
        if self.run_ranking_of_labels:
            labels = self._top(labels, session)
        return {
            NUM_TRUE_POS: _calc_num_true_pos(labels, predicted, weights),
            NUM_FALSE_POS: _calc_num_false_pos(labels, predicted, weights),
        }

    _session_states = get_precision_states

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(MetricName.PRECISION_SESSION_LEVEL, MetricPrefix.LIFETIME,
                                    _calc_precision(getattr(self, NUM_TRUE_POS), getattr(self, NUM_FALSE_POS))),
            MetricComputationReport(MetricName.PRECISION_SESSION_LEVEL, MetricPrefix.WINDOW,
                                    _calc_precision(self.get_window_state(NUM_TRUE_POS), self.get_window_state(NUM_FALSE_POS))),
        ]


class PrecisionSessionMetric(_SessionMetric):
    _namespace: MetricNamespace = MetricNamespace.PRECISION_SESSION_LEVEL
    _label = "precision session-level"
    _computation_class: Type[RecMetricComputation] = PrecisionSessionMetricComputation
