"""Eviction policies of the sorted-ids managed-collision module (TorchRec's MCH policies in
``torchrec.modules.mc_modules``) and the threshold filters that keep rare ids out of its slots.

Every ``eviction_interval`` training steps an MCHManagedCollisionModule coalesces the ids it saw
(``torch.unique`` with counts) and asks its policy which of its ``zch_size`` slots to give to
which new ids. The policy scores the current slots and the new ids together and keeps the
``zch_size`` best; a slot outside them is evicted and takes a new id inside them:

* ``LFU_EvictionPolicy``: score = how often the id was seen since it got its slot.
* ``LRU_EvictionPolicy``: score = -(iters since last seen + 1) ** decay_exponent.
* ``DistanceLFU_EvictionPolicy``: score = count / (iters since last seen + 1) ** decay_exponent.

The last slot (``zch_size - 1``) is the default row of ids without a slot; every policy gives it
the best score so that it is never handed out. Ties keep the order (stable sorts, existing slots
first, new ids by falling count), so the numbers equal TorchRec 1.8.0's.
"""

import abc
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

_INT64_MAX = torch.iinfo(torch.int64).max

# A filter: [U] int64 counts of the unique ids seen -> (mask or index of the ids allowed in, threshold).
ThresholdFilter = Callable[[torch.Tensor], Tuple[torch.Tensor, Union[float, torch.Tensor]]]


@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: torch.Tensor,
    threshold_skew_multiplier: float = 10.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keeps ids seen more than ``threshold_skew_multiplier * sum(counts) / len(counts)`` times.

    Args:
        id_counts: [U] int64 counts of the unique ids.
    Returns:
        ([U] bool mask, the threshold as a 0-d tensor).
    """
    threshold = (1 / id_counts.numel()) * threshold_skew_multiplier * id_counts.sum()
    return id_counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keeps ids seen more often than the mean count ([U] counts -> ([U] bool mask, mean))."""
    counts = id_counts if id_counts.dtype == torch.float else id_counts.float()
    threshold = counts.mean()
    return counts > threshold, threshold


@torch.no_grad()
def probabilistic_threshold_filter(
    id_counts: torch.Tensor,
    per_id_probability: float = 0.01,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keeps each id with probability ``1 - (1 - per_id_probability) ** count`` (draws from torch's RNG).

    Returns ([U] bool mask, [U] float32 uniform draws the scores were compared with).
    """
    keep_each = torch.full_like(id_counts, 1 - per_id_probability, dtype=torch.float)
    scores = 1 - torch.pow(keep_each, id_counts)
    draws = torch.rand(id_counts.size(), device=id_counts.device)
    return scores > draws, draws


class MCHEvictionPolicyMetadataInfo(NamedTuple):
    """One per-id quantity a policy keeps: per slot (``_mch_<name>`` buffer, in the state_dict) and/or
    per id seen since the last eviction (``_history_<name>``, not saved)."""

    metadata_name: str
    is_mch_metadata: bool
    is_history_metadata: bool


class MCHEvictionPolicy(abc.ABC):
    """Base of the MCH eviction policies.

    Args:
        metadata_info: the quantities the policy keeps (see MCHEvictionPolicyMetadataInfo).
        threshold_filtering_func: optional filter applied to the coalesced ids before they may
            take a slot (``dynamic_threshold_filter`` etc.; TorchRec: experimental).
    """

    def __init__(
        self,
        metadata_info: List[MCHEvictionPolicyMetadataInfo],
        threshold_filtering_func: Optional[ThresholdFilter] = None,
    ) -> None:
        self._metadata_info = metadata_info
        self._threshold_filtering_func = threshold_filtering_func

    @property
    @abc.abstractmethod
    def metadata_info(self) -> List[MCHEvictionPolicyMetadataInfo]:
        pass

    @abc.abstractmethod
    def record_history_metadata(
        self,
        current_iter: int,
        incoming_ids: torch.Tensor,
        history_metadata: Dict[str, torch.Tensor],
    ) -> None:
        """Writes the metadata of ``incoming_ids`` ([N] int64) into the history slices given."""

    @abc.abstractmethod
    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: Dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: Optional[torch.Tensor] = None,
        threshold_mask: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        """Reduces the history metadata ([N] per id seen) to one value per unique id ([U]), using
        ``unique_inverse_mapping`` ([N] index into the unique ids); keeps the ids that pass
        ``threshold_mask`` when given."""

    @abc.abstractmethod
    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: Dict[str, torch.Tensor],
        coalesced_history_metadata: Dict[str, torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Updates the slots' metadata and returns (evicted slot indices, indices of the new ids, in
        falling-count order, that take them), pairwise."""

    def _compute_selected_eviction_and_replacement_indices(
        self,
        pivot: int,
        eviction_scores: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keeps the ``pivot`` best of [slots (pivot of them), new ids]: the slots not kept are evicted,
        the new ids kept take them (both in falling-score order)."""
        ranked = torch.argsort(eviction_scores, descending=True, stable=True)
        kept, dropped = ranked[:pivot], ranked[pivot:]
        evicted_indices = dropped[dropped < pivot]
        selected_new_indices = kept[kept >= pivot] - pivot
        return evicted_indices, selected_new_indices


def _last_access_per_unique_id(
    current_iter: int,
    history_metadata: Dict[str, torch.Tensor],
    unique_ids_counts: torch.Tensor,
    unique_inverse_mapping: torch.Tensor,
    additional_ids: Optional[torch.Tensor],
    threshold_mask: Optional[torch.Tensor],
) -> Dict[str, torch.Tensor]:
    """{"last_access_iter": [U] int64 latest iteration each unique id was seen}."""
    seen = history_metadata["last_access_iter"]
    if additional_ids is not None:
        seen = torch.cat([seen, torch.full_like(additional_ids, current_iter)])
    last = torch.zeros_like(unique_ids_counts).scatter_reduce_(
        0, unique_inverse_mapping, seen, reduce="amax", include_self=False
    )
    if threshold_mask is not None:
        last = last[threshold_mask]
    return {"last_access_iter": last}


class _SlotScoringPolicy(MCHEvictionPolicy):
    """The policies here, each keeping some of two per-slot quantities and scoring slots and new ids by them:

    * ``counts``: the id's count since it took the slot; a matched id's count is added, the default slot's is
      INT64_MAX.
    * ``last_access_iter``: the last iteration the id was seen (a history quantity: recorded per id seen, the
      latest kept at coalescing); a matched id's is replaced, the default slot's is the current iteration.

    Subclasses name their quantities (``metadata_info``) and score [slots + new ids] from them (``_scores``).
    """

    @property
    def metadata_info(self) -> List[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    def _keeps(self, name: str) -> bool:
        return any(info.metadata_name == name for info in self._metadata_info)

    def record_history_metadata(self, current_iter: int, incoming_ids: torch.Tensor, history_metadata: Dict[str, torch.Tensor]) -> None:
        if self._keeps("last_access_iter"):  # counts come from torch.unique at coalescing: no history for them
            history_metadata["last_access_iter"][:] = current_iter

    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: Dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: Optional[torch.Tensor] = None,
        threshold_mask: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        if not self._keeps("last_access_iter"):
            return {}
        return _last_access_per_unique_id(
            current_iter, history_metadata, unique_ids_counts, unique_inverse_mapping, additional_ids, threshold_mask
        )

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: Dict[str, torch.Tensor],
        coalesced_history_metadata: Dict[str, torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        matched = coalesced_history_mch_matching_elements_mask
        new: Dict[str, torch.Tensor] = {}
        merged: Dict[str, torch.Tensor] = {}  # [slots + new ids] per quantity
        for info in self._metadata_info:
            name, slots = info.metadata_name, mch_metadata[info.metadata_name]
            if name == "counts":
                incoming = coalesced_history_sorted_unique_ids_counts
                slots[coalesced_history_mch_matching_indices] += incoming[matched]
                slots[mch_size - 1] = _INT64_MAX  # the default slot is never evicted
            else:
                incoming = coalesced_history_metadata[name][coalesced_history_argsort_mapping]
                slots[coalesced_history_mch_matching_indices] = incoming[matched]
                slots[mch_size - 1] = current_iter
            new[name] = incoming[~matched]
            merged[name] = torch.cat([slots, new[name]])
        scores = self._scores(current_iter, merged)
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(mch_size, scores)
        for name, values in new.items():
            mch_metadata[name][evicted] = values[selected]
        return evicted, selected

    @abc.abstractmethod
    def _scores(self, current_iter: int, merged: Dict[str, torch.Tensor]) -> torch.Tensor:
        """[slots + new ids] scores (higher: kept) from the quantities of the slots followed by the new ids'."""


class LFU_EvictionPolicy(_SlotScoringPolicy):
    """Least frequently used: a slot's score is its id's count since it took the slot (``_mch_counts``)."""

    def __init__(self, threshold_filtering_func: Optional[ThresholdFilter] = None) -> None:
        super().__init__(
            metadata_info=[MCHEvictionPolicyMetadataInfo("counts", is_mch_metadata=True, is_history_metadata=False)],
            threshold_filtering_func=threshold_filtering_func,
        )

    def _scores(self, current_iter: int, merged: Dict[str, torch.Tensor]) -> torch.Tensor:
        return merged["counts"]


class LRU_EvictionPolicy(_SlotScoringPolicy):
    """Least recently used: score ``-(current_iter - last_access_iter + 1) ** decay_exponent``."""

    def __init__(self, decay_exponent: float = 1.0, threshold_filtering_func: Optional[ThresholdFilter] = None) -> None:
        super().__init__(
            metadata_info=[MCHEvictionPolicyMetadataInfo("last_access_iter", is_mch_metadata=True, is_history_metadata=True)],
            threshold_filtering_func=threshold_filtering_func,
        )
        self._decay_exponent = decay_exponent

    def _scores(self, current_iter: int, merged: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.neg(torch.pow(current_iter - merged["last_access_iter"] + 1, self._decay_exponent))


class DistanceLFU_EvictionPolicy(_SlotScoringPolicy):
    """Counts decayed by distance: score ``counts / (current_iter - last_access_iter + 1) ** decay_exponent``."""

    def __init__(self, decay_exponent: float = 1.0, threshold_filtering_func: Optional[ThresholdFilter] = None) -> None:
        super().__init__(
            metadata_info=[
                MCHEvictionPolicyMetadataInfo("counts", is_mch_metadata=True, is_history_metadata=False),
                MCHEvictionPolicyMetadataInfo("last_access_iter", is_mch_metadata=True, is_history_metadata=True),
            ],
            threshold_filtering_func=threshold_filtering_func,
        )
        self._decay_exponent = decay_exponent

    def _scores(self, current_iter: int, merged: Dict[str, torch.Tensor]) -> torch.Tensor:
        distance = torch.pow(current_iter - merged["last_access_iter"] + 1, self._decay_exponent)
        return torch.div(merged["counts"], distance)
