"""CTR: the weighted rate of positive labels, sum(w * label) / sum(w) (0 with no weight). Keys
``ctr-{task}|lifetime_ctr`` and ``|window_ctr``."""

from typing import Dict, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

CTR_NUM = "ctr_num"
CTR_DENOM = "ctr_denom"


def compute_ctr(ctr_num: torch.Tensor, ctr_denom: torch.Tensor) -> torch.Tensor:
    return torch.where(ctr_denom == 0.0, 0.0, ctr_num / ctr_denom).double()


def get_ctr_states(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {CTR_NUM: torch.sum(labels * weights, dim=-1), CTR_DENOM: torch.sum(weights, dim=-1)}


class CTRMetricComputation(SumsComputation):
    _NAME = MetricName.CTR
    _SUMS = (CTR_NUM, CTR_DENOM)
    _states = staticmethod(get_ctr_states)
    _value = staticmethod(compute_ctr)


class CTRMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.CTR
    _computation_class: Type[RecMetricComputation] = CTRMetricComputation
