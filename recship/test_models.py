"""TorchRec's test models beyond TestSparseNN (``torchrec.distributed.test_utils.test_model``), re-exported by
``recship.test_utils``: the pieces every test model shares (TestDenseArch, TestSparseNNBase, the sparse archs' merge),
the pre-processing ("postproc") models and modules, the managed-collision sparse arch, and the mixed pooled/sequence
model.

    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="table_0", feature_names=["feature_0"]), ...]
    model = TestModelWithPreproc(tables, weighted_tables, torch.device("cpu"))   # features feature_0..2, weighted_feature_0
    loss, pred = model(batch)        # pred [B, sum of the tables' dims], loss = pred.sum()

Constructors, state_dict keys and outputs are TorchRec 1.8.0's. Mistakes are ValueErrors (TorchRec: asserts).
"""

import copy
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import nn

from recship.models.layers import SwishLayerNorm
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.managed_collisions import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                                ManagedCollisionEmbeddingBagCollection, ManagedCollisionModule,
                                                MCHManagedCollisionModule)
from recship.trainer.position_weighted import PositionWeightedProcessor

if TYPE_CHECKING:
    from recship.test_utils import ModelInput

DENSE_LAYER_OUT_SIZE = 8
OVER_ARCH_OUT_SIZE = 16
MAX_SEQUENCE_LENGTH = 20  # TorchRec pads every sequence feature of the mixed model to 20 ids

Tables = Sequence[BaseEmbeddingConfig]


def _tables_dim_sum(tables: Tables, max_sequence_length: int = 1) -> int:
    return sum(t.embedding_dim * len(t.feature_names) * max_sequence_length for t in tables)


class CopyableMixin(nn.Module):
    """A module that ``copy(device)`` moves to ``device`` (a deep copy, TorchRec's ``torchrec.distributed.utils``)."""

    def copy(self, device: torch.device) -> nn.Module:
        return copy.deepcopy(self).to(device)


class TestDenseArch(nn.Module):
    """Float features [B, num_float_features] -> [B, dense_arch_out_size (8)]: hidden Linear layers, then one Linear.
    Holds TorchRec's ``dummy_param`` [2] and ``dummy_buffer`` [1] (zeros, unused by forward)."""

    def __init__(self, num_float_features: int, device: Optional[torch.device] = None, dense_arch_out_size: Optional[int] = None,
                 dense_arch_hidden_sizes: Optional[List[int]] = None, **_kwargs: Any) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        out_size = DENSE_LAYER_OUT_SIZE if dense_arch_out_size is None else dense_arch_out_size
        hidden: List[nn.Module] = []
        width = num_float_features
        for size in dense_arch_hidden_sizes or []:
            if size <= 0:
                raise ValueError(f"TestDenseArch: layer sizes must be positive, got {dense_arch_hidden_sizes}")
            hidden.append(nn.Linear(width, size, device=device))
            width = size
        self.hidden_layers: Optional[nn.ModuleList] = nn.ModuleList(hidden) if hidden else None
        self.linear = nn.Linear(in_features=width, out_features=out_size, device=device)
        self.dummy_param = nn.Parameter(torch.zeros(2, device=device))
        self.register_buffer("dummy_buffer", torch.zeros(1, device=device))

    def forward(self, dense_input: torch.Tensor) -> torch.Tensor:
        out = dense_input
        if self.hidden_layers is not None:
            for layer in self.hidden_layers:
                out = layer(out)
        return self.linear(out)


def _pad_kt_values(kt: KeyedTensor, batch_size: Optional[int] = None) -> torch.Tensor:
    """``kt``'s values [b, D] padded with zero rows to [batch_size, D]."""
    values = kt.values()
    if batch_size is None or values.size(0) == batch_size:
        return values
    return torch.cat([values, values.new_zeros(batch_size - values.size(0), values.size(1))], dim=0)


@torch.fx.wrap
def _post_sparsenn_forward(ebc: KeyedTensor, fp_ebc: Optional[KeyedTensor], w_ebc: Optional[KeyedTensor],
                           batch_size: Optional[int] = None) -> KeyedTensor:
    """The three collections' outputs as one KeyedTensor (each padded to ``batch_size`` rows)."""
    keys, lengths = list(ebc.keys()), list(ebc.length_per_key())
    values = [_pad_kt_values(ebc, batch_size)]
    for kt in (fp_ebc, w_ebc):
        if kt is not None:
            keys += kt.keys()
            lengths += kt.length_per_key()
            values.append(_pad_kt_values(kt, batch_size))
    return KeyedTensor(keys=keys, length_per_key=lengths, values=torch.cat(values, dim=1))


class TestSparseNNBase(nn.Module):
    """What the test models share: their dense and sparse devices (default CPU)."""

    def __init__(self, tables: List[BaseEmbeddingConfig], weighted_tables: Optional[List[BaseEmbeddingConfig]] = None,
                 embedding_groups: Optional[Dict[str, List[str]]] = None, dense_device: Optional[torch.device] = None,
                 sparse_device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.dense_device: torch.device = dense_device or torch.device("cpu")
        self.sparse_device: torch.device = sparse_device or torch.device("cpu")


# --- pre-processing ("postproc") models: modules run on the input before the embedding lookups -------------------------


def _select(kjt: KeyedJaggedTensor, keys: List[str], what: str) -> List[KeyedJaggedTensor]:
    missing = [k for k in keys if k not in kjt.keys()]
    if missing:
        raise ValueError(f"{what}: the features {missing} are not in the input's keys {kjt.keys()}")
    return [KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in keys})]


class TestPreprocNonWeighted(nn.Module):
    """KJT -> [KJT of its features feature_0, feature_1, feature_2] (the rest dropped)."""

    def forward(self, kjt: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        return _select(kjt, ["feature_0", "feature_1", "feature_2"], type(self).__name__)


class TestPreprocWeighted(nn.Module):
    """Weighted KJT -> [KJT of its feature weighted_feature_0, weights kept]."""

    def forward(self, kjt: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        return _select(kjt, ["weighted_feature_0"], type(self).__name__)


class _PreprocModel(nn.Module):
    """The preproc models' layout: an unused ``dense`` arch, ``ebc`` and ``weighted_ebc``, and the two selectors."""

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig], device: torch.device,
                 num_float_features: int) -> None:
        super().__init__()
        self.dense = TestDenseArch(num_float_features, device=device)
        self.ebc: EmbeddingBagCollection = EmbeddingBagCollection(tables=tables, device=device)
        self.weighted_ebc = EmbeddingBagCollection(tables=weighted_tables, is_weighted=True, device=device)
        self.postproc_nonweighted = TestPreprocNonWeighted()
        self.postproc_weighted = TestPreprocWeighted()

    def _lookup(self, input: "ModelInput") -> Tuple[torch.Tensor, torch.Tensor]:
        """(pred.sum(), pred): pred [B, dims of feature_0..2 then weighted_feature_0] pooled embeddings."""
        if input.idscore_features is None:
            raise ValueError(f"{type(self).__name__}: the input has no idscore_features (weighted_feature_0 is needed)")
        ebc_out = self.ebc(self.postproc_nonweighted(input.idlist_features)[0])
        weighted_ebc_out = self.weighted_ebc(self.postproc_weighted(input.idscore_features)[0])
        pred = torch.cat([ebc_out.values(), weighted_ebc_out.values()], dim=1)
        return pred.sum(), pred


@torch.fx.wrap
def _rebuilt(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` rebuilt from its keys, values and lengths (one call in a traced graph)."""
    return KeyedJaggedTensor.from_lengths_sync(features.keys(), features.values(), features.lengths())


class TestModelWithPreproc(_PreprocModel):
    """``postproc_module`` (ModelInput -> ModelInput) on the input, if given, then the selectors, ``ebc`` on
    feature_0..2 and ``weighted_ebc`` on weighted_feature_0.

    forward(ModelInput) -> (pred.sum(), pred [B, sum of the two collections' dims]). ``run_postproc_inline`` (with no
    ``postproc_module``): the input's idlist_features are rebuilt in place from keys, values and lengths first (as
    TorchRec, this replaces the caller's ``input.idlist_features``). ``dense`` is held but unused.
    """

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig], device: torch.device,
                 postproc_module: Optional[nn.Module] = None, num_float_features: int = 10,
                 run_postproc_inline: bool = False) -> None:
        super().__init__(tables, weighted_tables, device, num_float_features)
        self._postproc_module = postproc_module
        self._run_postproc_inline = run_postproc_inline

    def forward(self, input: "ModelInput") -> Tuple[torch.Tensor, torch.Tensor]:
        if self._postproc_module is not None:
            input = self._postproc_module(input)
        elif self._run_postproc_inline:
            input.idlist_features = _rebuilt(input.idlist_features)
        return self._lookup(input)


class TestModelWithPreprocCollectionArgs(_PreprocModel):
    """Nested preproc modules with collection arguments: ``postproc_module_outer(input)`` gives a value that
    ``postproc_module_nested(input, [1, input.float_features, outer], {CONST_DICT_KEY: 1, INPUT_TENSOR_DICT_KEY:
    input.float_features, POSTPTOC_TENSOR_DICT_KEY: outer})`` takes (and returns a ModelInput); then as
    TestModelWithPreproc: forward(ModelInput) -> (pred.sum(), pred [B, sum of dims])."""

    CONST_DICT_KEY = "const"
    INPUT_TENSOR_DICT_KEY = "tensor_from_input"
    POSTPTOC_TENSOR_DICT_KEY = "tensor_from_postproc"  # TorchRec's spelling

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig], device: torch.device,
                 postproc_module_outer: nn.Module, postproc_module_nested: nn.Module, num_float_features: int = 10) -> None:
        super().__init__(tables, weighted_tables, device, num_float_features)
        self._postproc_module_outer = postproc_module_outer
        self._postproc_module_nested = postproc_module_nested

    def forward(self, input: "ModelInput") -> Tuple[torch.Tensor, torch.Tensor]:
        outer = self._postproc_module_outer(input)
        as_list = [1, input.float_features, outer]
        as_dict = {self.CONST_DICT_KEY: 1, self.INPUT_TENSOR_DICT_KEY: input.float_features, self.POSTPTOC_TENSOR_DICT_KEY: outer}
        return self._lookup(self._postproc_module_nested(input, as_list, as_dict))


class TestNegSamplingModule(nn.Module):
    """A feature-augmenting preproc module (as negative sampling would be): ModelInput -> a copy with
    ``extra_input`` appended: float_features and label along the batch ([B + E, F], [B + E]), the KJTs key-wise
    (``KeyedJaggedTensor.concat``: the extra features join as more keys of the same batch size). Holds the buffer
    ``test_buffer`` [1] (zeros) and, with ``has_params``, an unused ``_linear`` (Linear(30, 30))."""

    TEST_BUFFER_NAME = "test_buffer"

    def __init__(self, extra_input: "ModelInput", has_params: bool = False) -> None:
        super().__init__()
        self._extra_input = extra_input
        self.register_buffer(self.TEST_BUFFER_NAME, torch.zeros(1))
        if has_params:
            self._linear: nn.Module = nn.Linear(30, 30)

    def forward(self, input: "ModelInput") -> "ModelInput":
        extra = self._extra_input
        for what, kjt in (("input", input.idlist_features), ("extra_input", extra.idlist_features)):
            if not isinstance(kjt, KeyedJaggedTensor):
                raise ValueError(f"TestNegSamplingModule: the {what}'s idlist_features must be a KeyedJaggedTensor, got {type(kjt).__name__}")
        out = copy.deepcopy(input)
        out.float_features = torch.concat((out.float_features, extra.float_features), dim=0)
        out.idlist_features = KeyedJaggedTensor.concat([out.idlist_features, extra.idlist_features])
        if extra.idscore_features is not None:
            if out.idscore_features is None:
                raise ValueError("TestNegSamplingModule: extra_input has idscore_features, the input has none")
            out.idscore_features = KeyedJaggedTensor.concat([out.idscore_features, extra.idscore_features])
        out.label = torch.concat((out.label, extra.label), dim=0)
        return out


class TestPositionWeightedPreprocModule(nn.Module):
    """ModelInput -> a copy whose idlist_features went through a PositionWeightedProcessor (``fp_proc``): the
    features named in ``max_feature_lengths`` get weights ``position_weights[f][position in bag]``."""

    def __init__(self, max_feature_lengths: Dict[str, int], device: torch.device) -> None:
        super().__init__()
        self.fp_proc = PositionWeightedProcessor(max_feature_lengths=max_feature_lengths, device=device)

    def forward(self, input: "ModelInput") -> "ModelInput":
        out = copy.deepcopy(input)
        out.idlist_features = self.fp_proc(out.idlist_features)
        return out


# --- managed collisions -----------------------------------------------------------------------------------------------


def _mc_modules(tables: Sequence[EmbeddingBagConfig], device: torch.device, zch_kwargs: Dict[str, Any]) -> Dict[str, ManagedCollisionModule]:
    """One managed-collision module per table, from ``zch_kwargs[table.name]`` (an object with ``mc_type`` and
    ``input_hash_size``, as TorchRec's ManagedCollisionConfig): "sort-zch" is an MCHManagedCollisionModule with
    DistanceLFU eviction every 1000 calls."""
    modules: Dict[str, ManagedCollisionModule] = {}
    for table in tables:
        if table.name not in zch_kwargs:
            raise ValueError(f"TestEBCSparseArchZCH: zch_kwargs has no entry for table {table.name!r} (has {sorted(zch_kwargs)})")
        config = zch_kwargs[table.name]
        if config.mc_type == "mp-zch":
            raise NotImplementedError("TestEBCSparseArchZCH: mc_type 'mp-zch' (HashZchManagedCollisionModule) is not in recship: "
                                      "fbgemm-gpu-cpu's zero_collision_hash only looks ids up (readonly) on CPU; use 'sort-zch'")
        if config.mc_type != "sort-zch":
            raise ValueError(f"Unknown mc_type in zch_kwargs: {config.mc_type}")
        # TorchRec's interval: a short one evicts between the forward and a semi-sync pipeline's backward
        modules[table.name] = MCHManagedCollisionModule(zch_size=table.num_embeddings, input_hash_size=config.input_hash_size,
                                                        device=device, eviction_interval=1000,
                                                        eviction_policy=DistanceLFU_EvictionPolicy())
    return modules


def _mc_ebc(tables: List[EmbeddingBagConfig], device: torch.device, zch_kwargs: Dict[str, Any], is_weighted: bool,
            return_remapped: bool) -> ManagedCollisionEmbeddingBagCollection:
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, device=device, is_weighted=is_weighted),
        ManagedCollisionCollection(managed_collision_modules=_mc_modules(tables, device, zch_kwargs), embedding_configs=tables),
        return_remapped_features=return_remapped)


class TestEBCSparseArchZCH(nn.Module):
    """TestEBCSparseArch with managed collisions: raw ids remapped per table (``zch_kwargs``, see ``_mc_modules``),
    then pooled: ``ebc`` (and ``weighted_ebc`` when there are weighted tables) are
    ManagedCollisionEmbeddingBagCollections.

    forward(features KJT, weighted_features KJT or None, batch_size) -> KeyedTensor [B, sum of dims] (the unweighted
    features then the weighted ones, each padded to ``batch_size`` rows). Training calls update the remapping.
    """

    def __init__(self, tables: List[EmbeddingBagConfig], weighted_tables: List[EmbeddingBagConfig], device: torch.device,
                 zch_kwargs: Dict[str, Any], return_remapped: bool = False) -> None:
        super().__init__()
        self._return_remapped = return_remapped
        self.ebc: ManagedCollisionEmbeddingBagCollection = _mc_ebc(tables, device, zch_kwargs, False, return_remapped)
        self.weighted_ebc: Optional[ManagedCollisionEmbeddingBagCollection] = (
            _mc_ebc(weighted_tables, device, zch_kwargs, True, return_remapped) if weighted_tables else None)

    def forward(self, features: KeyedJaggedTensor, weighted_features: Optional[KeyedJaggedTensor] = None,
                batch_size: Optional[int] = None) -> KeyedTensor:
        ebc, _ = self.ebc(features)
        w_ebc: Optional[KeyedTensor] = None
        if self.weighted_ebc is not None and weighted_features is not None:  # TorchRec fails unpacking None without them
            w_ebc = cast(KeyedTensor, self.weighted_ebc(weighted_features)[0])
        return _post_sparsenn_forward(cast(KeyedTensor, ebc), None, w_ebc, batch_size)


# --- the mixed pooled (EBC) and sequence (EC) model ----------------------------------------------------------------


def _mixed_in_features(ebc_tables: Tables, ec_tables: Tables, weighted_tables: Tables, max_sequence_length: Optional[int],
                       dense_arch_out_size: Optional[int]) -> int:
    """The dense arch's width, the pooled tables' dims, and each sequence feature's dim times its padded length."""
    length = MAX_SEQUENCE_LENGTH if max_sequence_length is None else max_sequence_length
    dense = DENSE_LAYER_OUT_SIZE if dense_arch_out_size is None else dense_arch_out_size
    return dense + _tables_dim_sum(ebc_tables) + _tables_dim_sum(ec_tables, length) + _tables_dim_sum(weighted_tables)


class TestMixedSequenceOverArch(nn.Module):
    """The mixed model's over arch: dense [B, 8] and sparse [B, pooled dims + sequence dims * 20] concatenated, through
    one Linear (``linear``) -> [B, over_arch_out_size (16)]."""

    def __init__(self, ebc_tables: List[EmbeddingBagConfig], ec_tables: List[EmbeddingConfig],
                 weighted_tables: List[EmbeddingBagConfig], device: Optional[torch.device] = None,
                 max_sequence_length: Optional[int] = None, dense_arch_out_size: Optional[int] = None,
                 over_arch_out_size: Optional[int] = None) -> None:
        super().__init__()
        in_features = _mixed_in_features(ebc_tables, ec_tables, weighted_tables, max_sequence_length, dense_arch_out_size)
        out = OVER_ARCH_OUT_SIZE if over_arch_out_size is None else over_arch_out_size
        self.linear = nn.Linear(in_features=in_features, out_features=out, device=device or torch.device("cpu"))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, sparse], dim=1))


class TestMixedSequenceOverArchLargeActivation(nn.Module):
    """The mixed model's over arch with wide activations (``overarch``, a Sequential): Linear(in -> H) +
    SwishLayerNorm, ``over_arch_hidden_layers`` (5) x [Linear(H -> H) + SwishLayerNorm], Linear(H -> 16), with
    H = ``large_activation_dim`` (4096: ~100M parameters; pass a small one in tests). [B, in] -> [B, 16]."""

    def __init__(self, ebc_tables: List[EmbeddingBagConfig], ec_tables: List[EmbeddingConfig],
                 weighted_tables: List[EmbeddingBagConfig], device: Optional[torch.device] = None,
                 max_sequence_length: Optional[int] = None, dense_arch_out_size: Optional[int] = None,
                 over_arch_out_size: Optional[int] = None, over_arch_hidden_layers: Optional[int] = None,
                 large_activation_dim: int = 4096) -> None:
        super().__init__()
        if large_activation_dim <= 0:
            raise ValueError(f"TestMixedSequenceOverArchLargeActivation: large_activation_dim must be > 0, got {large_activation_dim}")
        device = device or torch.device("cpu")
        hidden = large_activation_dim
        in_features = _mixed_in_features(ebc_tables, ec_tables, weighted_tables, max_sequence_length, dense_arch_out_size)
        layers: List[nn.Module] = [nn.Linear(in_features, hidden, device=device), SwishLayerNorm(hidden, device=device)]
        for _ in range(5 if over_arch_hidden_layers is None else over_arch_hidden_layers):
            layers += [nn.Linear(hidden, hidden, device=device), SwishLayerNorm(hidden, device=device)]
        layers.append(nn.Linear(hidden, OVER_ARCH_OUT_SIZE if over_arch_out_size is None else over_arch_out_size, device=device))
        self.overarch = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.overarch(torch.cat([dense, sparse], dim=1))


class TestMixedEmbeddingSparseArch(TestSparseNNBase, CopyableMixin):
    """A model over both pooled tables (EmbeddingBagConfigs: ``ebc``) and sequence tables (EmbeddingConfigs: ``ec``),
    ``dense`` (TestDenseArch) and ``over`` (``over_arch_clazz(ebc_tables, ec_tables, [], device, **over_arch_kwargs)``).

    sparse_forward(ModelInput) -> [B, pooled dims + sequence features * 20 * dim]: each sequence feature's embeddings
    padded (or cut) to 20 per example and flattened. forward -> in training mode (BCE-with-logits of pred against the
    label, pred [B]), in eval mode pred = sigmoid(mean of the over arch's output) + 1 (``dummy_ones``).
    ``weighted_tables`` and ``feature_processor_modules`` are accepted and unused, as in TorchRec;
    ``enable_activation_stashing`` (CUDA-stream stashing) is refused.
    """

    dummy_ones: torch.Tensor  # buffer [1]

    def __init__(self, tables: Union[List[EmbeddingBagConfig], List[EmbeddingConfig]], num_float_features: int = 10,
                 weighted_tables: Optional[List[EmbeddingBagConfig]] = None, embedding_groups: Optional[Dict[str, List[str]]] = None,
                 dense_device: Optional[torch.device] = None, sparse_device: Optional[torch.device] = None,
                 feature_processor_modules: Optional[Dict[str, torch.nn.Module]] = None,
                 over_arch_clazz: Type[nn.Module] = TestMixedSequenceOverArch, device: Optional[torch.device] = None,
                 enable_activation_stashing: bool = False, dense_arch_hidden_sizes: Optional[List[int]] = None,
                 over_arch_kwargs: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(tables=cast(List[BaseEmbeddingConfig], tables),
                         weighted_tables=cast(Optional[List[BaseEmbeddingConfig]], weighted_tables or []),
                         embedding_groups=embedding_groups, dense_device=dense_device, sparse_device=sparse_device)
        if enable_activation_stashing:
            raise ValueError("TestMixedEmbeddingSparseArch: enable_activation_stashing=True stashes activations on a CUDA "
                             "stream (TorchRec's MemoryStashingManager), which recship does not have")
        self._enable_activation_stashing = False
        device = device or torch.device("cpu")
        ebc_tables: List[EmbeddingBagConfig] = []
        ec_tables: List[EmbeddingConfig] = []
        for table in tables:
            if isinstance(table, EmbeddingBagConfig):
                ebc_tables.append(table)
            elif isinstance(table, EmbeddingConfig):
                ec_tables.append(table)
            else:
                raise ValueError(f"Unsupported table type: {type(table)}")
        self.ebc: Optional[EmbeddingBagCollection] = EmbeddingBagCollection(tables=ebc_tables, device=device) if ebc_tables else None
        self.ec: Optional[EmbeddingCollection] = None
        if ec_tables:
            self.ec = EmbeddingCollection(tables=ec_tables, device=device)
            self.ec_embedding_dim = self.ec.embedding_dim()
        self._ebc_features: List[str] = [f for t in ebc_tables for f in t.feature_names]
        self._ec_features: List[str] = [f for t in ec_tables for f in t.feature_names]
        embedding_names = list(embedding_groups.values())[0] if embedding_groups else None
        self._embedding_names: List[str] = embedding_names or [f for t in tables for f in t.feature_names]
        self.dense = TestDenseArch(num_float_features, device=dense_device, dense_arch_hidden_sizes=dense_arch_hidden_sizes)
        self.over: nn.Module = over_arch_clazz(ebc_tables, ec_tables, [], device, **(over_arch_kwargs or {}))
        self.register_buffer("dummy_ones", torch.ones(1, device=dense_device))

    def sparse_forward(self, input: "ModelInput") -> torch.Tensor:
        features = input.idlist_features
        ebc_embeddings = torch.empty(0)  # a 1-d empty tensor: torch.cat skips it
        ec_embeddings = torch.empty(0)
        if self.ebc is not None and self._ebc_features:
            ebc_embeddings = self.ebc(features).values()
        if self.ec is not None and self._ec_features:
            sequences = self.ec(features)
            ec_embeddings = torch.cat([
                torch.ops.fbgemm.jagged_2d_to_dense(values=sequences[f].values(), offsets=sequences[f].offsets(),
                                                    max_sequence_length=MAX_SEQUENCE_LENGTH
                                                    ).view(-1, MAX_SEQUENCE_LENGTH * self.ec_embedding_dim)
                for f in self._ec_features], dim=1)
        return torch.cat([ebc_embeddings, ec_embeddings], dim=1)

    def dense_forward(self, input: "ModelInput", sparse_output: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        over = self.over(self.dense(input.float_features), sparse_output)
        pred = torch.sigmoid(torch.mean(over, dim=1)) + self.dummy_ones
        if self.training:
            return nn.functional.binary_cross_entropy_with_logits(pred, input.label), pred
        return pred

    def forward(self, input: "ModelInput") -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        return self.dense_forward(input, self.sparse_forward(input))


__all__ = [
    "CopyableMixin", "DENSE_LAYER_OUT_SIZE", "OVER_ARCH_OUT_SIZE", "TestDenseArch", "TestEBCSparseArchZCH",
    "TestMixedEmbeddingSparseArch", "TestMixedSequenceOverArch", "TestMixedSequenceOverArchLargeActivation",
    "TestModelWithPreproc", "TestModelWithPreprocCollectionArgs", "TestNegSamplingModule", "TestPositionWeightedPreprocModule",
    "TestPreprocNonWeighted", "TestPreprocWeighted", "TestSparseNNBase",
]
