"""TorchRec's ``ModelInput`` (``torchrec.distributed.test_utils.model_input``): one random batch of a test model's
inputs, whole and split per rank, drawn in TorchRec's order (the same seed gives TorchRec 1.8.0's batch). Here, below
``recship.test_utils`` (which re-exports it), because TorchRec's DeepFM wrapper takes one (``recship.models.deepfm``).
"""

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch

from recship.sparse import KeyedJaggedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig

Tables = Sequence[BaseEmbeddingConfig]


def _rows(table: BaseEmbeddingConfig) -> int:
    """The ids' range of a table: its rows after pruning where it says (TorchRec's ``num_embeddings_post_pruning``)."""
    pruned = getattr(table, "num_embeddings_post_pruning", None)
    return int(pruned) if pruned else table.num_embeddings


def _kjt(keys: List[str], values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor], use_offsets: bool,
         offsets_dtype: torch.dtype, **extra: Any) -> KeyedJaggedTensor:
    if use_offsets:
        offsets = torch.cat([torch.zeros(1, dtype=offsets_dtype, device=lengths.device), lengths.cumsum(0).to(offsets_dtype)])
        return KeyedJaggedTensor(keys=keys, values=values, offsets=offsets, weights=weights, **extra)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights, **extra)


@dataclass
class ModelInput:
    """One batch of TestSparseNN's inputs.

    Args:
        float_features: [B, num_float_features] float32.
        idlist_features: KJT of the unweighted tables' features, B examples.
        idscore_features: KJT of the weighted tables' features (with weights), or None.
        label: [B] float32 in [0, 1).
        dummy: more tensors that travel with the batch (TorchRec's: ``to`` and ``record_stream`` take them along).
    """

    float_features: torch.Tensor
    idlist_features: KeyedJaggedTensor
    idscore_features: Optional[KeyedJaggedTensor]
    label: torch.Tensor
    dummy: List[torch.Tensor] = field(default_factory=list)

    @staticmethod
    def generate(
        batch_size: int,
        world_size: int,
        num_float_features: int,
        tables: Tables,
        weighted_tables: Tables,
        pooling_avg: int = 10,
        dedup_tables: Optional[Tables] = None,
        variable_batch_size: bool = False,
        tables_pooling: Optional[List[int]] = None,
        weighted_tables_pooling: Optional[List[int]] = None,
        randomize_indices: bool = True,
        device: Optional[torch.device] = None,
        max_feature_lengths: Optional[List[int]] = None,
        input_type: str = "kjt",
        use_offsets: bool = False,
        indices_dtype: torch.dtype = torch.int64,
        offsets_dtype: torch.dtype = torch.int64,
        lengths_dtype: torch.dtype = torch.int64,
        random_seed: Optional[int] = None,
        power_law_alpha: Optional[float] = None,
    ) -> Tuple["ModelInput", List["ModelInput"]]:
        """(the global batch of ``batch_size * world_size`` examples, its ``world_size`` local batches).

        Each feature's bag lengths are |N(pooling_avg, 1)| truncated to ints (or max(N(p, p/10), 1) for a table's
        ``tables_pooling`` p; clamped to ``max_feature_lengths``, one per unweighted feature), its ids uniform in
        the table's rows (``power_law_alpha``: power-law, small ids more likely; ``randomize_indices=False``: zeros),
        a weighted feature's weights uniform in [0, 1). ``variable_batch_size``: rank r keeps ``batch_size - r``
        examples (at least 1), the rest of its slots empty. ``random_seed`` seeds torch's global generator first.
        ``dedup_tables`` is accepted and unused, as in TorchRec; ``input_type`` must be "kjt" (TorchRec's
        TensorDict input is not supported).
        """
        if input_type != "kjt":
            raise ValueError(f"ModelInput.generate: input_type {input_type!r}: only 'kjt' (TensorDict inputs are not supported)")
        for what, given, listed in (("tables_pooling", tables_pooling, tables), ("weighted_tables_pooling", weighted_tables_pooling, weighted_tables)):
            if given and len(given) != len(listed):
                raise ValueError(f"{what} and its tables must have the same length. Got {len(given)} and {len(listed)}.")
        if random_seed is not None:
            torch.manual_seed(random_seed)
        n = batch_size * world_size
        per_rank = [max(batch_size - r, 1) if variable_batch_size else batch_size for r in range(world_size)]
        features = [f for t in tables for f in t.feature_names]
        ranges = [_rows(t) for t in tables for _ in t.feature_names]
        pooling = [p for t, p in zip(tables, tables_pooling or []) for _ in t.feature_names]
        if max_feature_lengths is not None and len(max_feature_lengths) != len(features):
            raise ValueError(f"max_feature_lengths: one per feature of the tables ({len(features)}), got {len(max_feature_lengths)}")

        def draw(average: float, normal: bool, max_length: Optional[int], rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
            if normal:
                drawn = torch.max(torch.normal(average, average / 10, [n], device=device), torch.tensor(1.0, device=device))
            else:
                drawn = torch.abs(torch.randn(n, device=device) + average)
            lengths = drawn.to(lengths_dtype)
            if max_length:
                lengths = torch.clamp(lengths, max=max_length)
            if variable_batch_size:
                kept = torch.zeros(n, device=device).to(lengths_dtype)
                for r in range(world_size):
                    kept[r * batch_size: r * batch_size + per_rank[r]] = lengths[r * batch_size: r * batch_size + per_rank[r]]
                lengths = kept
            count = int(torch.sum(lengths).item())
            if not randomize_indices:
                ids = torch.zeros((count,), dtype=indices_dtype, device=device)
            elif power_law_alpha is not None:
                ids = ModelInput._generate_power_law_indices(power_law_alpha, count, rows, indices_dtype, device)
            else:
                ids = torch.randint(0, rows, (count,), dtype=indices_dtype, device=device)
            return lengths, ids

        idlist = [draw(pooling[i] if pooling else pooling_avg, bool(pooling), max_feature_lengths[i] if max_feature_lengths else None,
                       ranges[i]) for i in range(len(features))]
        # TorchRec draws the weighted inputs once per weighted table (its first feature's slot), as here
        idscore: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i, t in enumerate(weighted_tables):
            lengths, ids = draw(weighted_tables_pooling[i] if weighted_tables_pooling else pooling_avg, False, None, _rows(t))
            idscore.append((lengths, ids, torch.rand((ids.numel(),), device=device)))
        score_features = [f for t in weighted_tables for f in t.feature_names]
        if randomize_indices:
            dense, label = torch.rand((n, num_float_features), device=device), torch.rand(n, device=device)
        else:
            dense, label = torch.zeros((n, num_float_features), device=device), torch.zeros(n, device=device)

        def batch(parts: List[Tuple[torch.Tensor, torch.Tensor]], scored: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  rows: slice) -> ModelInput:
            ids_kjt = _kjt(features, torch.cat([p[1] for p in parts]), torch.cat([p[0] for p in parts]), None, use_offsets, offsets_dtype)
            score_kjt = (_kjt(score_features, torch.cat([s[1] for s in scored]), torch.cat([s[0] for s in scored]),
                              torch.cat([s[2] for s in scored]), use_offsets, offsets_dtype) if scored else None)
            return ModelInput(float_features=dense[rows], idlist_features=ids_kjt, idscore_features=score_kjt, label=label[rows])

        local = []
        for r in range(world_size):
            def piece(lengths: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, slice]:
                ends = [0] + lengths.view(world_size, -1).sum(dim=1).cumsum(dim=0).tolist()
                return lengths[r * batch_size: r * batch_size + per_rank[r]], slice(ends[r], ends[r + 1])

            parts = []
            for lengths, ids in idlist:
                ls, span = piece(lengths, ids)
                parts.append((ls, ids[span]))
            scored = []
            for lengths, ids, weights in idscore:
                ls, span = piece(lengths, ids)
                scored.append((ls, ids[span], weights[span]))
            local.append(batch(parts, scored, slice(r * batch_size, (r + 1) * batch_size)))
        return batch(idlist, idscore, slice(None)), local

    @staticmethod
    def _generate_power_law_indices(alpha: float, num_indices: int, num_embeddings: int, dtype: torch.dtype,
                                    device: Optional[torch.device], seed: Optional[int] = None) -> torch.Tensor:
        """``num_indices`` ids in [0, num_embeddings) drawn from a power law f(x) ~ 1/x^alpha on [1, n] (inverse-CDF
        sampling, shifted to 0-based; alpha 0: uniform; alpha > 1: Pareto, redrawn past the end). ``seed`` is unused."""
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if num_embeddings < 1:
            raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings}")
        if num_embeddings == 1:
            return torch.zeros(num_indices, dtype=dtype, device=device)
        if alpha == 0.0:
            return torch.randint(0, num_embeddings, (num_indices,), dtype=dtype, device=device)
        u = torch.rand(num_indices, device=device).clamp(1e-10, 1 - 1e-10)
        if abs(alpha - 1.0) < 2e-3:  # log-uniform
            ids = (num_embeddings ** u - 1).long()
        elif alpha < 1.0:
            ids = ((u * (num_embeddings ** (1 - alpha) - 1) + 1) ** (1 / (1 - alpha)) - 1).long()
        else:
            exponent = -1 / (alpha - 1)
            ids = ((1 - u) ** exponent - 1).long()
            beyond = ids >= num_embeddings
            while beyond.any():
                redrawn = torch.rand(int(beyond.sum()), device=device).clamp(1e-10, 1 - 1e-10)
                ids[beyond] = ((1 - redrawn) ** exponent - 1).long()
                beyond = ids >= num_embeddings
        return ids.clamp(0, num_embeddings - 1).to(dtype)

    @staticmethod
    def generate_variable_batch_input(
        average_batch_size: int,
        world_size: int,
        num_float_features: int,
        tables: Tables,
        weighted_tables: Optional[Tables] = None,
        pooling_avg: int = 10,
        global_constant_batch: bool = False,
        use_offsets: bool = False,
        indices_dtype: torch.dtype = torch.int64,
        offsets_dtype: torch.dtype = torch.int64,
        lengths_dtype: torch.dtype = torch.int64,
        random_seed: Optional[int] = None,
    ) -> Tuple["ModelInput", List["ModelInput"]]:
        """Variable-batch inputs: on each rank each feature has its own batch size (1 .. 2 * average - 1), bags of 0-4
        ids, and inverse indices mapping the rank's 2 * average examples to them; the global KJT stacks the ranks
        per feature (``global_constant_batch``: expanded through the inverse indices to 2 * average * world_size
        examples a feature). Seeds torch and Python's ``random`` with ``random_seed`` (default 100), as TorchRec."""
        seed = 100 if random_seed is None else random_seed
        torch.manual_seed(seed)
        random.seed(seed)
        dedup = 2
        args = (average_batch_size, world_size, dedup, global_constant_batch, use_offsets, indices_dtype, offsets_dtype, lengths_dtype)
        global_kjt, local_kjts = _variable_batch_features(tables, *args)
        global_scores, local_scores = _variable_batch_features(weighted_tables, *args) if weighted_tables else (None, [])
        per_rank = dedup * average_batch_size
        dense = torch.rand((per_rank * world_size, num_float_features))
        local, labels = [], []
        for r in range(world_size):
            labels.append(torch.rand(per_rank))
            local.append(ModelInput(float_features=dense[r * per_rank: (r + 1) * per_rank], idlist_features=local_kjts[r],
                                    idscore_features=local_scores[r] if local_scores else None, label=labels[r]))
        return ModelInput(float_features=dense, idlist_features=global_kjt, idscore_features=global_scores,
                          label=torch.cat(labels)), local

    def to(self, device: torch.device, non_blocking: bool = False, data_copy_stream: Optional[torch.Stream] = None,
           dense_only: bool = False) -> "ModelInput":
        """This batch on ``device``; ``data_copy_stream``: copied within that stream; ``dense_only``: the sparse
        features stay where they are (float_features, label and dummy move)."""
        if data_copy_stream is None:
            def sparse(kjt: Optional[KeyedJaggedTensor]) -> Optional[KeyedJaggedTensor]:
                return kjt if kjt is None or dense_only else kjt.to(device=device, non_blocking=non_blocking)

            return ModelInput(float_features=self.float_features.to(device=device, non_blocking=non_blocking),
                              idlist_features=cast(KeyedJaggedTensor, sparse(self.idlist_features)),
                              idscore_features=sparse(self.idscore_features),
                              label=self.label.to(device=device, non_blocking=non_blocking),
                              dummy=[d.to(device=device, non_blocking=non_blocking) for d in self.dummy])
        # copied within the copy stream, after the work queued so far on the current one (TorchRec allocates the
        # targets first on the current stream; here the copies allocate them in the copy stream)
        module = torch.get_device_module(device)
        with module.stream(data_copy_stream):
            data_copy_stream.wait_stream(module.current_stream(device))
            return self.to(device, non_blocking=non_blocking, dense_only=dense_only)

    def record_stream(self, stream: torch.Stream) -> None:
        self.float_features.record_stream(stream)
        self.idlist_features.record_stream(stream)
        if self.idscore_features is not None:
            self.idscore_features.record_stream(stream)
        self.label.record_stream(stream)
        for d in self.dummy:
            d.record_stream(stream)

    def size_in_bytes(self) -> int:
        """Bytes of every tensor of the batch (the KJTs' own tensors included)."""
        size = self.float_features.element_size() * self.float_features.numel() + self.label.element_size() * self.label.numel()
        size += self.idlist_features.size_in_bytes()
        if self.idscore_features is not None:
            size += self.idscore_features.size_in_bytes()
        return size + sum(d.element_size() * d.numel() for d in self.dummy)


def _variable_batch_features(tables: Tables, average: int, world_size: int, dedup: int, constant: bool, use_offsets: bool,
                             indices_dtype: torch.dtype, offsets_dtype: torch.dtype,
                             lengths_dtype: torch.dtype) -> Tuple[KeyedJaggedTensor, List[KeyedJaggedTensor]]:
    """(the global KJT, the per-rank KJTs) of ``generate_variable_batch_input``, drawn in TorchRec's order. As in
    TorchRec, the features carry weights only where the first table's config says ``is_weighted``
    (EmbeddingTableConfig); EmbeddingBagConfigs have no such field, so weighted tables given as those get none."""
    weighted = bool(tables) and bool(getattr(tables[0], "is_weighted", False))
    rows = {f: _rows(t) for t in tables for f in t.feature_names}
    keys = list(rows)
    drawn: List[Dict[str, Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int, torch.Tensor]]] = []
    local = []
    for _ in range(world_size):
        per_feature = {}
        for key, n in rows.items():
            stride = random.randint(1, average * dedup - 1)
            lengths = torch.randint(low=0, high=5, size=(stride,), dtype=lengths_dtype)
            total = sum(lengths.tolist())
            values = torch.randint(0, n, (total,), dtype=indices_dtype)
            weights = torch.rand(total) if weighted else None
            inverse_ids = torch.randint(0, stride, (dedup * average,), dtype=indices_dtype)
            per_feature[key] = (lengths, values, weights, stride, inverse_ids)
        drawn.append(per_feature)
        cat_weights = torch.cat([cast(torch.Tensor, p[2]) for p in per_feature.values()]) if weighted else None
        values = torch.cat([p[1] for p in per_feature.values()])
        lengths = torch.cat([p[0] for p in per_feature.values()])
        if use_offsets:
            local.append(_kjt(keys, values, lengths, cat_weights, True, offsets_dtype))
        else:
            local.append(_kjt(keys, values, lengths, cat_weights, False, offsets_dtype,
                              stride_per_key_per_rank=[[p[3]] for p in per_feature.values()],
                              inverse_indices=(keys, torch.stack([p[4] for p in per_feature.values()]))))
    order = [(r, key) for key in keys for r in range(world_size)]  # key-major, ranks inside
    strides = [[sum(drawn[r][key][3] for r in range(world_size))] for key in keys]
    inverse_list: List[torch.Tensor] = []
    for key in keys:
        shift, parts = 0, []
        for r in range(world_size):
            parts.append(drawn[r][key][4] + shift)
            shift += drawn[r][key][3]
        inverse_list.append(torch.cat(parts))
    weights_all: Optional[torch.Tensor]
    spk: Optional[List[List[int]]] = strides
    inverse: Optional[Tuple[List[str], torch.Tensor]] = (keys, torch.stack(inverse_list))
    if constant:  # every rank's examples expanded through its inverse indices
        lengths_parts, value_parts, weight_parts = [], [], []
        for r, key in order:
            lengths, values, weights, _, inv_r = drawn[r][key]
            offsets = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)])
            lengths_parts.append(torch.index_select(lengths, 0, inv_r))
            for i in inv_r.tolist():
                value_parts.append(values[offsets[i]: offsets[i + 1]])
                if weights is not None:
                    weight_parts.append(weights[offsets[i]: offsets[i + 1]])
        lengths_all, values_all = torch.cat(lengths_parts), torch.cat(value_parts)
        weights_all = torch.cat(weight_parts) if weighted else None
        spk, inverse = None, None
    else:
        lengths_all = torch.cat([drawn[r][key][0] for r, key in order])
        values_all = torch.cat([drawn[r][key][1] for r, key in order])
        weights_all = torch.cat([cast(torch.Tensor, drawn[r][key][2]) for r, key in order]) if weighted else None
    return _kjt(keys, values_all, lengths_all, weights_all, use_offsets, offsets_dtype, stride_per_key_per_rank=spk,
                inverse_indices=inverse), local
