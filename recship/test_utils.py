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

from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import nn

from recship.models.layers import EmbeddingTower, EmbeddingTowerCollection, SwishLayerNorm
from recship.models.model_input import ModelInput, Tables
from recship.sparse import KeyedJaggedTensor, KeyedTensor, KTRegroupAsDict
from recship.test_models import (DENSE_LAYER_OUT_SIZE, OVER_ARCH_OUT_SIZE, CopyableMixin, TestDenseArch, TestEBCSparseArchZCH,
                                 TestMixedEmbeddingSparseArch, TestMixedSequenceOverArch, TestMixedSequenceOverArchLargeActivation,
                                 TestModelWithPreproc, TestModelWithPreprocCollectionArgs, TestNegSamplingModule,
                                 TestPositionWeightedPreprocModule, TestPreprocNonWeighted, TestPreprocWeighted, TestSparseNNBase,
                                 _post_sparsenn_forward, _tables_dim_sum)
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, EmbeddingTableConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, PositionWeightedModuleCollection
from recship.trainer.position_weighted import PositionWeightedProcessor


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


class _OneChoiceSharder:
    """A sharder (mixed in before EmbeddingBagCollectionSharder or EmbeddingCollectionSharder) that offers one sharding
    type and one compute kernel: tests pin a plan's choice with it."""

    def __init__(self, sharding_type: str, kernel_type: str, fused_params: Optional[Dict[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        self._sharding_type = sharding_type
        self._kernel_type = kernel_type
        super().__init__(fused_params or {}, qcomm_codecs_registry)  # type: ignore[call-arg]  # the sharder's

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]


class TestEBCSharder(_OneChoiceSharder, EmbeddingBagCollectionSharder):
    """An EmbeddingBagCollectionSharder that offers one sharding type and one compute kernel."""


class TestECSharder(_OneChoiceSharder, EmbeddingCollectionSharder):
    """An EmbeddingCollectionSharder that offers one sharding type and one compute kernel."""


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
