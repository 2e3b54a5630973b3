"""TorchRec's test models and inputs (``torchrec.distributed.test_utils.test_model`` and ``emb_sharder``), which users'
own tests import: ``ModelInput`` (a random batch, whole and split per rank), ``TestSparseNN`` and its archs, the tower
models, and sharders restricted to one sharding type; the pre-processing, managed-collision and mixed pooled/sequence
fixtures live in ``recship.test_models`` and are re-exported here.

    tables = [EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="t0", feature_names=["f0"])]
    weighted = [EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="w0", feature_names=["wf0"])]
    model = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=10)
    global_batch, local_batches = ModelInput.generate(batch_size=4, world_size=2, num_float_features=10, tables=tables,
                                                      weighted_tables=weighted, random_seed=0)
    loss, pred = model(global_batch)          # training mode: (BCE loss, predictions [8])

The constructors, state_dict keys and output shapes are TorchRec's; ``ModelInput.generate`` draws from torch's global
generator in TorchRec's order, so the same seed gives TorchRec 1.8.0's batch (and ``generate_variable_batch_input``
also seeds Python's ``random``, as TorchRec does). Mistakes are ValueErrors (TorchRec: asserts).
"""

import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import nn

from recship.models.layers import EmbeddingTower, EmbeddingTowerCollection, SwishLayerNorm
from recship.sparse import KeyedJaggedTensor, KeyedTensor, KTRegroupAsDict
from recship.test_models import (DENSE_LAYER_OUT_SIZE, OVER_ARCH_OUT_SIZE, CopyableMixin, TestDenseArch, TestEBCSparseArchZCH,
                                 TestMixedEmbeddingSparseArch, TestMixedSequenceOverArch, TestMixedSequenceOverArchLargeActivation,
                                 TestModelWithPreproc, TestModelWithPreprocCollectionArgs, TestNegSamplingModule,
                                 TestPositionWeightedPreprocModule, TestPreprocNonWeighted, TestPreprocWeighted, TestSparseNNBase,
                                 _post_sparsenn_forward, _tables_dim_sum)
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.trainer.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, EmbeddingTableConfig
from recship.trainer.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, PositionWeightedModuleCollection
from recship.trainer.position_weighted import PositionWeightedProcessor

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
    """

    float_features: torch.Tensor
    idlist_features: KeyedJaggedTensor
    idscore_features: Optional[KeyedJaggedTensor]
    label: torch.Tensor

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

    def to(self, device: torch.device, non_blocking: bool = False, data_copy_stream: Optional[torch.Stream] = None) -> "ModelInput":
        """This batch on ``device``; ``data_copy_stream``: copied within that stream."""
        if data_copy_stream is None:
            return ModelInput(float_features=self.float_features.to(device=device, non_blocking=non_blocking),
                              idlist_features=self.idlist_features.to(device=device, non_blocking=non_blocking),
                              idscore_features=(None if self.idscore_features is None
                                                else self.idscore_features.to(device=device, non_blocking=non_blocking)),
                              label=self.label.to(device=device, non_blocking=non_blocking))
        # copied within the copy stream, after the work queued so far on the current one (TorchRec allocates the
        # targets first on the current stream; here the copies allocate them in the copy stream)
        module = torch.get_device_module(device)
        with module.stream(data_copy_stream):
            data_copy_stream.wait_stream(module.current_stream(device))
            return self.to(device, non_blocking=non_blocking)

    def record_stream(self, stream: torch.Stream) -> None:
        self.float_features.record_stream(stream)
        self.idlist_features.record_stream(stream)
        if self.idscore_features is not None:
            self.idscore_features.record_stream(stream)
        self.label.record_stream(stream)

    def size_in_bytes(self) -> int:
        """Bytes of every tensor of the batch (the KJTs' own tensors included)."""
        size = self.float_features.element_size() * self.float_features.numel() + self.label.element_size() * self.label.numel()
        size += self.idlist_features.size_in_bytes()
        if self.idscore_features is not None:
            size += self.idscore_features.size_in_bytes()
        return size


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


class TestDHNArch(nn.Module):
    """Two Linear layers: [B, in_features] -> [B, over_arch_out_size (16)] -> the same width."""

    def __init__(self, in_features: int, device: Optional[torch.device] = None, over_arch_out_size: Optional[int] = None) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        out_size = OVER_ARCH_OUT_SIZE if over_arch_out_size is None else over_arch_out_size
        self.linear0 = nn.Linear(in_features=in_features, out_features=out_size, device=device)
        self.linear1 = nn.Linear(in_features=out_size, out_features=out_size, device=device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.linear1(self.linear0(input))


@torch.fx.wrap
def _concat(dense: torch.Tensor, sparse_embeddings: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([dense] + sparse_embeddings, dim=1)


class TestOverArch(nn.Module):
    """The dense arch's output [B, 8] and the sparse arch's KeyedTensor, the unweighted features then the weighted
    ones regrouped after it, through a TestDHNArch -> [B, over_arch_out_size (16)]."""

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig],
                 embedding_names: Optional[List[str]] = None, device: Optional[torch.device] = None,
                 dense_arch_out_size: Optional[int] = None, over_arch_out_size: Optional[int] = None, **_kwargs: Any) -> None:
        super().__init__()
        self.device: torch.device = device or torch.device("cpu")
        self._embedding_names: List[str] = embedding_names or [f for t in tables for f in t.feature_names]
        self._weighted_features: List[str] = [f for t in weighted_tables for f in t.feature_names]
        dense_size = DENSE_LAYER_OUT_SIZE if dense_arch_out_size is None else dense_arch_out_size
        in_features = dense_size + _tables_dim_sum(list(tables) + list(weighted_tables))
        self.dhn_arch: nn.Module = TestDHNArch(in_features, over_arch_out_size=over_arch_out_size, device=self.device)

    def sparse_grouped(self, sparse: KeyedTensor) -> List[torch.Tensor]:
        return KeyedTensor.regroup([sparse], [self._embedding_names, self._weighted_features])

    def forward(self, dense: torch.Tensor, sparse: KeyedTensor) -> torch.Tensor:
        return self.dhn_arch(_concat(dense, self.sparse_grouped(sparse)))


class TestOverArchRegroupModule(TestOverArch):
    """TestOverArch regrouping with a KTRegroupAsDict module ("unweighted", "weighted")."""

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig],
                 embedding_names: Optional[List[str]] = None, device: Optional[torch.device] = None,
                 dense_arch_out_size: Optional[int] = None, over_arch_out_size: Optional[int] = None, **_kwargs: Any) -> None:
        super().__init__(tables=tables, weighted_tables=weighted_tables, embedding_names=embedding_names, device=device,
                         dense_arch_out_size=dense_arch_out_size, over_arch_out_size=over_arch_out_size)
        self.regroup_module = KTRegroupAsDict([self._embedding_names, self._weighted_features], ["unweighted", "weighted"])

    def sparse_grouped(self, sparse: KeyedTensor) -> List[torch.Tensor]:
        return list(self.regroup_module([sparse]).values())


class TestOverArchLarge(nn.Module):
    """A larger over arch: Linear + SwishLayerNorm, then ``over_arch_hidden_layers`` (5) more of them (the hidden
    part repeated ``over_arch_hidden_repeat`` times), on the dense output and the regrouped sparse features."""

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig],
                 embedding_names: Optional[List[str]] = None, device: Optional[torch.device] = None,
                 dense_arch_out_size: Optional[int] = None, over_arch_out_size: Optional[int] = None,
                 over_arch_hidden_layers: Optional[int] = None, over_arch_hidden_repeat: Optional[int] = None,
                 skip_regroup: bool = False, **_kwargs: Any) -> None:
        super().__init__()
        self.device: torch.device = device or torch.device("cpu")
        names = embedding_names if embedding_names is not None else [f for t in tables for f in t.feature_names]
        weighted = [f for t in weighted_tables for f in t.feature_names]
        dense_size = DENSE_LAYER_OUT_SIZE if dense_arch_out_size is None else dense_arch_out_size
        out = OVER_ARCH_OUT_SIZE if over_arch_out_size is None else over_arch_out_size
        layers: List[nn.Module] = [nn.Linear(dense_size + _tables_dim_sum(list(tables) + list(weighted_tables)), out),
                                   SwishLayerNorm([out])]
        for _ in range(5 if over_arch_hidden_layers is None else over_arch_hidden_layers):
            layers += [nn.Linear(out, out), SwishLayerNorm([out])]
        for _ in range(over_arch_hidden_repeat or 0):
            layers += layers[1:]
        self.overarch = nn.Sequential(*layers)
        self.regroup_module: Optional[nn.Module] = None if skip_regroup else KTRegroupAsDict([names, weighted], ["unweighted", "weighted"])

    def forward(self, dense: torch.Tensor, sparse: KeyedTensor) -> torch.Tensor:
        values = list(self.regroup_module([sparse]).values()) if self.regroup_module is not None else [sparse.values()]
        return self.overarch(_concat(dense, values))


class TestECSparseArch(nn.Module):
    """An EmbeddingCollection sparse arch: {feature: JaggedTensor of [ids, dim] rows}, as the collection gives it
    (TorchRec hands that dict to a KeyedTensor merge that cannot take it; here the collection's output is returned)."""

    def __init__(self, tables: List[EmbeddingConfig], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.ec: EmbeddingCollection = EmbeddingCollection(tables=tables, device=device or torch.device("cpu"))

    def forward(self, features: KeyedJaggedTensor, weighted_features: Optional[KeyedJaggedTensor] = None,
                batch_size: Optional[int] = None) -> Any:
        return self.ec(features)


class TestEBCSparseArch(nn.Module):
    """The unweighted tables (``ebc``; those named in ``max_feature_lengths`` in a position-weighted ``fp_ebc``) and
    the weighted ones (``weighted_ebc``): KJTs in, one KeyedTensor [B, sum of dims] out (ebc, fp_ebc, weighted)."""

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig],
                 device: Optional[torch.device] = None, max_feature_lengths: Optional[Dict[str, int]] = None,
                 **_kwargs: Any) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        self.fps: Optional[nn.ModuleList] = None
        self.fp_ebc: Optional[FeatureProcessedEmbeddingBagCollection] = None
        if max_feature_lengths is not None:
            fp_names = set(max_feature_lengths)
            self.ebc = EmbeddingBagCollection(tables=[t for t in tables if t.name not in fp_names], device=device)
            processors = PositionWeightedModuleCollection(max_feature_lengths=max_feature_lengths,
                                                          device=device if device != torch.device("meta") else torch.device("cpu"))
            self.fp_ebc = FeatureProcessedEmbeddingBagCollection(
                embedding_bag_collection=EmbeddingBagCollection(tables=[t for t in tables if t.name in fp_names], device=device,
                                                                is_weighted=True),
                feature_processors=processors)
        else:
            self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        self.weighted_ebc: Optional[EmbeddingBagCollection] = (
            EmbeddingBagCollection(tables=weighted_tables, is_weighted=True, device=device) if weighted_tables else None)

    def forward(self, features: KeyedJaggedTensor, weighted_features: Optional[KeyedJaggedTensor] = None,
                batch_size: Optional[int] = None) -> KeyedTensor:
        fp_features = features
        if self.fps:
            for fp in self.fps:
                fp_features = fp(fp_features)
        ebc = self.ebc(features)
        fp_ebc = self.fp_ebc(fp_features) if self.fp_ebc is not None else None
        w_ebc = self.weighted_ebc(weighted_features) if self.weighted_ebc is not None and weighted_features is not None else None
        return _post_sparsenn_forward(ebc, fp_ebc, w_ebc, batch_size)


class TestSparseNN(TestSparseNNBase, CopyableMixin):
    """TorchRec's SparseNN test model: ``dense`` (TestDenseArch), ``sparse`` (TestEBCSparseArch, or TestECSparseArch
    for EmbeddingConfigs), ``over`` (``over_arch_clazz``, default TestOverArch).

    forward(ModelInput) -> in training mode (BCE-with-logits loss of pred against the label, pred [B]), in eval mode
    pred [B] = sigmoid(mean of the over arch's output) + 1 (TorchRec's ``dummy_ones`` buffer).
    ``zch_kwargs`` (table -> managed-collision config): the sparse arch is a TestEBCSparseArchZCH on the meta device.
    """

    dummy_ones: torch.Tensor  # buffer [1]

    def __init__(self, tables: Union[List[EmbeddingBagConfig], List[EmbeddingConfig]], num_float_features: int = 10,
                 weighted_tables: Optional[List[EmbeddingBagConfig]] = None, embedding_groups: Optional[Dict[str, List[str]]] = None,
                 dense_device: Optional[torch.device] = None, sparse_device: Optional[torch.device] = None,
                 max_feature_lengths: Optional[Dict[str, int]] = None,
                 feature_processor_modules: Optional[Dict[str, torch.nn.Module]] = None,
                 over_arch_clazz: Optional[Type[nn.Module]] = None, postproc_module: Optional[nn.Module] = None,
                 zch_kwargs: Optional[Dict[str, Any]] = None, submodule_kwargs: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(tables=cast(List[BaseEmbeddingConfig], tables), weighted_tables=cast(Optional[List[BaseEmbeddingConfig]], weighted_tables),
                         embedding_groups=embedding_groups, dense_device=dense_device, sparse_device=sparse_device)
        weighted = list(weighted_tables or [])
        kwargs = submodule_kwargs or {}
        self.dense = TestDenseArch(num_float_features, device=dense_device, **kwargs)
        self.sparse: nn.Module
        if zch_kwargs is not None:  # on meta, as TorchRec: DistributedModelParallel materializes it
            self.sparse = TestEBCSparseArchZCH(cast(List[EmbeddingBagConfig], tables), weighted, torch.device("meta"),
                                               zch_kwargs=zch_kwargs, return_remapped=True)
        elif tables and isinstance(tables[0], EmbeddingConfig):
            self.sparse = TestECSparseArch(cast(List[EmbeddingConfig], tables), sparse_device, **kwargs)
        else:
            self.sparse = TestEBCSparseArch(cast(List[EmbeddingBagConfig], tables), weighted, sparse_device, max_feature_lengths, **kwargs)
        embedding_names = list(embedding_groups.values())[0] if embedding_groups else None
        self._embedding_names: List[str] = embedding_names or [f for t in tables for f in t.feature_names]
        self._weighted_features: List[str] = [f for t in weighted for f in t.feature_names]
        self.over: nn.Module = (over_arch_clazz or TestOverArch)(tables, weighted, embedding_names, dense_device, **kwargs)
        self.register_buffer("dummy_ones", torch.ones(1, device=dense_device))
        self.postproc_module = postproc_module

    def sparse_forward(self, input: ModelInput) -> KeyedTensor:
        return self.sparse(features=input.idlist_features, weighted_features=input.idscore_features,
                           batch_size=input.float_features.size(0))

    def dense_forward(self, input: ModelInput, sparse_output: KeyedTensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        pred = torch.sigmoid(torch.mean(self.over(self.dense(input.float_features), sparse_output), dim=1)) + self.dummy_ones
        if self.training:
            return nn.functional.binary_cross_entropy_with_logits(pred, input.label), pred
        return pred

    def forward(self, input: ModelInput) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if self.postproc_module is not None:
            input = self.postproc_module(input)
        return self.dense_forward(input, self.sparse_forward(input))


class TestTowerInteraction(nn.Module):
    """A tower's interaction: its features' pooled embeddings concatenated, through one square Linear."""

    def __init__(self, tables: List[EmbeddingBagConfig], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self._features: List[str] = [f for t in tables for f in t.feature_names]
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
        self.linear = nn.Linear(in_features=width, out_features=width, device=device or torch.device("cpu"))

    def forward(self, sparse: KeyedTensor) -> torch.Tensor:
        return self.linear(torch.cat([sparse[f] for f in self._features], dim=1))


def _loss_or_pred(model: nn.Module, over: torch.Tensor, label: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    pred = torch.sigmoid(torch.mean(over, dim=1))
    if model.training:
        return nn.functional.binary_cross_entropy_with_logits(pred, label), pred
    return pred


def _need(tables: Sequence[Any], count: int, what: str, model: str) -> None:
    if len(tables) < count:
        raise ValueError(f"{model} needs at least {count} {what}, got {len(tables)}")


class TestTowerSparseNN(TestSparseNNBase):
    """Towers over tables 2-3 (``tower_0``) and 0 (``tower_1``), a sparse arch over table 1 and weighted table 0,
    the dense arch, and a Linear to 16; forward(ModelInput) as TestSparseNN's, without the +1."""

    def __init__(self, tables: List[EmbeddingBagConfig], num_float_features: int = 10,
                 weighted_tables: Optional[List[EmbeddingBagConfig]] = None, embedding_groups: Optional[Dict[str, List[str]]] = None,
                 dense_device: Optional[torch.device] = None, sparse_device: Optional[torch.device] = None,
                 feature_processor_modules: Optional[Dict[str, torch.nn.Module]] = None) -> None:
        super().__init__(tables=cast(List[BaseEmbeddingConfig], tables), weighted_tables=cast(Optional[List[BaseEmbeddingConfig]], weighted_tables),
                         embedding_groups=embedding_groups, dense_device=dense_device, sparse_device=sparse_device)
        weighted = list(weighted_tables or [])
        _need(tables, 4, "tables", "TestTowerSparseNN")
        _need(weighted, 1, "weighted tables", "TestTowerSparseNN")
        self.dense = TestDenseArch(num_float_features, device=dense_device)
        self.tower_0 = EmbeddingTower(embedding_module=EmbeddingBagCollection(tables=[tables[2], tables[3]]),
                                      interaction_module=TestTowerInteraction(tables=[tables[2], tables[3]]))
        self.tower_1 = EmbeddingTower(embedding_module=EmbeddingBagCollection(tables=[tables[0]]),
                                      interaction_module=TestTowerInteraction(tables=[tables[0]]))
        self.sparse_arch = TestEBCSparseArch([tables[1]], [weighted[0]], sparse_device)
        self.sparse_arch_feature_names: List[str] = tables[1].feature_names + weighted[0].feature_names
        # the dense arch's 8, each tower's interaction width (its tables' pooled widths), the sparse arch's tables
        width = 8 + _tables_dim_sum([tables[2], tables[3]]) + _tables_dim_sum([tables[0]]) + _tables_dim_sum([tables[1], weighted[0]])
        self.over = nn.Linear(in_features=width, out_features=16, device=dense_device)

    def forward(self, input: ModelInput) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        dense = self.dense(input.float_features)
        sparse_kt = self.sparse_arch(input.idlist_features, input.idscore_features)
        sparse = torch.cat([sparse_kt[f] for f in self.sparse_arch_feature_names], dim=1)
        towers = torch.cat([self.tower_0(input.idlist_features), self.tower_1(input.idlist_features), sparse], dim=1)
        return _loss_or_pred(self, self.over(torch.cat([dense, towers], dim=1)), input.label)


class TestTowerCollectionSparseNN(TestSparseNNBase):
    """An EmbeddingTowerCollection of three towers (tables 0 and 2; table 1; weighted table 0), the dense arch, and a
    Linear to 16; forward(ModelInput) as TestTowerSparseNN's."""

    def __init__(self, tables: List[EmbeddingBagConfig], num_float_features: int = 10,
                 weighted_tables: Optional[List[EmbeddingBagConfig]] = None, embedding_groups: Optional[Dict[str, List[str]]] = None,
                 dense_device: Optional[torch.device] = None, sparse_device: Optional[torch.device] = None,
                 feature_processor_modules: Optional[Dict[str, torch.nn.Module]] = None) -> None:
        super().__init__(tables=cast(List[BaseEmbeddingConfig], tables), weighted_tables=cast(Optional[List[BaseEmbeddingConfig]], weighted_tables),
                         embedding_groups=embedding_groups, dense_device=dense_device, sparse_device=sparse_device)
        weighted = list(weighted_tables or [])
        _need(tables, 3, "tables", "TestTowerCollectionSparseNN")
        _need(weighted, 1, "weighted tables", "TestTowerCollectionSparseNN")
        self.dense = TestDenseArch(num_float_features, device=dense_device)
        tower_0 = EmbeddingTower(embedding_module=EmbeddingBagCollection(tables=[tables[0], tables[2]]),
                                 interaction_module=TestTowerInteraction(tables=[tables[0], tables[2]]))
        tower_1 = EmbeddingTower(embedding_module=EmbeddingBagCollection(tables=[tables[1]]),
                                 interaction_module=TestTowerInteraction(tables=[tables[1]]))
        tower_2 = EmbeddingTower(embedding_module=EmbeddingBagCollection(tables=[weighted[0]], is_weighted=True),
                                 interaction_module=TestTowerInteraction(tables=[weighted[0]]))
        self.tower_arch = EmbeddingTowerCollection(towers=[tower_0, tower_1, tower_2])
        width = 8 + _tables_dim_sum([tables[0], tables[2]]) + _tables_dim_sum([tables[1]]) + _tables_dim_sum([weighted[0]])
        self.over = nn.Linear(in_features=width, out_features=16, device=dense_device)

    def forward(self, input: ModelInput) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        dense = self.dense(input.float_features)
        sparse = self.tower_arch(input.idlist_features, input.idscore_features)
        return _loss_or_pred(self, self.over(torch.cat([dense, sparse], dim=1)), input.label)


class TestEBCSharder(EmbeddingBagCollectionSharder):
    """An EmbeddingBagCollectionSharder that offers one sharding type and one compute kernel (tests pin a plan's
    choice with it)."""

    def __init__(self, sharding_type: str, kernel_type: str, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        self._sharding_type = sharding_type
        self._kernel_type = kernel_type
        super().__init__(fused_params or {}, qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


class TestECSharder(EmbeddingCollectionSharder):
    """An EmbeddingCollectionSharder that offers one sharding type and one compute kernel."""

    def __init__(self, sharding_type: str, kernel_type: str, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        self._sharding_type = sharding_type
        self._kernel_type = kernel_type
        super().__init__(fused_params or {}, qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


__all__ = [
    "BaseEmbeddingConfig", "CopyableMixin", "DENSE_LAYER_OUT_SIZE", "EmbeddingBagCollection", "EmbeddingBagConfig",
    "EmbeddingCollection", "EmbeddingConfig", "EmbeddingTableConfig", "EmbeddingTower", "EmbeddingTowerCollection",
    "FeatureProcessedEmbeddingBagCollection", "KTRegroupAsDict", "KeyedJaggedTensor", "KeyedTensor", "ModelInput",
    "OVER_ARCH_OUT_SIZE", "PositionWeightedModuleCollection", "PositionWeightedProcessor", "SwishLayerNorm", "TestDHNArch",
    "TestDenseArch", "TestEBCSharder", "TestEBCSparseArch", "TestECSharder", "TestECSparseArch", "TestOverArch",
    "TestOverArchLarge", "TestOverArchRegroupModule", "TestSparseNN", "TestSparseNNBase", "TestTowerCollectionSparseNN",
    "TestTowerInteraction", "TestTowerSparseNN",
    # recship.test_models
    "TestEBCSparseArchZCH", "TestMixedEmbeddingSparseArch", "TestMixedSequenceOverArch", "TestMixedSequenceOverArchLargeActivation",
    "TestModelWithPreproc", "TestModelWithPreprocCollectionArgs", "TestNegSamplingModule", "TestPositionWeightedPreprocModule",
    "TestPreprocNonWeighted", "TestPreprocWeighted",
]
