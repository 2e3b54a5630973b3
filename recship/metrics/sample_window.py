"""The window of samples that AUC, RAUC and AUPRC keep: per rank the last ``window_size`` samples, as lists of
[n_tasks, b] prediction / label / weight tensors (and with grouping, the [N] group keys), reduced across ranks by
concatenating along the samples. An empty window holds one zero sample, dropped by the first update (AUPRC, with
its own update, keeps it until pushed out)."""

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from recship.metrics.metrics_namespace import MetricNameBase, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetricComputation, RecMetricException

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


def _state_reduction(state: List[torch.Tensor], dim: int = 1) -> List[torch.Tensor]:
    return [torch.cat(state, dim=dim)]


_grouping_keys_state_reduction = partial(_state_reduction, dim=0)


def _mean_over_groups(
    value_of: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    predictions: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    grouping_keys: torch.Tensor,
) -> torch.Tensor:
    """[n_tasks] means over the groups of ``grouping_keys`` ([N]) of ``value_of(predictions, labels, weights)`` of
    each group's samples (0.5 with no group); predictions, labels, weights: [n_tasks, N]."""
    groups = torch.unique(grouping_keys)
    means = []
    for p, l, w in zip(predictions, labels, weights):
        total = torch.tensor([0], dtype=torch.float32)
        for group in groups:
            mask = grouping_keys == group
            value = value_of(p[mask], l[mask], w[mask])
            total = total.to(value.device) + value.view(1)
        means.append(total / len(groups) if len(groups) > 0 else torch.tensor([0.5], dtype=torch.float32))
    return torch.cat(means)


def _window_mean_over_groups(
    value_of: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    predictions: List[torch.Tensor],
    labels: List[torch.Tensor],
    weights: List[torch.Tensor],
    grouping_keys: torch.Tensor,
) -> torch.Tensor:
    """``_mean_over_groups`` of a window's lists of [n_tasks, b] tensors, the keys' placeholder of an empty window
    dropped."""
    preds, labs, wts = _concat_if_needed(predictions, labels, weights)
    if grouping_keys.numel() != 0 and grouping_keys[0] == -1:
        grouping_keys = grouping_keys[1:]
    return _mean_over_groups(value_of, preds, labs, wts, grouping_keys)


class SampleWindowComputation(RecMetricComputation):
    """Keeps the window's samples; ``grouped`` adds the ``grouping_keys`` buffer, fed from
    ``required_inputs["grouping_keys"]`` at each update."""

    _GROUPED_NAME = "grouped"

    def __init__(self, *args: Any, grouped: bool = False, fused_update_limit: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if grouped and fused_update_limit > 0:
            raise RecMetricException(
                f"{type(self).__name__}: {self._GROUPED_NAME} and fused_update_limit cannot be enabled together"
            )
        self._grouped = grouped
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            self._add_state(name, [], add_window_state=False, dist_reduce_fx=_state_reduction, persistent=False)
        if grouped:
            self._add_state(
                GROUPING_KEYS, [], add_window_state=False, dist_reduce_fx=_grouping_keys_state_reduction, persistent=False
            )
        self._init_states()

    def _init_states(self) -> None:
        if len(getattr(self, PREDICTIONS)) > 0:
            return
        self._num_samples = 0
        for name in (PREDICTIONS, LABELS, WEIGHTS):
            getattr(self, name).append(torch.zeros((self._n_tasks, 1), dtype=torch.float, device=self.device))
        if self._grouped:
            getattr(self, GROUPING_KEYS).append(torch.tensor([-1], device=self.device))

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights: [n_tasks, B]; with grouping ``required_inputs["grouping_keys"]``: [B]."""
        predictions, weights = self._given(predictions, weights)
        predictions, labels, weights = predictions.float(), labels.float(), weights.float()
        batch_size = predictions.size(-1)
        start_index = max(self._num_samples + batch_size - self._window_size, 0)
        buffers = [getattr(self, PREDICTIONS), getattr(self, LABELS), getattr(self, WEIGHTS)]
        if self._num_samples == 0:  # drop the placeholder
            for buffer in buffers:
                buffer.pop(0)
            if self._grouped:
                # and its group key: TorchRec keeps it, so its keys run one ahead of the samples and a full window
                # fails (mask of N + 1 keys over N samples)
                keys = getattr(self, GROUPING_KEYS)
                keys[0] = keys[0][1:] if keys[0].numel() and keys[0][0] == -1 else keys[0]
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
        if self._grouped:
            self._add_grouping_keys(kwargs, start_index)

    def _add_grouping_keys(self, kwargs: Dict[str, Any], start_index: int) -> None:
        """Append the update's ``required_inputs["grouping_keys"]`` ([B]) to the keys from ``start_index`` on."""
        grouping_keys = kwargs.get(REQUIRED_INPUTS, {}).get(GROUPING_KEYS)  # type: ignore[union-attr]
        if grouping_keys is None:
            raise RecMetricException(f"Input '{GROUPING_KEYS}' are required for {type(self).__name__} grouped update")
        keys = getattr(self, GROUPING_KEYS)
        keys[0] = torch.cat([keys[0][start_index:], grouping_keys.squeeze()], dim=0)

    def _window(self) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
        return getattr(self, PREDICTIONS), getattr(self, LABELS), getattr(self, WEIGHTS)

    def _window_reports(
        self,
        name: MetricNameBase,
        compute: Callable[..., torch.Tensor],
        grouped_name: MetricNameBase,
        compute_per_group: Callable[..., torch.Tensor],
    ) -> List[MetricComputationReport]:
        """The window's ``compute(n_tasks, predictions, labels, weights)``, and with grouping its
        ``compute_per_group(..., grouping_keys)``."""
        window = self._window()
        reports = [MetricComputationReport(name, MetricPrefix.WINDOW, compute(self._n_tasks, *window))]
        if self._grouped:
            grouped = compute_per_group(self._n_tasks, *window, getattr(self, GROUPING_KEYS)[0])
            reports.append(MetricComputationReport(grouped_name, MetricPrefix.WINDOW, grouped))
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
