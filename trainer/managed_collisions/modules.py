"""Managed-collision modules: raw ids -> rows of a table (TorchRec's ``torchrec.modules.mc_modules``).

A managed-collision (MC) module gives each frequent raw id its own row ("slot") of a table of
``zch_size`` rows, instead of hashing ids onto rows where they collide. The sorted-ids module,
MCHManagedCollisionModule, keeps

* ``_mch_sorted_raw_ids``: [zch_size] int64, the raw id in each slot, sorted (empty slots hold
  int64 max, so they sort last);
* ``_mch_remapped_ids_mapping``: [zch_size] int64, the row of each sorted slot;
* one ``_mch_<metadata>`` buffer per quantity its eviction policy keeps (counts, last access).

In training (``module.train()``) it records every id it sees and, every ``eviction_interval``
calls, lets its policy hand slots to the best new ids (``recship.trainer.managed_collisions.eviction``).
Remapping is a binary search of the sorted ids: an id with a slot gets that slot's row, any
other id the last row, ``output_global_offset + zch_size - 1`` (the shared "miss" row). In
eval mode only the remapping runs, so a served model maps ids exactly as the trained one did.

    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(zch_size=100, device=torch.device("cpu"),
                                        eviction_policy=LFU_EvictionPolicy(), eviction_interval=2)},
        [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])])
    remapped = mcc(kjt)  # the same KeyedJaggedTensor with ids in [0, 100)

Numbers (remapped ids, buffers after each step, evictions) equal TorchRec 1.8.0's.
"""

import abc
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig
from recship.trainer.managed_collisions.eviction import MCHEvictionPolicy

logger = logging.getLogger(__name__)

_INT64_MAX = torch.iinfo(torch.int64).max
_MAX_SEGMENTS = 1025  # TorchRec's limit: 1024 row-wise shards


@torch.fx.wrap
def apply_mc_method_to_jt_dict(
    mc_module: nn.Module,
    method: str,
    features_dict: Dict[str, JaggedTensor],
) -> Dict[str, JaggedTensor]:
    """``getattr(mc_module, method)(features_dict)``, as one fx node."""
    return getattr(mc_module, method)(features_dict)


class ManagedCollisionModule(nn.Module):
    """Interface of a managed-collision module: a dict of JaggedTensors of raw ids in, the same with
    ids remapped into [0, output_size()) (plus the module's global offset when sharded) out.

    Args:
        device: where the module's buffers live.
        output_segments: row offsets of the shards the module's table may be split into, ending
            with the number of rows (``[0, zch_size]`` unsharded); saved as ``_output_segments_tensor``
            ([1025] int64, padded with -1) so that a checkpoint records how it was sharded.
        skip_state_validation: registers neither ``_output_segments_tensor`` nor
            ``_current_iter_tensor`` and does not check the state after loading.
        read_only_suffix: suffix of the read-only features (TorchRec's hash-ZCH modules).
        enable_per_feature_lookups: kept for TorchRec's hash-ZCH modules.
    """

    _output_segments_tensor: torch.Tensor
    _current_iter_tensor: torch.Tensor

    def __init__(
        self,
        device: torch.device,
        output_segments: List[int],
        skip_state_validation: bool = False,
        read_only_suffix: str = "_readonly",
        enable_per_feature_lookups: bool = False,
    ) -> None:
        super().__init__()
        self._device = device
        self._enable_per_feature_lookups = enable_per_feature_lookups
        self._read_only_suffix = read_only_suffix
        if skip_state_validation:
            logger.warning("ManagedCollisionModule: state validation skipped; the module may not be re-shardable")
            return
        if len(output_segments) > _MAX_SEGMENTS:
            raise ValueError(f"ManagedCollisionModule: {len(output_segments) - 1} shards; at most {_MAX_SEGMENTS - 1}")
        padded = list(output_segments) + [-1] * (_MAX_SEGMENTS - len(output_segments))
        self.register_buffer("_output_segments_tensor", torch.tensor(padded, dtype=torch.int64, device=device))
        self.register_buffer("_current_iter_tensor", torch.tensor([0], dtype=torch.int64, device=device))
        self.register_load_state_dict_post_hook(lambda module, _keys: module.validate_state())

    @property
    def readable_suffix(self) -> str:
        return self._read_only_suffix

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        pass

    @abc.abstractmethod
    def evict(self) -> Optional[torch.Tensor]:
        """None, or the rows whose slot was given to another id since the last call."""

    @abc.abstractmethod
    def remap(
        self,
        features: Dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: Optional[torch.Tensor] = None,
    ) -> Dict[str, JaggedTensor]:
        pass

    @abc.abstractmethod
    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        pass

    @abc.abstractmethod
    def forward(self, features: Dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> Dict[str, JaggedTensor]:
        pass

    @abc.abstractmethod
    def output_size(self) -> int:
        """Number of rows the module maps into (the table's ``num_embeddings`` unsharded)."""

    @abc.abstractmethod
    def input_size(self) -> int:
        """Range of the raw ids, [0, input_size) (how sharding splits them)."""

    @abc.abstractmethod
    def buckets(self) -> int:
        """Number of equal blocks the raw-id range is split into for sharding."""

    @abc.abstractmethod
    def validate_state(self) -> None:
        """Checks (and re-sorts) the state after a load_state_dict."""

    @abc.abstractmethod
    def open_slots(self) -> torch.Tensor:
        """[1] int64: slots without an id."""

    @abc.abstractmethod
    def rebuild_with_output_id_range(
        self,
        output_id_range: Tuple[int, int],
        output_segments: List[int],
        device: Optional[torch.device] = None,
    ) -> "ManagedCollisionModule":
        """A new module of the same kind for the rows [start, end) of one row-wise shard."""


@torch.fx.wrap
def _mch_remap(
    features: Dict[str, JaggedTensor],
    mch_sorted_raw_ids: torch.Tensor,
    mch_remapped_ids_mapping: torch.Tensor,
    zch_index: int,
) -> Dict[str, JaggedTensor]:
    """Each id -> the row of its slot, or ``zch_index`` (the miss row) when it has none."""
    remapped: Dict[str, JaggedTensor] = {}
    for name, feature in features.items():
        values = feature.values()
        # the last slot is never searched: a miss lands on it and fails the equality
        found = torch.searchsorted(mch_sorted_raw_ids[:-1], values)
        hit = mch_sorted_raw_ids[found] == values
        ids = torch.where(hit, mch_remapped_ids_mapping[found], torch.full_like(values, zch_index))
        remapped[name] = JaggedTensor(values=ids, lengths=feature.lengths(), offsets=feature.offsets(), weights=feature.weights_or_none())
    return remapped


class MCHManagedCollisionModule(ManagedCollisionModule):
    """Sorted-ids managed collisions ("ZCH"), with an MCH eviction policy.

    Args:
        zch_size: number of rows (slots); the last is the miss row, shared by ids without a slot.
        device: where the buffers live.
        eviction_policy: LFU_EvictionPolicy, LRU_EvictionPolicy or DistanceLFU_EvictionPolicy.
        eviction_interval: training calls between two evictions (>= 1).
        input_hash_size: raw ids lie in [0, input_hash_size); second argument of ``input_hash_func``,
            and what row-wise sharding splits.
        input_hash_func: optional ``fn(ids, input_hash_size) -> ids`` applied before everything else.
        mch_size, mch_hash_func: deprecated in TorchRec (a hash table for misses); ignored with a warning.
        name: a name for logs.
        output_global_offset: first row (a row-wise shard's offset); 0 unsharded.
        output_segments: see ManagedCollisionModule; default ``[offset, offset + zch_size]``.
        buckets: number of input blocks for sharding.
    """

    _mch_sorted_raw_ids: torch.Tensor
    _mch_remapped_ids_mapping: torch.Tensor
    _mch_slots: torch.Tensor
    _delimiter: torch.Tensor
    _evicted_emb_indices: torch.Tensor

    def __init__(
        self,
        zch_size: int,
        device: torch.device,
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = (2**63) - 1,
        input_hash_func: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
        mch_size: Optional[int] = None,
        mch_hash_func: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
        name: Optional[str] = None,
        output_global_offset: int = 0,
        output_segments: Optional[List[int]] = None,
        buckets: int = 1,
    ) -> None:
        if zch_size <= 0:
            raise ValueError(f"MCHManagedCollisionModule: zch_size must be > 0, got {zch_size}")
        if eviction_interval <= 0:
            raise ValueError(f"MCHManagedCollisionModule: eviction_interval must be >= 1, got {eviction_interval}")
        if not isinstance(eviction_policy, MCHEvictionPolicy):
            raise TypeError(f"MCHManagedCollisionModule: eviction_policy must be an MCHEvictionPolicy, got {type(eviction_policy).__name__}")
        if output_segments is None:
            output_segments = [output_global_offset, output_global_offset + zch_size]
        super().__init__(device=device, output_segments=output_segments)
        if mch_size is not None or mch_hash_func is not None:
            logger.warning("MCHManagedCollisionModule: mch_size and mch_hash_func are deprecated (as in TorchRec) and ignored")
        self._output_segments = list(output_segments)
        self._name = name
        self._input_history_buffer_size: int = -1
        self._input_hash_size = input_hash_size
        self._zch_size: int = zch_size
        self._output_global_offset: int = output_global_offset
        self._input_hash_func = input_hash_func
        self._eviction_interval = eviction_interval
        self._eviction_policy = eviction_policy
        self._current_iter: int = -1
        self._buckets = buckets
        self._init_buffers()
        for info in eviction_policy.metadata_info:
            if info.is_mch_metadata:
                self.register_buffer("_mch_" + info.metadata_name, torch.zeros(zch_size, dtype=torch.int64, device=device))
        self._current_history_buffer_offset: int = 0
        self._evicted: bool = False
        self._last_eviction_iter: int = -1

    # Looked up by name on every use, not held: ``to()`` / ``to_empty()`` replace buffers with new tensors.
    @property
    def _mch_metadata(self) -> Dict[str, torch.Tensor]:
        """Metadata name -> its [zch_size] int64 buffer, one value per slot (in the state_dict as ``_mch_<name>``)."""
        return {i.metadata_name: getattr(self, "_mch_" + i.metadata_name) for i in self._eviction_policy.metadata_info if i.is_mch_metadata}

    @property
    def _history_metadata(self) -> Dict[str, torch.Tensor]:
        """Metadata name -> its buffer of one value per id recorded since the last eviction (empty before the first batch)."""
        return {i.metadata_name: getattr(self, "_history_" + i.metadata_name) for i in self._eviction_policy.metadata_info
                if i.is_history_metadata and self._input_history_buffer_size != -1}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Empties every slot and restarts the iteration count: the state of a new module, written into the current
        buffers (what ``materialize`` calls after ``to_empty`` for a module built on the meta device)."""
        self._device = self._mch_sorted_raw_ids.device  # where to_empty put the buffers
        self._evicted_emb_indices = torch.empty((1,), device=self._device)
        padded = self._output_segments + [-1] * (_MAX_SEGMENTS - len(self._output_segments))
        self._output_segments_tensor.copy_(torch.tensor(padded, dtype=torch.int64))
        self._current_iter_tensor.zero_()
        self._mch_sorted_raw_ids.fill_(_INT64_MAX)
        self._mch_slots.fill_(self._zch_size - 1)
        self._delimiter.fill_(_INT64_MAX)
        offset = self._output_global_offset
        self._mch_remapped_ids_mapping.copy_(torch.arange(offset, offset + self._zch_size, dtype=torch.int64))
        for buffer in self._mch_metadata.values():
            buffer.zero_()
        self._current_iter = -1
        self._input_history_buffer_size = -1
        self._current_history_buffer_offset = 0
        self._evicted = False
        self._last_eviction_iter = -1

    def _init_buffers(self) -> None:
        device, offset = self.device, self._output_global_offset
        self.register_buffer("_mch_sorted_raw_ids", torch.full((self._zch_size,), _INT64_MAX, dtype=torch.int64, device=device))
        self.register_buffer("_mch_slots", torch.tensor([self._zch_size - 1], dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("_delimiter", torch.tensor([_INT64_MAX], dtype=torch.int64, device=device), persistent=False)
        self.register_buffer(
            "_mch_remapped_ids_mapping", torch.arange(offset, offset + self._zch_size, dtype=torch.int64, device=device)
        )
        self._evicted_emb_indices = torch.empty((1,), device=device)

    def _init_history_buffers(self, features: Dict[str, JaggedTensor]) -> None:
        """Sized on the first batch: 1.25 x its ids x eviction_interval (ids beyond are not recorded)."""
        seen = sum(f.values().numel() for f in features.values())
        self._input_history_buffer_size = int(seen * self._eviction_interval * 1.25)
        device = self._mch_sorted_raw_ids.device
        self._history_accumulator: torch.Tensor = torch.empty(self._input_history_buffer_size, dtype=torch.int64, device=device)
        for info in self._eviction_policy.metadata_info:
            if info.is_history_metadata:
                self.register_buffer("_history_" + info.metadata_name,
                                     torch.zeros(self._input_history_buffer_size, dtype=torch.int64, device=device), persistent=False)

    def preprocess(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        if self._input_hash_func is None:
            return features
        return {
            name: JaggedTensor(
                values=self._input_hash_func(f.values(), self._input_hash_size),
                lengths=f.lengths(),
                offsets=f.offsets(),
                weights=f.weights_or_none(),
            )
            for name, f in features.items()
        }

    def reset_inference_mode(self) -> None:
        self._evicted = False
        self._last_eviction_iter = -1

    @torch.no_grad()
    def _match_indices(self, sorted_sequence: torch.Tensor, search_values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """([N] bool: value has a slot, [M] the slots of those that have one)."""
        found = torch.searchsorted(sorted_sequence[:-1], search_values)
        hit = sorted_sequence[found] == search_values
        return hit, found[hit]

    @torch.no_grad()
    def _sort_mch_buffers(self) -> None:
        order = torch.argsort(self._mch_sorted_raw_ids, stable=True)
        self._mch_sorted_raw_ids.copy_(self._mch_sorted_raw_ids[order])
        self._mch_remapped_ids_mapping.copy_(self._mch_remapped_ids_mapping[order])
        for buffer in self._mch_metadata.values():
            buffer.copy_(buffer[order])

    @torch.no_grad()
    def _update_and_evict(self, uniq_ids: torch.Tensor, uniq_ids_counts: torch.Tensor, uniq_ids_metadata: Dict[str, torch.Tensor]) -> None:
        by_count = torch.argsort(uniq_ids_counts, descending=True, stable=True)
        ids, counts = uniq_ids[by_count], uniq_ids_counts[by_count]
        hit, slots = self._match_indices(self._mch_sorted_raw_ids, ids)
        new_ids = ids[~hit]
        evicted, selected = self._eviction_policy.update_metadata_and_generate_eviction_scores(
            self._current_iter, self._zch_size, by_count, counts, hit, slots, self._mch_metadata, uniq_ids_metadata
        )
        self._mch_sorted_raw_ids[evicted] = new_ids[selected]
        rows = self._mch_remapped_ids_mapping[evicted]
        # rows not yet handed out by evict() stay pending with the new ones
        self._evicted_emb_indices = torch.unique(torch.cat([self._evicted_emb_indices, rows])) if self._evicted else rows
        self._evicted = True
        self._sort_mch_buffers()

    @torch.no_grad()
    def _coalesce_history(self) -> None:
        history = self._history_accumulator[: self._current_history_buffer_offset]
        uniq_ids, inverse, counts = torch.unique(history, return_inverse=True, return_counts=True)
        mask: Optional[torch.Tensor] = None
        if self._eviction_policy._threshold_filtering_func is not None:
            mask, _ = self._eviction_policy._threshold_filtering_func(counts)
        metadata = self._eviction_policy.coalesce_history_metadata(
            self._current_iter,
            {name: buffer[: self._current_history_buffer_offset] for name, buffer in self._history_metadata.items()},
            counts,
            inverse,
            threshold_mask=mask,
        )
        if mask is not None:
            uniq_ids, counts = uniq_ids[mask], counts[mask]
        self._update_and_evict(uniq_ids, counts, metadata)
        self._current_history_buffer_offset = 0

    def profile(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """Training only: records the ids and, every ``eviction_interval`` calls, evicts."""
        if not self.training:
            return features
        if self._current_iter == -1:
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter
        self._current_iter += 1
        self._current_iter_tensor.data += 1
        if self._input_history_buffer_size == -1:
            self._init_history_buffers(features)
        for feature in features.values():
            start = self._current_history_buffer_offset
            values = feature.values()[: self._input_history_buffer_size - start]
            end = start + values.shape[0]
            self._history_accumulator[start:end] = values
            self._eviction_policy.record_history_metadata(
                self._current_iter, values, {name: buffer[start:end] for name, buffer in self._history_metadata.items()}
            )
            self._current_history_buffer_offset = end
        if self._current_iter - self._last_eviction_iter == self._eviction_interval:
            self._coalesce_history()
            self._last_eviction_iter = self._current_iter
        return features

    def remap(
        self,
        features: Dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: Optional[torch.Tensor] = None,
    ) -> Dict[str, JaggedTensor]:
        return _mch_remap(
            features, self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping, self._output_global_offset + self._zch_size - 1
        )

    def forward(self, features: Dict[str, JaggedTensor], mutate_miss_lengths: bool = True) -> Dict[str, JaggedTensor]:
        """features: {name: JaggedTensor of raw int64 ids} -> the same with ids remapped to rows."""
        return self.remap(self.profile(self.preprocess(features)))

    def output_size(self) -> int:
        return self._zch_size

    def buckets(self) -> int:
        return self._buckets

    def input_size(self) -> int:
        return self._input_hash_size

    def open_slots(self) -> torch.Tensor:
        return self._mch_slots - torch.searchsorted(self._mch_sorted_raw_ids, self._delimiter)

    @torch.no_grad()
    def evict(self) -> Optional[torch.Tensor]:
        if not self._evicted:
            return None
        self._evicted = False
        return self._evicted_emb_indices

    def validate_state(self) -> None:
        start = self._output_global_offset
        end = start + self._zch_size
        if start not in self._output_segments_tensor or end not in self._output_segments_tensor:
            raise ValueError(
                f"MCHManagedCollisionModule: rows [{start}, {end}) are not a union of the loaded output segments "
                f"{[s for s in self._output_segments_tensor.tolist() if s >= 0]}"
            )
        self._sort_mch_buffers()

    def rebuild_with_output_id_range(
        self,
        output_id_range: Tuple[int, int],
        output_segments: List[int],
        device: Optional[torch.device] = None,
    ) -> "MCHManagedCollisionModule":
        return type(self)(
            name=self._name,
            zch_size=output_id_range[1] - output_id_range[0],
            device=device or self.device,
            eviction_policy=self._eviction_policy,
            eviction_interval=self._eviction_interval,
            input_hash_size=self._input_hash_size,
            input_hash_func=self._input_hash_func,
            output_global_offset=output_id_range[0],
            output_segments=output_segments,
            buckets=len(output_segments) - 1,
        )


@torch.fx.wrap
def _features_in_order(features: KeyedJaggedTensor, feature_names: List[str]) -> KeyedJaggedTensor:
    """``features`` permuted to ``feature_names`` order (the collection's tables' order)."""
    keys = features.keys()
    order: List[int] = []
    for f in feature_names:
        if f not in keys:
            raise ValueError("ManagedCollisionCollection: feature '" + f + "' is missing from the input's keys")
        order.append(keys.index(f))
    if order == list(range(len(keys))):
        return features
    return features.permute(order)


@torch.fx.wrap
def _table_input(kjt: KeyedJaggedTensor, table: str) -> Dict[str, JaggedTensor]:
    """All of a table's features as one JaggedTensor of ids, keyed by the table."""
    return {table: JaggedTensor(values=kjt.values(), lengths=kjt.lengths())}


@torch.fx.wrap
def _remapped_kjt(features: KeyedJaggedTensor, remapped: List[Dict[str, JaggedTensor]]) -> KeyedJaggedTensor:
    """``features`` with the remapped ids of every table, in table order."""
    values: List[torch.Tensor] = []
    lengths: List[torch.Tensor] = []
    for per_table in remapped:
        for jt in per_table.values():
            values.append(jt.values())
            lengths.append(jt.lengths())
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=features.weights_or_none(),
        stride=features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
        inverse_indices=features.inverse_indices_or_none(),
    )


class ManagedCollisionCollection(nn.Module):
    """One managed-collision module per table: a KeyedJaggedTensor of raw ids in, the same (keys in
    the tables' order) with every table's ids remapped to its rows.

    Args:
        managed_collision_modules: table name -> its module (``output_size()`` must equal the
            table's ``num_embeddings``).
        embedding_configs: the tables (EmbeddingBagConfig or EmbeddingConfig), in the order of
            the embedding collection they feed.
        need_preprocess: kept for TorchRec's API.
    """

    def __init__(
        self,
        managed_collision_modules: Dict[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
        need_preprocess: bool = True,
    ) -> None:
        super().__init__()
        self._managed_collision_modules = nn.ModuleDict(managed_collision_modules)
        self._embedding_configs = embedding_configs
        self.need_preprocess = need_preprocess
        owner: Dict[str, str] = {}
        for c in embedding_configs:
            for f in c.feature_names:
                if f in owner:  # one remapped KJT carries each feature once: two tables' remappings of it would collide
                    raise ValueError(f"ManagedCollisionCollection: feature {f!r} feeds tables {owner[f]!r} and {c.name!r}; "
                                     "each table remaps its own ids, so a managed-collision collection takes each feature "
                                     "into one table (shared features work in collections without managed collisions)")
                owner[f] = c.name
        self._feature_to_table: Dict[str, str] = {f: c.name for c in embedding_configs for f in c.feature_names}
        self._table_to_features: Dict[str, List[str]] = {c.name: list(c.feature_names) for c in embedding_configs}
        self._table_feature_splits: List[int] = [len(fs) for fs in self._table_to_features.values()]
        self._table_name_to_config: Dict[str, BaseEmbeddingConfig] = {c.name: c for c in embedding_configs}
        for name, config in self._table_name_to_config.items():
            if name not in managed_collision_modules:
                raise ValueError(f"Table {name} is not present in managed_collision_modules")
            size = managed_collision_modules[name].output_size()
            if size != config.num_embeddings:
                raise ValueError(
                    f"ManagedCollisionCollection: the module of table {name!r} maps into {size} rows, "
                    f"the table has num_embeddings={config.num_embeddings}"
                )
        if list(managed_collision_modules) != list(self._table_name_to_config):
            raise ValueError(
                f"ManagedCollisionCollection: managed_collision_modules {list(managed_collision_modules)} must list "
                f"the tables of embedding_configs in their order {list(self._table_name_to_config)}"
            )
        self._feature_names: List[str] = [f for c in embedding_configs for f in c.feature_names]

    def embedding_configs(self) -> Sequence[BaseEmbeddingConfig]:
        return self._embedding_configs

    def _mc_modules(self) -> Dict[str, ManagedCollisionModule]:
        return {table: cast(ManagedCollisionModule, m) for table, m in self._managed_collision_modules.items()}

    def table_to_number_buckets(self) -> Dict[str, int]:
        return {table: m.buckets() for table, m in self._mc_modules().items()}

    def forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
        """features: KJT holding every table's features (others are ignored) -> KJT of the tables'
        features, in table order, with ids in [0, num_embeddings)."""
        features = _features_in_order(features, self._feature_names)
        splits = features.split(self._table_feature_splits)
        remapped: List[Dict[str, JaggedTensor]] = []
        for i, (table, mc_module) in enumerate(self._mc_modules().items()):
            remapped.append(mc_module(_table_input(splits[i], table), mutate_miss_lengths=mutate_miss_lengths))
        return _remapped_kjt(features, remapped)

    def evict(self) -> Dict[str, Optional[torch.Tensor]]:
        """Table -> rows whose slot changed hands since the last call (None: none)."""
        return {table: m.evict() for table, m in self._mc_modules().items()}

    def open_slots(self) -> Dict[str, torch.Tensor]:
        return {table: m.open_slots() for table, m in self._mc_modules().items()}


def resized_collection(collection: ManagedCollisionCollection, embedding_configs: Sequence[BaseEmbeddingConfig]) -> ManagedCollisionCollection:
    """A new collection whose modules are ``collection``'s rebuilt, empty, for the row counts of ``embedding_configs``
    (same tables, policies and intervals): what a smaller copy of a model (recship's model-contract probe) holds."""
    own = collection._mc_modules()
    modules = {t.name: own[t.name].rebuild_with_output_id_range((0, t.num_embeddings), [0, t.num_embeddings]) for t in embedding_configs}
    return ManagedCollisionCollection(modules, embedding_configs)
