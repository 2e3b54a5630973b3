"""AUC over the last ``window_size`` samples (per rank; all ranks' windows together after the reduction):
the weighted area under the ROC curve, by the trapezoid rule over the samples sorted by descending prediction.

    x_k = sum_{j<=k} w_j (1 - y_j),  y_k = sum_{j<=k} w_j y_j,  AUC = trapz(y, x) / (x_n * y_n)

0.5 when either class has no weight. Tied predictions are ordered as ``torch.argsort(descending=True)`` orders
them, as in TorchRec (so ties are not given half credit). The states are buffers of the window's samples, lists of
[n_tasks, b] tensors, reduced across ranks by concatenation along the samples. Key ``auc-{task}|window_auc`` (and
``|window_grouped_auc``, the mean of the per-group AUCs, with ``grouped_auc`` and a ``grouping_keys`` model output).
"""

import logging
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

logger: logging.Logger = logging.getLogger(__name__)

PREDICTIONS = "predictions"
LABELS = "labels"
WEIGHTS = "weights"
GROUPING_KEYS = "grouping_keys"
REQUIRED_INPUTS = "required_inputs"


def _concat_if_needed(
    predictions: List[torch.Tensor], labels: List[torch.Tensor], weights: List[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(predictions) > 1:
        return torch.cat(predictions, dim=-1), torch.cat(labels, dim=-1), torch.cat(weights, dim=-1)
    return predictions[0], labels[0], weights[0]


def _compute_auc_helper(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, apply_bin: bool = False
) -> torch.Tensor:
    """AUC of one task's [N] samples (``apply_bin``: labels binarised at >= 0.039)."""
    order = torch.argsort(predictions, descending=True, dim=-1)
    sorted_labels = torch.index_select(labels, dim=0, index=order)
    if apply_bin:
        sorted_labels = torch.ge(sorted_labels, 0.039).to(dtype=sorted_labels.dtype)
    sorted_weights = torch.index_select(weights, dim=0, index=order)
    if sorted_weights.numel() == 0:
        return torch.tensor(0.5, device=sorted_weights.device)
    cum_fp = torch.cumsum(sorted_weights * (1.0 - sorted_labels), dim=0)
    cum_tp = torch.cumsum(sorted_weights * sorted_labels, dim=0)
    return torch.where(cum_fp[-1] * cum_tp[-1] == 0, 0.5, torch.trapz(cum_tp, cum_fp) / cum_fp[-1] / cum_tp[-1])


def compute_auc(
    n_tasks: int,
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    apply_bin: bool = False,
) -> torch.Tensor:
    """[n_tasks] AUCs from lists of [n_tasks, b] tensors (concatenated along the samples)."""
    preds, labs, wts = _concat_if_needed(predictions, labels, weights)
    return torch.cat([_compute_auc_helper(p, l, w, apply_bin).view(1) for p, l, w in zip(preds, labs, wts)])


def compute_auc_per_group(
    n_tasks: int,
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    grouping_keys: torch.Tensor,
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of each group's AUC (0.5 with no group)."""
    preds, labs, wts = _concat_if_needed(predictions, labels, weights)
    if grouping_keys.numel() != 0 and grouping_keys[0] == -1:  # the placeholder of an empty state
        grouping_keys = grouping_keys[1:]
    groups = torch.unique(grouping_keys)
    aucs = []
    for p, l, w in zip(preds, labs, wts):
        total = torch.tensor([0], dtype=torch.float32)
        for group in groups:
            mask = grouping_keys == group
            auc = _compute_auc_helper(p[mask], l[mask], w[mask])
            total = total.to(auc.device) + auc.view(1)
        aucs.append(total / len(groups) if len(groups) > 0 else torch.tensor([0.5], dtype=torch.float32))
    return torch.cat(aucs)


def _state_reduction(state: List[torch.Tensor], dim: int = 1) -> List[torch.Tensor]:
    return [torch.cat(state, dim=dim)]


_grouping_keys_state_reduction = partial(_state_reduction, dim=0)


class AUCMetricComputation(RecMetricComputation):
    """Window AUC over [n_tasks, B] updates.

    Args:
        grouped_auc (bool): also report the mean per-group AUC (needs ``grouping_keys`` in ``required_inputs``).
        apply_bin (bool): binarise the labels at 0.039.
    """

    def __init__(
        self, *args: Any, grouped_auc: bool = False, apply_bin: bool = False, fused_update_limit: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if grouped_auc and fused_update_limit > 0:
            raise RecMetricException("Grouped AUC and Fused Update Limit cannot be enabled together yet.")
        self._grouped_auc = grouped_auc
        self._apply_bin = apply_bin
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._add_state(name, [], add_window_state=False, dist_reduce_fx=_state_reduction, persistent=False)
        if grouped_auc:
            self._add_state(
                GROUPING_KEYS, [], add_window_state=False, dist_reduce_fx=_grouping_keys_state_reduction, persistent=False
            )
        self._init_states()

    def _init_states(self) -> None:
        """An empty window holds one [n_tasks, 1] zero sample (AUC 0.5), dropped by the first update."""
        if len(getattr(self, PREDICTIONS)) > 0:
            return
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            getattr(self, name).append(torch.zeros((self._n_tasks, 1), dtype=torch.float, device=self.device))
        if self._grouped_auc:
            getattr(self, GROUPING_KEYS).append(torch.tensor([-1], device=self.device))

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights: [n_tasks, B]; ``required_inputs["grouping_keys"]``: [B] with grouped_auc."""
        if predictions is None or weights is None:
            raise RecMetricException(
                "Inputs 'predictions' and 'weights' should not be None for AUCMetricComputation update"
            )
        predictions, labels, weights = predictions.float(), labels.float(), weights.float()
        batch_size = predictions.size(-1)
        start_index = max(self._num_samples + batch_size - self._window_size, 0)
        buffers = [getattr(self, PREDICTIONS), getattr(self, LABELS), getattr(self, WEIGHTS)]
        if self._num_samples == 0:  # drop the placeholder
            for buffer in buffers:
                buffer.pop(0)
        for buffer, value in zip(buffers, (predictions, labels, weights)):
            buffer.append(value)
        self._num_samples += batch_size
        while self._num_samples > self._window_size:  # trim the oldest samples to the window
            excess = self._num_samples - self._window_size
            if excess > buffers[0][0].size(-1):
                self._num_samples -= buffers[0][0].size(-1)
                for buffer in buffers:
                    buffer.pop(0)
            else:
                for buffer in buffers:
                    buffer[0] = buffer[0][:, excess:]
                    if torch.numel(buffer[0]) == 0:
                        buffer.pop(0)
                self._num_samples -= excess
        if self._grouped_auc:
            grouping_keys = kwargs.get(REQUIRED_INPUTS, {}).get(GROUPING_KEYS)  # type: ignore[union-attr]
            if grouping_keys is None:
                raise RecMetricException(
                    f"Input '{GROUPING_KEYS}' are required for AUCMetricComputation grouped update"
                )
            keys = getattr(self, GROUPING_KEYS)
            keys[0] = torch.cat([keys[0][start_index:], grouping_keys.squeeze()], dim=0)

    def _compute(self) -> List[MetricComputationReport]:
        states = [getattr(self, name) for name in (PREDICTIONS, LABELS, WEIGHTS)]
        reports = [
            MetricComputationReport(
                MetricName.AUC, MetricPrefix.WINDOW, compute_auc(self._n_tasks, *states, self._apply_bin)
            )
        ]
        if self._grouped_auc:
            reports.append(
                MetricComputationReport(
                    MetricName.GROUPED_AUC,
                    MetricPrefix.WINDOW,
                    compute_auc_per_group(self._n_tasks, *states, getattr(self, GROUPING_KEYS)[0]),
                )
            )
        return reports

    def _sync_dist(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        # one tensor per rank, in sample order, so that the reduction concatenates rank after rank
        for name in self._reductions:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) > 1:
                setattr(self, name, [torch.cat(value, dim=-1)])
        super()._sync_dist(process_group)

    def reset(self) -> None:
        super().reset()
        self._init_states()


class AUCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.AUC
    _computation_class: Type[RecMetricComputation] = AUCMetricComputation

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
        if kwargs.get("grouped_auc"):
            self._required_inputs.add(GROUPING_KEYS)
