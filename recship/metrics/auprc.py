"""Area under the precision-recall curve, weighted, over the window's samples: sorted by descending prediction,
one (recall, precision) point per distinct prediction, integrated with left rectangles (Riemann) from recall 0 at
precision 1. Key ``auprc-{task}|window_auprc`` and ``|lifetime_auprc``.

As in TorchRec: the window starts with one zero sample (prediction 0, label 0, weight 0) that stays until
``window_size`` newer samples push it out; the "lifetime" value is the weight-averaged mean of the window values
of every ``compute()``/``local_compute()`` so far (it depends on how often one computes), the same for all tasks.
"""

import logging
from typing import Any, Dict, List, Optional, Type

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException
from recship.metrics.sample_window import _grouping_keys_state_reduction, _state_reduction

logger: logging.Logger = logging.getLogger(__name__)

PREDICTIONS = "predictions"
LABELS = "labels"
WEIGHTS = "weights"
GROUPING_KEYS = "grouping_keys"
REQUIRED_INPUTS = "required_inputs"
LIFETIME_WEIGHTED_AUPRC = "lifetime_weighted_auprc"
LIFETIME_WEIGHT = "lifetime_weight"


def _riemann_integral(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -torch.sum((x[1:] - x[:-1]) * y[:-1])


def _compute_auprc_helper(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(predictions, descending=True, dim=-1)
    thresholds = torch.index_select(predictions, dim=0, index=order)
    sorted_labels = torch.index_select(labels, dim=0, index=order)
    sorted_weights = torch.index_select(weights, dim=0, index=order)
    last_of_each_value = F.pad(thresholds.diff(dim=0) != 0, [0, 1], value=1.0)
    num_tp = torch.cumsum(sorted_weights * sorted_labels, dim=0)[last_of_each_value]
    num_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=0)[last_of_each_value]
    precision = torch.cat([(num_tp / (num_tp + num_fp)).flip(0), num_tp.new_ones(1)])
    recall = torch.cat([(num_tp / num_tp[-1]).flip(0), num_tp.new_zeros(1)])
    return _riemann_integral(torch.nan_to_num(recall, 0.0), torch.nan_to_num(precision, 1.0))


def compute_auprc(n_tasks: int, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n_tasks] AUPRCs of [n_tasks, N] tensors."""
    return torch.cat([_compute_auprc_helper(p, l, w).view(1) for p, l, w in zip(predictions, labels, weights)])


def compute_auprc_per_group(
    n_tasks: int, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, grouping_keys: torch.Tensor
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of each group's AUPRC (0.5 with no group)."""
    if grouping_keys.numel() != 0 and grouping_keys[0] == -1:
        grouping_keys = grouping_keys[1:]
        predictions, labels, weights = predictions[:, 1:], labels[:, 1:], weights[:, 1:]
    groups = torch.unique(grouping_keys)
    auprcs = []
    for p, l, w in zip(predictions, labels, weights):
        total = torch.tensor([0], dtype=torch.float32)
        for group in groups:
            mask = grouping_keys == group
            auprc = _compute_auprc_helper(p[mask], l[mask], w[mask])
            total = total.to(auprc.device) + auprc.view(1)
        auprcs.append(total / len(groups) if len(groups) > 0 else torch.tensor([0.5], dtype=torch.float32))
    return torch.cat(auprcs)


class AUPRCMetricComputation(RecMetricComputation):
    """AUPRC over the window. Args: grouped_auprc (bool): also report the mean per-group AUPRC."""

    def __init__(self, *args: Any, grouped_auprc: bool = False, fused_update_limit: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if grouped_auprc and fused_update_limit > 0:
            raise RecMetricException("Grouped AUPRC and Fused Update Limit cannot be enabled together yet.")
        self._grouped_auprc = grouped_auprc
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._add_state(name, [], add_window_state=False, dist_reduce_fx=_state_reduction, persistent=False)
        if grouped_auprc:
            self._add_state(
                GROUPING_KEYS, [], add_window_state=False, dist_reduce_fx=_grouping_keys_state_reduction, persistent=False
            )
        self._lifetime_weighted_auprc = torch.tensor(0.0, dtype=torch.float64)
        self._lifetime_weight = torch.tensor(0.0, dtype=torch.float64)
        self._init_states()

    def _init_states(self) -> None:
        if len(getattr(self, PREDICTIONS)) > 0:
            return
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            getattr(self, name).append(torch.zeros((self._n_tasks, 1), dtype=torch.float, device=self.device))
        if self._grouped_auprc:
            getattr(self, GROUPING_KEYS).append(torch.tensor([-1], device=self.device))

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights: [n_tasks, B]."""
        if predictions is None or weights is None:
            raise RecMetricException(
                "Inputs 'predictions' and 'weights' should not be None for AUPRCMetricComputation update"
            )
        held = getattr(self, PREDICTIONS)[0].size(-1)
        start_index = max(held + predictions.size(-1) - self._window_size, 0)
        for name, value in ((PREDICTIONS, predictions), (LABELS, labels), (WEIGHTS, weights)):
            buffer = getattr(self, name)
            buffer[0] = torch.cat([buffer[0][:, start_index:], value.float()], dim=-1)
        if self._grouped_auprc:
            grouping_keys = kwargs.get(REQUIRED_INPUTS, {}).get(GROUPING_KEYS)  # type: ignore[union-attr]
            if grouping_keys is None:
                raise RecMetricException(f"Input '{GROUPING_KEYS}' are required for AUPRCMetricComputation grouped update")
            keys = getattr(self, GROUPING_KEYS)
            keys[0] = torch.cat([keys[0][start_index:], grouping_keys.squeeze()], dim=0)

    def _compute(self) -> List[MetricComputationReport]:
        predictions, labels, weights = (getattr(self, name)[0] for name in (PREDICTIONS, LABELS, WEIGHTS))
        window_auprc = compute_auprc(self._n_tasks, predictions, labels, weights)
        window_weight = weights.sum()
        device = window_auprc.device
        self._lifetime_weighted_auprc = self._lifetime_weighted_auprc.to(device) + (window_auprc * window_weight).sum()
        self._lifetime_weight = self._lifetime_weight.to(device) + window_weight * self._n_tasks
        lifetime = torch.where(
            self._lifetime_weight > 0,
            self._lifetime_weighted_auprc / self._lifetime_weight,
            torch.tensor(0.5, device=device, dtype=torch.float64),
        )
        reports = [
            MetricComputationReport(MetricName.AUPRC, MetricPrefix.WINDOW, window_auprc),
            MetricComputationReport(MetricName.AUPRC, MetricPrefix.LIFETIME, lifetime.expand(self._n_tasks)),
        ]
        if self._grouped_auprc:
            reports.append(
                MetricComputationReport(
                    MetricName.GROUPED_AUPRC,
                    MetricPrefix.WINDOW,
                    compute_auprc_per_group(self._n_tasks, predictions, labels, weights, getattr(self, GROUPING_KEYS)[0]),
                )
            )
        return reports

    def reset(self) -> None:
        super().reset()
        self._init_states()


class AUPRCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.AUPRC
    _computation_class: Type[RecMetricComputation] = AUPRCMetricComputation

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: List[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        compute_on_all_ranks: bool = False,
        should_validate_update: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            world_size=world_size,
            my_rank=my_rank,
            batch_size=batch_size,
            tasks=tasks,
            compute_mode=compute_mode,
            window_size=window_size,
            fused_update_limit=fused_update_limit,
            compute_on_all_ranks=compute_on_all_ranks,
            should_validate_update=should_validate_update,
            process_group=process_group,
            **kwargs,
        )
        if kwargs.get("grouped_auprc"):
            self._required_inputs.add(GROUPING_KEYS)
