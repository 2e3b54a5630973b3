"""NE per segment: the samples are split by an integer grouping key (a model output named by ``grouping_keys``,
values 0 .. num_groups - 1) and NE (and with ``include_logloss`` the log loss) is computed per group. Keys
``segmented_ne-{task}|lifetime_segmented_ne_{group}`` and ``|window_segmented_ne_{group}``; with several grouping
keys each key's values end in ``@{key name}`` and its states are prefixed ``{key name}_``.

As in TorchRec: per-task computations (UNFUSED) add each batch's per-group sums rounded to float32 and report
float32 values; the fused modes scatter-add in float64.
"""

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Type, Union

import torch

from recship.metrics.metrics_config import RecComputeMode
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.ne import _compute_cross_entropy_norm
from recship.metrics.ne import compute_cross_entropy as compute_cross_entropy
from recship.metrics.ne import compute_logloss as compute_logloss
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

logger: logging.Logger = logging.getLogger(__name__)

PREDICTIONS = "predictions"
LABELS = "labels"
WEIGHTS = "weights"
_STATES = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")


def compute_ne_helper(
    ce_sum: torch.Tensor, weighted_num_samples: torch.Tensor, pos_labels: torch.Tensor, neg_labels: torch.Tensor, eta: float
) -> torch.Tensor:
    return ce_sum / _compute_cross_entropy_norm(pos_labels / weighted_num_samples, pos_labels, neg_labels, eta)


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    num_groups: int,
    eta: float,
) -> torch.Tensor:
    """[num_groups] float32 NEs from [num_groups] sums."""
    out = torch.zeros(num_groups)
    for group in range(num_groups):
        out[group] = compute_ne_helper(
            ce_sum[group], weighted_num_samples[group], pos_labels[group], neg_labels[group], eta
        )
    return out


def compute_ne_fused(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    num_groups: int,
    n_tasks: int,
    eta: float,
) -> torch.Tensor:
    """[n_tasks, num_groups] float32 NEs from [n_tasks, num_groups] sums."""
    out = torch.zeros([n_tasks, num_groups])
    for group in range(num_groups):
        out[:, group] = compute_ne_helper(
            ce_sum[:, group], weighted_num_samples[:, group], pos_labels[:, group], neg_labels[:, group], eta
        )
    return out


def _check_keys(grouping_keys: torch.Tensor, num_groups: int) -> None:
    if grouping_keys.numel() and (int(grouping_keys.min()) < 0 or int(grouping_keys.max()) >= num_groups):
        raise ValueError(
            f"segmented NE: grouping keys must be in [0, {num_groups}), got values from {int(grouping_keys.min())} to "
            f"{int(grouping_keys.max())}"
        )


def get_segemented_ne_states(
    labels: torch.Tensor,
    predictions: torch.Tensor,
    weights: torch.Tensor,
    grouping_keys: torch.Tensor,
    eta: float,
    num_groups: int,
) -> Dict[str, torch.Tensor]:
    """Per-group [num_groups] sums of one task (each rounded to float32)."""
    _check_keys(grouping_keys, num_groups)
    sums = torch.zeros((4, num_groups), device=labels.device)
    for group in torch.unique(grouping_keys).tolist():
        mask = grouping_keys == group
        y, p, w = labels[mask], predictions[mask], weights[mask]
        sums[0, group] = torch.sum(compute_cross_entropy(y, p, w, eta), dim=-1).item()
        sums[1, group] = torch.sum(w, dim=-1).item()
        sums[2, group] = torch.sum(w * y, dim=-1).item()
        sums[3, group] = torch.sum(w * (1.0 - y), dim=-1).item()
    return dict(zip(_STATES, sums.unbind(0)))


def get_segemented_ne_states_fused(
    labels: torch.Tensor,
    predictions: torch.Tensor,
    weights: torch.Tensor,
    grouping_keys: torch.Tensor,
    eta: float,
    num_groups: int,
    n_tasks: int,
) -> Dict[str, torch.Tensor]:
    """Per-group [n_tasks, num_groups] float64 sums; ``grouping_keys`` [B] is shared by the tasks."""
    _check_keys(grouping_keys, num_groups)
    index = grouping_keys.long().unsqueeze(0).expand(n_tasks, -1)

    def scatter_sum(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n_tasks, num_groups, dtype=torch.double, device=values.device)
        return out.scatter_add_(1, index, values.double())

    values = (compute_cross_entropy(labels, predictions, weights, eta), weights, weights * labels, weights * (1.0 - labels))
    return {name: scatter_sum(v) for name, v in zip(_STATES, values)}


def _state_reduction_sum(state: torch.Tensor) -> torch.Tensor:
    return state.sum(dim=0)


@dataclass
class GroupingKeyConfig:
    """One grouping key: the model output ``name``, its ``num_groups``, and whether float keys are cast to int64."""

    name: str
    num_groups: int = 1
    cast_keys_to_int: bool = False


def _normalize_grouping_keys_config(
    grouping_keys: Union[str, List[Any]], num_groups: int, cast_keys_to_int: bool
) -> List[GroupingKeyConfig]:
    if isinstance(grouping_keys, str):
        return [GroupingKeyConfig(grouping_keys, num_groups, cast_keys_to_int)]
    configs = []
    for item in grouping_keys:
        if isinstance(item, str):
            configs.append(GroupingKeyConfig(item, num_groups, cast_keys_to_int))
        elif isinstance(item, dict):
            configs.append(GroupingKeyConfig(
                item["name"], item.get("num_groups", num_groups), item.get("cast_keys_to_int", cast_keys_to_int)
            ))
        elif isinstance(item, GroupingKeyConfig):
            configs.append(item)
        else:
            raise ValueError(f"grouping_keys: an item {item!r} is not a str, a dict or a GroupingKeyConfig")
    return configs


class SegmentedNEMetricComputation(RecMetricComputation):
    """Args:
        include_logloss (bool): also report the log loss per group.
        num_groups (int): the groups of each key (the default for keys given by name).
        grouping_keys (str | list of str, dicts or GroupingKeyConfig): the model outputs holding the group of each
            sample ([B] int64, or float with ``cast_keys_to_int``).
        cast_keys_to_int (bool): cast float keys to int64.
    """

    def __init__(
        self,
        *args: Any,
        include_logloss: bool = False,
        num_groups: int = 1,
        grouping_keys: Union[str, List[Any]] = "grouping_keys",
        cast_keys_to_int: bool = False,
        **kwargs: Any,
    ) -> None:
        self._include_logloss = include_logloss
        super().__init__(*args, **kwargs)
        self._grouping_key_configs = _normalize_grouping_keys_config(grouping_keys, num_groups, cast_keys_to_int)
        self._is_single_default_key = isinstance(grouping_keys, str) or (
            len(self._grouping_key_configs) == 1 and self._grouping_key_configs[0].name == "grouping_keys"
        )
        self._num_groups = self._grouping_key_configs[0].num_groups
        self._grouping_keys = self._grouping_key_configs[0].name
        self._cast_keys_to_int = cast_keys_to_int
        self.eta = 1e-12
        for config in self._grouping_key_configs:
            for name in _STATES:
                self._add_state(
                    f"{self._get_state_prefix(config.name)}{name}",
                    torch.zeros((self._n_tasks, config.num_groups), dtype=torch.double),
                    add_window_state=True,
                    dist_reduce_fx=_state_reduction_sum,
                    persistent=True,
                )

    def _fused(self) -> bool:
        return self._compute_mode in (
            RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION
        )

    def _get_state_prefix(self, key_name: str) -> str:
        return "" if self._is_single_default_key else f"{key_name}_"

    def _get_description_suffix(self, key_name: str) -> str:
        return "" if self._is_single_default_key else f"@{key_name}"

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights: [n_tasks, B]; ``required_inputs[key]``: [B] (or [1, B]) group per sample."""
        predictions, weights = self._given(predictions, weights)
        required = kwargs.get("required_inputs")
        if required is None:
            raise RecMetricException("SegmentedNEMetricComputation needs the grouping keys in required_inputs")
        num_samples = predictions.shape[-1]
        for config in self._grouping_key_configs:
            keys = required.get(config.name)  # type: ignore[union-attr]
            if keys is None:
                raise RecMetricException(
                    f"Required inputs for SegmentedNEMetricComputation update should contain '{config.name}', got keys: "
                    f"{list(required)}"
                )
            if keys.dtype != torch.int64:
                if not (config.cast_keys_to_int and keys.dtype in (torch.float32, torch.float64)):
                    raise RecMetricException(
                        f"Grouping key '{config.name}' expected to have type torch.int64 or torch.float32/torch.float64 "
                        f"with cast_keys_to_int set to true, got {keys.dtype}."
                    )
                keys = keys.to(torch.int64)
            if self._fused():
                states = get_segemented_ne_states_fused(
                    labels, predictions, weights, keys, self.eta, config.num_groups, self._n_tasks
                )
            else:
                states = get_segemented_ne_states(labels, predictions, weights, keys, self.eta, config.num_groups)
            prefix = self._get_state_prefix(config.name)
            for name, value in states.items():
                getattr(self, prefix + name).add_(value)
                self._aggregate_window_state(prefix + name, value, num_samples)

    def _compute(self) -> List[MetricComputationReport]:
        """Per grouping key: each group's lifetime and window NE, then (include_logloss) each group's log losses."""
        fused = self._fused()
        reports = []
        for config in self._grouping_key_configs:
            prefix, suffix = self._get_state_prefix(config.name), self._get_description_suffix(config.name)
            lifetime = [getattr(self, prefix + name) for name in _STATES]
            window = [self.get_window_state(prefix + name) for name in _STATES]
            if not fused:  # one task: its row
                lifetime, window = [s[0] for s in lifetime], [s[0] for s in window]

            def ne(sums: List[torch.Tensor]) -> torch.Tensor:
                ce, n, pos, neg = sums
                if fused:
                    return compute_ne_fused(ce, n, pos, neg, config.num_groups, self._n_tasks, self.eta)
                return compute_ne(ce, n, pos, neg, config.num_groups, self.eta)

            values = [(MetricName.SEGMENTED_NE, ne(lifetime), ne(window))]
            if self._include_logloss:
                values.append((
                    MetricName.LOG_LOSS,
                    compute_logloss(lifetime[0], lifetime[2], lifetime[3], self.eta),
                    compute_logloss(window[0], window[2], window[3], self.eta),
                ))
            for name, lifetime_value, window_value in values:
                for group in range(config.num_groups):
                    index = (slice(None), group) if fused else group
                    description = f"_{group}{suffix}"
                    reports.append(MetricComputationReport(name, MetricPrefix.LIFETIME, lifetime_value[index], description))
                    reports.append(MetricComputationReport(name, MetricPrefix.WINDOW, window_value[index], description))
        return reports


class SegmentedNEMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.SEGMENTED_NE
    _computation_class: Type[RecMetricComputation] = SegmentedNEMetricComputation

    def _get_option_required_inputs(self, options: Dict[str, Any]) -> Set[str]:
        configs = _normalize_grouping_keys_config(
            options.get("grouping_keys", "grouping_keys"), options.get("num_groups", 1), options.get("cast_keys_to_int", False)
        )
        return {config.name for config in configs}
