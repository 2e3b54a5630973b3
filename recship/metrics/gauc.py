"""Group AUC: the mean over sessions (groups of consecutive samples, ``num_candidates`` per group) of each
session's weighted AUC, counting only sessions with both classes and with predictions that are not all equal.
Keys ``gauc-{task}|lifetime_gauc``, ``|window_gauc``, ``|lifetime_gauc_num_samples``, ``|window_gauc_num_samples``
(the number of sessions counted). ``update`` takes ``num_candidates`` ([n_groups] int, summing to B).
"""

from typing import Any, Dict, List, Optional, Type

import torch

from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException
from recship.metrics.sums import SumsComputation


def compute_gauc_3d(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """[n_tasks, n_groups, n] padded sessions -> {"auc_sum": [n_tasks], "num_samples": [n_tasks]}: the sum of the
    sessions' AUCs (Mann-Whitney over ascending predictions) and the number of sessions counted."""
    order = torch.argsort(predictions, dim=-1)
    sorted_labels = torch.gather(labels, -1, order)
    sorted_weights = torch.gather(weights, -1, order)
    negatives = 1 - sorted_labels
    below = torch.cumsum(sorted_weights * negatives, dim=-1)  # negative weight at or below each position
    numerator = (sorted_labels * sorted_weights * below).sum(-1)
    w_pos = (sorted_labels * sorted_weights).sum(-1)
    w_neg = (negatives * sorted_weights).sum(-1)
    auc = numerator / (w_pos * w_neg + 1e-10)
    # sessions whose predictions are all equal (padding zeros aside) carry no ranking
    varied = ~torch.all((predictions == predictions[:, :, 0:1]) | (predictions == 0), dim=-1)
    counted = (w_pos > 0) & (w_neg > 0) & varied
    auc = auc * counted
    return {"auc_sum": auc.sum(-1), "num_samples": counted.sum(-1)}


def to_3d(tensor_2d: torch.Tensor, seq_lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """[N, D] rows cut into ``seq_lengths`` runs -> [len(seq_lengths), max_length, D], zero padded (longer runs
    truncated)."""
    offsets = torch.cat([seq_lengths.new_zeros(1), torch.cumsum(seq_lengths, 0)])
    positions = torch.arange(max_length, device=tensor_2d.device)
    valid = positions[None, :] < seq_lengths[:, None]
    rows = (offsets[:-1, None] + positions[None, :]).clamp(max=max(tensor_2d.size(0) - 1, 0))
    dense = tensor_2d[rows.reshape(-1)].view(len(seq_lengths), max_length, -1)
    return torch.where(valid[:, :, None], dense, torch.zeros((), dtype=dense.dtype, device=dense.device))


def get_auc_states(
    labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor, num_candidates: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """[n_tasks, B] tensors cut into sessions of ``num_candidates`` samples -> the GAUC sums."""
    max_length = int(num_candidates.max().item())
    dense = [to_3d(t.permute(1, 0), num_candidates, max_length).permute(2, 0, 1) for t in (predictions, labels, weights)]
    return compute_gauc_3d(*dense)


def compute_window_auc(auc: torch.Tensor, num_samples: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {"gauc": (auc + 1e-9) / (num_samples + 2e-9), "num_samples": num_samples}


class GAUCMetricComputation(SumsComputation):
    _SUMS = ("auc_sum", "num_samples")

    def update(  # type: ignore[override]
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        num_candidates: Optional[torch.Tensor] = None,
        **kwargs: Dict[str, Any],
    ) -> None:
        """``num_candidates``: [n_groups] session lengths summing to B."""
        predictions, weights = self._given(predictions, weights)
        if num_candidates is None:
            raise RecMetricException("GAUCMetricComputation.update needs num_candidates, the session lengths")
        if int(num_candidates.sum()) != predictions.shape[-1]:
            raise ValueError(
                f"GAUC: num_candidates sum to {int(num_candidates.sum())}, the batch has {predictions.shape[-1]} samples"
            )
        self._add_sums(get_auc_states(labels, predictions, weights, num_candidates), predictions.shape[-1])

    def _compute(self) -> List[MetricComputationReport]:
        gauc = self._reports(MetricName.GAUC, lambda a, n: compute_window_auc(a, n)["gauc"], *self._SUMS)
        count = self._reports(MetricName.GAUC_NUM_SAMPLES, lambda a, n: compute_window_auc(a, n)["num_samples"], *self._SUMS)
        return gauc + count


class GAUCMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.GAUC
    _computation_class: Type[RecMetricComputation] = GAUCMetricComputation
