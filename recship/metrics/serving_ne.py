"""NE over serving traffic, with the count of examples of non-zero weight. Keys ``serving_ne-{task}|lifetime_ne``,
``|window_ne`` and ``|total_examples`` (an int64 count, no window)."""

from typing import Any, Dict, List, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.ne import compute_ne, get_ne_states
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation
from recship.metrics.sums import SumsComputation

NUM_EXAMPLES = "num_examples"


class ServingNEMetricComputation(SumsComputation):
    _SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_state(
            NUM_EXAMPLES, torch.zeros(self._n_tasks, dtype=torch.long), add_window_state=False, dist_reduce_fx="sum",
            persistent=True,
        )
        self.eta = 1e-12

    def _num_samples(self, labels: torch.Tensor, predictions: torch.Tensor) -> int:
        return labels.shape[-1]

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        assert weights is not None
        getattr(self, NUM_EXAMPLES).add_(torch.count_nonzero(weights, dim=-1))
        return get_ne_states(labels, predictions, weights, self.eta)

    def _compute(self) -> List[MetricComputationReport]:
        def ne(ce: torch.Tensor, n: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
            return compute_ne(ce, n, pos, neg, self.eta)

        return self._reports(MetricName.NE, ne, *self._SUMS) + [
            MetricComputationReport(MetricName.TOTAL_EXAMPLES, MetricPrefix.DEFAULT, getattr(self, NUM_EXAMPLES).detach())
        ]


class ServingNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SERVING_NE
    _computation_class: Type[RecMetricComputation] = ServingNEMetricComputation
