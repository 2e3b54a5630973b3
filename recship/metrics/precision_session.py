"""Session-level precision: as session recall (``recship.metrics.recall_session``), weighted true positives /
weighted predicted positives, the top ``top_threshold`` of each session being the predicted positives. Keys
``precision_session_level-{task}|lifetime_precision_session_level`` and ``|window_...``."""

from typing import Type

import torch

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo, SessionMetricDef
from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.recall_session import NUM_TRUE_POS, _SessionComputation, _SessionMetric, ranking_within_session
from recship.metrics.rec_metric import RecMetric, RecMetricComputation, RecMetricException

NUM_FALSE_POS = "num_false_pos"
__all__ = ["NUM_FALSE_POS", "NUM_TRUE_POS", "PrecisionSessionMetric", "PrecisionSessionMetricComputation",
           "RecComputeMode", "RecMetric", "RecMetricException", "RecTaskInfo", "SessionMetricDef", "ranking_within_session"]


def _calc_num_false_pos(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * (1 - labels) * (predictions == 1).double(), dim=-1)


class PrecisionSessionMetricComputation(_SessionComputation):
    _MISSES = NUM_FALSE_POS
    _NAME = MetricName.PRECISION_SESSION_LEVEL
    _WHAT = "session precision"
    _count_misses = staticmethod(_calc_num_false_pos)
    get_precision_states = _SessionComputation._session_states


class PrecisionSessionMetric(_SessionMetric):
    _namespace: MetricNamespace = MetricNamespace.PRECISION_SESSION_LEVEL
    _label = "precision session-level"
    _computation_class: Type[RecMetricComputation] = PrecisionSessionMetricComputation
