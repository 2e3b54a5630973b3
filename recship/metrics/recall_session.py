"""Session-level recall: within each session (the samples sharing a session id, a model output named by the
task's ``SessionMetricDef.session_var_name``) the ``top_threshold`` best-predicted samples count as predicted
positive; recall = weighted true positives / weighted positives. With ``run_ranking_of_labels`` the labels too are
turned into "among the session's top ``top_threshold``". Keys ``recall_session_level-{task}|lifetime_recall_
session_level`` and ``|window_...``; NaN (with a warning) while no positive has been seen. Per-task computations
only.
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Set, Type, Union

import torch
import torch.distributed as dist

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo, SessionMetricDef
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

logger: logging.Logger = logging.getLogger(__name__)

NUM_TRUE_POS = "num_true_pos"
NUM_FALSE_NEGATIVE = "num_false_neg"


def _validate_model_outputs(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, sessions: torch.Tensor
) -> None:
    if labels.dim() != 2 or not labels.shape == predictions.shape == weights.shape == sessions.shape:
        raise ValueError(
            "session metrics take [1, B] labels, predictions, weights and sessions; got "
            f"{tuple(labels.shape)}, {tuple(predictions.shape)}, {tuple(weights.shape)}, {tuple(sessions.shape)}"
        )


def ranking_within_session(predictions: torch.Tensor, session: torch.Tensor) -> torch.Tensor:
    """[B]: for each sample, how many samples of its session are predicted strictly higher (0 = the best)."""
    n_tasks = predictions.size(0)
    same_session = session.view(-1, n_tasks) == session.view(n_tasks, -1)
    not_below = predictions.view(-1, n_tasks) >= predictions.view(n_tasks, -1)
    return torch.sum(same_session, dim=-1) - torch.sum(same_session & not_below, dim=-1)


def _calc_num_true_pos(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * labels * (predictions == 1).double(), dim=-1)


def _calc_num_false_neg(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.sum(weights * labels * (predictions == 0).double(), dim=-1)


def _ratio_or_nan(hits: torch.Tensor, misses: torch.Tensor, what: str) -> torch.Tensor:
    if (hits + misses).item() == 0:
        logger.warning("%s = NaN: nothing counted yet", what)
        return torch.tensor([float("nan")])
    return hits / (hits + misses)


class _SessionComputation(RecMetricComputation):
    """The shared part of the session metrics: the top-k of each session as the predicted positives; the states
    are the weighted true positives and ``_MISSES`` (``_count_misses(labels, predicted, weights)``: false negatives
    for recall, false positives for precision), the value true positives / (true positives + misses)."""

    _MISSES: str
    _NAME: MetricName
    _WHAT: str  # the value's name in the NaN warning
    _count_misses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, *args: Any, session_metric_def: SessionMetricDef, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in (NUM_TRUE_POS, self._MISSES):
            self._add_state(name, torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=True,
                            dist_reduce_fx="sum", persistent=True)
        self.top_threshold: Optional[int] = session_metric_def.top_threshold
        self.run_ranking_of_labels: bool = session_metric_def.run_ranking_of_labels
        self.session_var_name: Optional[str] = session_metric_def.session_var_name

    def _session_states(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, session: torch.Tensor
    ) -> Dict[str, torch.Tensor]:
        predicted = self._top(predictions, session)
        if self.run_ranking_of_labels:
            labels = self._top(labels, session)
        return {
            NUM_TRUE_POS: _calc_num_true_pos(labels, predicted, weights),
            self._MISSES: self._count_misses(labels, predicted, weights),
        }

    def _top(self, values: torch.Tensor, session: torch.Tensor) -> torch.Tensor:
        assert self.top_threshold is not None  # the metric refuses tasks without one
        return (ranking_within_session(values, session) < self.top_threshold).to(torch.int32)

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        """predictions, labels, weights and ``required_inputs[session_var_name]``: [1, B]."""
        required = kwargs.get("required_inputs")
        if required is None or self.session_var_name not in required:
            raise RecMetricException(f"Need the {self.session_var_name} input to update the session metric")
        session = required[self.session_var_name]  # type: ignore[index]
        predictions, weights = self._given(predictions, weights)
        _validate_model_outputs(labels, predictions, weights, session)
        states = self._session_states(labels.double(), predictions.double(), weights.double(), session)
        for name, value in states.items():
            getattr(self, name).add_(value)
            self._aggregate_window_state(name, value, predictions.shape[-1])

    def _compute(self) -> List[MetricComputationReport]:
        lifetime = _ratio_or_nan(getattr(self, NUM_TRUE_POS), getattr(self, self._MISSES), self._WHAT)
        window = _ratio_or_nan(self.get_window_state(NUM_TRUE_POS), self.get_window_state(self._MISSES), self._WHAT)
        return [
            MetricComputationReport(self._NAME, MetricPrefix.LIFETIME, lifetime),
            MetricComputationReport(self._NAME, MetricPrefix.WINDOW, window),
        ]


class RecallSessionMetricComputation(_SessionComputation):
    _MISSES = NUM_FALSE_NEGATIVE
    _NAME = MetricName.RECALL_SESSION_LEVEL
    _WHAT = "session recall"
    _count_misses = staticmethod(_calc_num_false_neg)
    get_recall_states = _SessionComputation._session_states


class _SessionMetric(RecMetric):
    """Per-task computations only, each task with a ``session_metric_def`` and its ``top_threshold``."""

    _label = "session-level"  # the metric's name in error messages, TorchRec's wording

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: List[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        **kwargs: Any,
    ) -> None:
        if compute_mode in (RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION):
            raise RecMetricException(f"Fused computation is not supported for {self._label} metrics")
        if fused_update_limit > 0:
            raise RecMetricException(f"Fused update is not supported for {self._label} metrics")
        for task in tasks:
            _session_metric_def(task)
            if task.session_metric_def.top_threshold is None:  # type: ignore[union-attr]
                raise RecMetricException(f"Please, specify the top threshold (task {task.name!r})")
        super().__init__(
            world_size=world_size,
            my_rank=my_rank,
            batch_size=batch_size,
            tasks=tasks,
            compute_mode=compute_mode,
            window_size=window_size,
            fused_update_limit=fused_update_limit,
            process_group=process_group,
            **kwargs,
        )

    def _get_task_kwargs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Dict[str, Any]:
        return {"session_metric_def": _session_metric_def(task_config)}

    def _get_task_required_inputs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Set[str]:
        name = _session_metric_def(task_config).session_var_name
        return {name} if name else set()


def _session_metric_def(task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> SessionMetricDef:
    """The task's session definition; RecMetricException with TorchRec's texts for a task list or a task without one."""
    if not isinstance(task_config, RecTaskInfo):
        raise RecMetricException("Session metric can only take one task at a time")
    if task_config.session_metric_def is None:
        raise RecMetricException(f"Please, specify the session metric definition (task {task_config.name!r})")
    return task_config.session_metric_def


class RecallSessionMetric(_SessionMetric):
    _namespace: MetricNamespace = MetricNamespace.RECALL_SESSION_LEVEL
    _label = "recall session-level"
    _computation_class: Type[RecMetricComputation] = RecallSessionMetricComputation
