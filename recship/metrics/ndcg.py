"""NDCG per session: the samples sharing a session id (the required input ``session_key``, default
``session_id``) are ranked by prediction; their DCG (gain of the label, discounted by 1 / log2(rank + 1), ranks up
to ``k`` or the longest session) over the ideal DCG (ranked by label) is the session's NDCG. The metric reports
the weight-scaled mean over sessions of 1 - NDCG (a loss that decreases; ``report_ndcg_as_decreasing_curve=False``
for NDCG itself), each session scaled by its largest weight. Keys ``ndcg-{task}|lifetime_ndcg`` and
``|window_ndcg``.

Options: ``exponential_gain`` (gain 2^label - 1), ``remove_single_length_sessions``, ``scale_by_weights_tensor``
(weights multiply labels and predictions instead of scaling sessions), and per task ``RecTaskInfo.is_negative_task``
(labels and predictions taken as 1 - x). TorchRec flips negative tasks' predictions and labels in place, in the
caller's tensors; recship flips copies.
"""

from typing import Any, Dict, List, Optional, Set, Tuple, Type, Union

import torch

from recship.metrics.metrics_config import RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException

SUM_NDCG = "sum_ndcg"
NUM_SESSIONS = "num_sessions"
REQUIRED_INPUTS = "required_inputs"
SESSION_KEY = "session_id"


def _validate_model_outputs(
    *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, session_ids: torch.Tensor
) -> None:
    if not predictions.shape == labels.shape == weights.shape == session_ids.shape:
        raise ValueError(
            f"NDCG: predictions {tuple(predictions.shape)}, labels {tuple(labels.shape)}, weights {tuple(weights.shape)} "
            f"and session ids {tuple(session_ids.shape)} must have one shape [n_tasks, B]"
        )
    if predictions.dim() != 2 or predictions.shape[0] == 0 or predictions.shape[1] == 0:
        raise ValueError(f"NDCG: expected non-empty [n_tasks, B] inputs, got {tuple(predictions.shape)}")
    if not (session_ids[0] == session_ids).all():
        raise ValueError("NDCG: the tasks of one computation must share their session ids")


def _get_adjusted_ndcg_inputs(
    *, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, session_ids: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs without the samples of one-sample sessions (session ids as 0 .. n_sessions - 1)."""
    _, session_of, lengths = session_ids[0].unique(return_inverse=True, return_counts=True)
    keep = torch.gather(lengths, dim=-1, index=session_of.type(torch.int64)) > 1
    return predictions[:, keep], labels[:, keep], weights[:, keep], session_of[keep]


def _session_dcg(
    sorted_labels: torch.Tensor,
    sessions_in_order: torch.Tensor,
    n_sessions: int,
    max_rank: torch.Tensor,
    exponential_gain: bool,
) -> torch.Tensor:
    """[n_tasks, n_sessions] DCG of each session with the samples in the given order ([n_tasks, B] labels and
    session ids in that order)."""
    n_tasks, n = sorted_labels.shape
    grid = torch.arange(n_sessions, device=sorted_labels.device).view(1, n_sessions, 1).expand(n_tasks, -1, n)
    in_session = (grid == sessions_in_order.unsqueeze(1)).long()  # [n_tasks, n_sessions, B]
    ranks = in_session.cumsum(dim=-1)  # 1-based rank within the session, at the session's samples
    discounts = torch.reciprocal(torch.log2(ranks + 1))
    discounts[ranks <= 0] = 0.0
    discounts[ranks > max_rank] = 0.0
    gains = sorted_labels.unsqueeze(1).expand(n_tasks, n_sessions, n) * in_session
    if exponential_gain:
        gains = torch.exp2(gains) - 1.0
    return torch.sum(gains * discounts, dim=-1)


def _get_ndcg_states(
    *,
    labels: torch.Tensor,
    predictions: torch.Tensor,
    weights: torch.Tensor,
    session_ids: torch.Tensor,
    exponential_gain: bool,
    k: int = -1,
    report_ndcg_as_decreasing_curve: bool = True,
    remove_single_length_sessions: bool = False,
    scale_by_weights_tensor: bool = False,
) -> Dict[str, torch.Tensor]:
    """{SUM_NDCG: [n_tasks] sum over the batch's sessions, NUM_SESSIONS: [n_tasks]} ({} with no session)."""
    if remove_single_length_sessions:
        predictions, labels, weights, sessions = _get_adjusted_ndcg_inputs(
            predictions=predictions, labels=labels, weights=weights, session_ids=session_ids
        )
    else:
        sessions = session_ids[0]
    if scale_by_weights_tensor:
        labels, predictions = weights * labels, weights * predictions
    n_tasks = labels.shape[0]
    unique, session_of, lengths = sessions.unique(return_inverse=True, return_counts=True)
    n_sessions = unique.shape[0]
    if n_sessions == 0:
        return {}
    max_rank = torch.max(lengths) if k == -1 else torch.min(torch.tensor(k), torch.max(lengths))
    session_rows = session_of.expand(n_tasks, -1)
    ideal_labels, ideal_order = labels.sort(descending=True, dim=-1)
    _, observed_order = predictions.sort(descending=True, dim=-1)
    observed_labels = torch.gather(labels, dim=-1, index=observed_order)
    ideal = _session_dcg(ideal_labels, torch.gather(session_rows, -1, ideal_order), n_sessions, max_rank, exponential_gain)
    ideal[ideal == 0] = 1e-6  # a session without gain
    observed = _session_dcg(
        observed_labels, torch.gather(session_rows, -1, observed_order), n_sessions, max_rank, exponential_gain
    )
    ndcg = observed / ideal
    report = (1 - ndcg) if report_ndcg_as_decreasing_curve else ndcg
    if not scale_by_weights_tensor:
        session_weight = torch.zeros((n_tasks, n_sessions), dtype=weights.dtype, device=weights.device).scatter_reduce_(
            dim=-1, index=session_rows, src=weights, reduce="amax"
        )
        report = report * session_weight
    return {
        SUM_NDCG: torch.sum(report, dim=-1),
        NUM_SESSIONS: torch.full((n_tasks,), fill_value=n_sessions, device=session_of.device),
    }


def _compute_ndcg(*, sum_ndcg: torch.Tensor, num_sessions: torch.Tensor) -> torch.Tensor:
    return sum_ndcg / num_sessions


class NDCGComputation(RecMetricComputation):
    """NDCG over [n_tasks, B] updates with ``required_inputs[session_key]`` [n_tasks, B] (the same per task)."""

    def __init__(
        self,
        *args: Any,
        exponential_gain: bool = False,
        session_key: str = SESSION_KEY,
        k: int = -1,
        report_ndcg_as_decreasing_curve: bool = True,
        remove_single_length_sessions: bool = False,
        scale_by_weights_tensor: bool = False,
        is_negative_task_mask: Optional[List[bool]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._exponential_gain = exponential_gain
        self._session_key = session_key
        self._k = k
        self._remove_single_length_sessions = remove_single_length_sessions
        self._is_negative_task_mask = is_negative_task_mask
        self._report_ndcg_as_decreasing_curve = report_ndcg_as_decreasing_curve
        self._scale_by_weights_tensor = scale_by_weights_tensor
        for name in (SUM_NDCG, NUM_SESSIONS):
            self._add_state(name, torch.zeros(self._n_tasks, dtype=torch.double), add_window_state=True,
                            dist_reduce_fx="sum", persistent=True)

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        required = kwargs.get(REQUIRED_INPUTS)
        if required is None or self._session_key not in required:
            raise RecMetricException(f"NDCG needs the session ids {self._session_key!r} in required_inputs")
        session_ids = required[self._session_key]  # type: ignore[index]
        predictions, weights = self._given(predictions, weights)
        if self._is_negative_task_mask is not None and any(self._is_negative_task_mask):
            mask = torch.tensor(self._is_negative_task_mask, device=predictions.device)
            predictions = torch.where(mask[:, None], 1 - predictions, predictions)
            labels = torch.where(mask[:, None], 1 - labels, labels)
        _validate_model_outputs(predictions=predictions, labels=labels, weights=weights, session_ids=session_ids)
        states = _get_ndcg_states(
            labels=labels.double(),
            predictions=predictions.double(),
            weights=weights.double(),
            session_ids=session_ids,
            exponential_gain=self._exponential_gain,
            remove_single_length_sessions=self._remove_single_length_sessions,
            report_ndcg_as_decreasing_curve=self._report_ndcg_as_decreasing_curve,
            k=self._k,
            scale_by_weights_tensor=self._scale_by_weights_tensor,
        )
        for name, value in states.items():
            getattr(self, name).add_(value)
            self._aggregate_window_state(name, value, predictions.shape[-1])

    def _compute(self) -> List[MetricComputationReport]:
        return [
            MetricComputationReport(MetricName.NDCG, MetricPrefix.LIFETIME,
                                    _compute_ndcg(sum_ndcg=getattr(self, SUM_NDCG), num_sessions=getattr(self, NUM_SESSIONS))),
            MetricComputationReport(MetricName.NDCG, MetricPrefix.WINDOW,
                                    _compute_ndcg(sum_ndcg=self.get_window_state(SUM_NDCG), num_sessions=self.get_window_state(NUM_SESSIONS))),
        ]


class NDCGMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.NDCG
    _computation_class: Type[RecMetricComputation] = NDCGComputation

    def _get_option_required_inputs(self, options: Dict[str, Any]) -> Set[str]:
        return {options.get("session_key", SESSION_KEY)}

    def _get_task_kwargs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Dict[str, Any]:
        tasks = [task_config] if isinstance(task_config, RecTaskInfo) else task_config
        return {"is_negative_task_mask": [task.is_negative_task for task in tasks]} if tasks else {}
