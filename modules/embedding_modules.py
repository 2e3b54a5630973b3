# mypy: disable-error-code="arg-type"
# (forward is TorchScript: it reads "# type:" comments, so the ModuleDict values cannot be narrowed per line)
"""Float, unsharded embedding modules: EmbeddingBagCollection and EmbeddingCollection.

They are the reference semantics for every other implementation in recship
(sharded training, quantized inference): same inputs (a KeyedJaggedTensor),
same outputs, same state-dict keys as TorchRec (``embedding_bags.<table>.weight``,
``embeddings.<table>.weight``), so TorchRec checkpoints map by name.

Built with ``device="meta"``, they allocate nothing; ``materialize(module,
device)`` allocates and initialises every parameter afterwards.
"""

import abc
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.sparse.ids import check_id_dtype, first_out_of_range, out_of_range_message
from recship.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from recship.modules.types import PoolingType


def _check_tables(tables: Sequence[BaseEmbeddingConfig], kind: type, allow_empty: bool = False) -> None:
    """``allow_empty``: an EmbeddingBagCollection of no tables is legal (TorchRec's; it pools to [B, 0])."""
    if len(tables) == 0 and not allow_empty:
        raise ValueError("an embedding collection needs at least one table")
    names = set()
    for t in tables:
        if not isinstance(t, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(t).__name__} for table {t.name!r}")
        if t.name in names:
            raise ValueError(f"duplicate table name {t.name!r}")
        names.add(t.name)
        if not t.data_type.is_float:
            raise ValueError(
                f"table {t.name!r} has data_type {t.data_type.name}; float modules hold "
                "FP32/FP16/BF16 weights (quantized tables come from recship.quantize)"
            )


def rows_per_feature(tables: Sequence[BaseEmbeddingConfig]) -> Dict[str, int]:
    """{feature: the rows its ids must stay under}: its table's rows; for a feature several tables look up (a shared
    feature, TorchRec's ``feature@table`` outputs), the smallest of them, since each of its ids indexes every one."""
    rows: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def check_features(features: KeyedJaggedTensor, rows_per_feature: Dict[str, int]) -> None:
    """Eager input check of the modules that take one batch size (EmbeddingCollection, the sharded collections): no
    variable batch, every needed feature present, every id inside its table."""
    if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
        raise ValueError(
            "a variable-batch KeyedJaggedTensor (stride_per_key_per_rank / inverse_indices) is taken by the unsharded "
            "EmbeddingBagCollection only: recship's EmbeddingCollection and sharded collections exchange one batch size "
            "per rank (expand the batch first, e.g. by the inverse indices)"
        )
    _check_present(features, rows_per_feature)
    message = _out_of_range(features, rows_per_feature)
    if message is not None:
        raise ValueError(message)


def _check_present(features: KeyedJaggedTensor, rows_per_feature: Dict[str, int]) -> None:
    """Every needed feature present and the values integer ids (a KJT itself takes any dtype)."""
    check_id_dtype(features.values(), "input KeyedJaggedTensor")
    keys = features.keys()
    missing = [f for f in rows_per_feature if f not in keys]
    if missing:
        raise ValueError(f"input KeyedJaggedTensor lacks features {missing}; it has {keys}")


def _out_of_range(features: KeyedJaggedTensor, rows_per_feature: Dict[str, int]) -> Optional[str]:
    """The id rule's message for the first feature (in key order) with an id outside its
    table, or None; ids on other devices than the CPU are not read (no synchronisation)."""
    values = features.values()
    if values.device.type != "cpu" or values.numel() == 0:
        return None
    if len(rows_per_feature) > 0:
        # one pass settles the usual case: every id of every feature inside the smallest table
        lowest, highest = torch.aminmax(values)
        if int(lowest) >= 0 and int(highest) < min(rows_per_feature.values()):
            return None
    for name, jt in features.to_dict().items():
        rows = rows_per_feature.get(name)
        bad = None if rows is None else first_out_of_range(jt.values(), rows)
        if bad is not None:
            return out_of_range_message(name, bad, rows)
    return None


@torch.fx.wrap
def _bag_inputs(
    features: KeyedJaggedTensor, names: List[str], weighted: bool, with_lengths: bool, variable_batch: bool
) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """Per feature of ``names``, in that order: (ids [n_f], offsets [B_f + 1] in the ids' dtype,
    lengths [B_f] or nothing unless ``with_lengths``, per-id weights [n_f] or nothing unless
    ``weighted``); B_f is the batch size (of a variable-batch KJT: that feature's).

    A traced module (``variable_batch`` False: fx cannot follow the expansion) refuses a
    variable-batch KJT rather than return unexpanded rows.

    The tensors ``features.to_dict()`` would give each feature, from the KJT's cached
    ``split_by_key()`` (one split of the values and one cumsum over the [F, B] lengths
    for all keys) instead of a checked JaggedTensor per key. A repeated key resolves to
    its last occurrence, as in ``to_dict``. fx records this as one call, so tracing does
    not depend on the input's keys.
    """
    if not variable_batch and (features.variable_stride_per_key() or features.inverse_indices_or_none() is not None):
        raise ValueError(
            "a traced EmbeddingBagCollection takes KeyedJaggedTensors of one batch size: variable batch "
            "(stride_per_key_per_rank / inverse_indices) is expanded by the eager or scripted module only"
        )
    values = features.values()
    split = features.split_by_key()
    per_key_ids, per_key_offsets = split[0], split[1]
    per_key_lengths: List[torch.Tensor] = []
    if with_lengths:
        per_key_lengths = features._per_key_lengths()
    per_key_weights: List[torch.Tensor] = []
    if weighted:
        per_key_weights = list(torch.split(features.weights(), features.length_per_key()))
    # nn.EmbeddingBag takes ids and offsets of one dtype; the offsets come in the lengths'
    convert = len(per_key_offsets) > 0 and per_key_offsets[0].dtype != values.dtype
    index = features.index_per_key()
    ids: List[torch.Tensor] = []
    offsets: List[torch.Tensor] = []
    per_feature_lengths: List[torch.Tensor] = []
    weights: List[torch.Tensor] = []
    for name in names:
        k = index[name]
        ids.append(per_key_ids[k])
        offsets.append(per_key_offsets[k].to(values.dtype) if convert else per_key_offsets[k])
        if with_lengths:
            per_feature_lengths.append(per_key_lengths[k])
        if weighted:
            weights.append(per_key_weights[k])
    return ids, offsets, per_feature_lengths, weights


class EmbeddingBagCollectionInterface(abc.ABC, nn.Module):
    """What a pooled collection offers (TorchRec's interface; EmbeddingBagCollection implements it):
    ``forward(KJT) -> KeyedTensor``, ``embedding_bag_configs()``, ``is_weighted()``."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor: ...

    @abc.abstractmethod
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]: ...

    @abc.abstractmethod
    def is_weighted(self) -> bool: ...


class EmbeddingCollectionInterface(abc.ABC, nn.Module):
    """What an unpooled collection offers (TorchRec's interface; EmbeddingCollection implements it):
    ``forward(KJT) -> Dict[str, JaggedTensor]``, ``embedding_configs()``, ``need_indices()``, ``embedding_dim()``,
    ``embedding_names_by_table()``."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]: ...

    @abc.abstractmethod
    def embedding_configs(self) -> List[EmbeddingConfig]: ...

    @abc.abstractmethod
    def need_indices(self) -> bool: ...

    @abc.abstractmethod
    def embedding_dim(self) -> int: ...

    @abc.abstractmethod
    def embedding_names_by_table(self) -> List[List[str]]: ...


def get_embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> List[List[str]]:
    """Each table's output names, as TorchRec names them: a feature's name, or ``feature@table`` for a feature that
    several tables look up."""
    count: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]


def reorder_inverse_indices(inverse_indices: Optional[Tuple[List[str], torch.Tensor]],
                            feature_names: List[str]) -> torch.Tensor:
    """The rows of a variable-batch KJT's inverse indices ([F', B]) in the order of ``feature_names`` (a
    ``feature@table`` name takes its feature's row) -> [len(feature_names), B]; an empty tensor without them.
    ValueError for a feature the inverse indices do not name."""
    if inverse_indices is None:
        return torch.empty(0)
    row_of = {name: i for i, name in enumerate(inverse_indices[0])}
    missing = [n for n in feature_names if n.split("@")[0] not in row_of]
    if missing:
        raise ValueError(f"reorder_inverse_indices: the inverse indices have no row for {missing} (they name {inverse_indices[0]})")
    index = torch.tensor([row_of[n.split("@")[0]] for n in feature_names], device=inverse_indices[1].device)
    return torch.index_select(inverse_indices[1], 0, index)


@torch.fx.wrap
def process_pooled_embeddings(pooled_embeddings: List[torch.Tensor], inverse_indices: torch.Tensor) -> torch.Tensor:
    """Each feature's pooled rows [B_j, D_j] expanded to the full batch by its row of ``inverse_indices`` ([F, B],
    fbgemm's ``group_index_select_dim0``; empty: as they are), concatenated: [B, sum D_j]."""
    if inverse_indices.numel() > 0:
        pooled_embeddings = torch.ops.fbgemm.group_index_select_dim0(pooled_embeddings, list(torch.unbind(inverse_indices)))
    return torch.cat(pooled_embeddings, dim=1)


class EmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """Pooled embedding lookups for several tables: KJT in, KeyedTensor out.

    Args:
        tables: one EmbeddingBagConfig per table.
        is_weighted: use the KJT's weights as per-id scores (id-score-list
            features). MEAN pooling then divides the weighted sum by the number
            of ids, as fbgemm's kernels do.
        device: where to allocate; "meta" allocates nothing.

    forward(features) -> KeyedTensor whose keys are the feature names (table by
    table, in config order; ``feature@table`` for a feature several tables look up, as
    TorchRec's) and whose values are [B, sum of their dims] float32.
    """

    __jit_unused_properties__ = ["device"]
    _feature_names: List[List[str]]
    _divide_by_length: List[bool]
    _embedding_names: List[str]
    _lookup_names: List[str]
    _lengths_per_embedding: List[int]

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingBagConfig, allow_empty=True)
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        self._feature_names = []
        self._divide_by_length = []
        self._embedding_names = [name for names in get_embedding_names_by_table(tables) for name in names]
        self._lookup_names = []
        self._lengths_per_embedding = []
        for t in tables:
            mean = t.pooling == PoolingType.MEAN
            # nn.EmbeddingBag accepts per-sample weights only in "sum" mode, so a
            # weighted MEAN table sums and divides by the bag length in forward.
            mode = "mean" if mean and not is_weighted else "sum"
            self.embedding_bags[t.name] = nn.EmbeddingBag(
                t.num_embeddings,
                t.embedding_dim,
                mode=mode,
                include_last_offset=True,
                _weight=_meta_weight(t, device),
                device=device,
                dtype=t.data_type.to_torch_dtype(),
            )
            self._feature_names.append(list(t.feature_names))
            self._divide_by_length.append(mean and is_weighted)
            self._lookup_names.extend(t.feature_names)
            self._lengths_per_embedding.extend([t.embedding_dim] * len(t.feature_names))
        self._any_divide_by_length = any(self._divide_by_length)
        self._rows_per_feature = rows_per_feature(tables)
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: [F, B] ids; or variable batch (``stride_per_key_per_rank``) with ``inverse_indices``
        [F', B]: each feature's pooled rows [B_f, D] are expanded to [B, D] by its row of them, as TorchRec."""
        if torch.jit.is_scripting():
            return self._pool(features, True)
        else:
            if isinstance(features, torch.fx.Proxy):
                return self._pool(features, False)
            return self._pool_checked(features)

    @torch.jit.unused
    def _pool_checked(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Eager forward with the id rule's ValueError for a bad id.

        nn.EmbeddingBag's CPU kernels bounds-check every id themselves (RuntimeError, any
        dtype and mode: tests/trainer/test_ebc_lookup.py), so the ids are read a
        second time only when a kernel fails, to name the feature, id and table size.
        """
        _check_present(features, self._rows_per_feature)
        try:
            return self._pool(features, True)
        except RuntimeError:
            message = _out_of_range(features, self._rows_per_feature)
            if message is None:
                raise
        raise ValueError(message)

    def _pool(self, features: KeyedJaggedTensor, variable_batch: bool) -> KeyedTensor:
        inputs = _bag_inputs(features, self._lookup_names, self._is_weighted, self._any_divide_by_length, variable_batch)
        ids, offsets, lengths, weights = inputs[0], inputs[1], inputs[2], inputs[3]
        pooled: List[torch.Tensor] = []
        i = 0
        j = 0  # position in self._embedding_names: the j-th feature looked up
        for bag in self.embedding_bags.values():
            for _ in self._feature_names[i]:
                per_sample_weights: Optional[torch.Tensor] = None
                if self._is_weighted:
                    per_sample_weights = weights[j].to(bag.weight.dtype)
                out = bag(ids[j], offsets[j], per_sample_weights=per_sample_weights)
                if self._divide_by_length[i]:
                    out = out / lengths[j].clamp(min=1).unsqueeze(1).to(out.dtype)
                pooled.append(out.float())
                j += 1
            i += 1
        if variable_batch:
            inverse_indices = features.inverse_indices_or_none()
            if inverse_indices is not None:
                pooled = _expand(pooled, self._lookup_names, inverse_indices)
            elif features.variable_stride_per_key():
                _check_one_batch(pooled, self._lookup_names)
        if len(pooled) == 0:  # no tables: [B, 0]
            values = torch.empty(features.stride(), 0, device=features.device())
        else:
            values = torch.cat(pooled, dim=1)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
            key_dim=1,
        )

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        """Where the tables are (TorchRec's: the constructor's ``device``, which they are on until moved)."""
        return _tables_device(self.embedding_bags)

    def reset_parameters(self) -> None:
        """(Re)initialises every table as its config says."""
        for t in self._embedding_bag_configs:
            t.init_weight(self.embedding_bags[t.name].weight)


class EmbeddingCollection(EmbeddingCollectionInterface):
    """Unpooled embedding lookups: KJT in, {feature (``feature@table`` if shared): JaggedTensor of [N, dim] rows} out.

    Args:
        tables: one EmbeddingConfig per table.
        device: where to allocate; "meta" allocates nothing.
        need_indices: each output JaggedTensor carries its ids as ``weights`` ([N] int, the input's values), as
            TorchRec's.
        use_gather_select / use_gather_select_per_sharding: TorchRec's choice of ``torch.gather`` over
            ``index_select`` (overall, or per sharding type) where sharded lookups expand deduplicated rows; both
            pick the same rows, so the outputs do not depend on it. Kept and reported by the methods of the same
            names.
    """

    __jit_unused_properties__ = ["device"]
    _feature_names: List[List[str]]
    _embedding_names_by_table: List[List[str]]

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[Union[str, torch.device]] = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: Optional[Dict[str, bool]] = None,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingConfig)
        for name, flag in (("need_indices", need_indices), ("use_gather_select", use_gather_select)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self._need_indices = need_indices
        self._use_gather_select = use_gather_select
        self._use_gather_select_per_sharding = (None if use_gather_select_per_sharding is None
                                                else dict(use_gather_select_per_sharding))
        self._embedding_configs = list(tables)
        self.embeddings = nn.ModuleDict()
        self._feature_names = []
        for t in tables:
            self.embeddings[t.name] = nn.Embedding(
                t.num_embeddings,
                t.embedding_dim,
                _weight=_meta_weight(t, device),
                device=device,
                dtype=t.data_type.to_torch_dtype(),
            )
            if torch.device(device or "cpu").type != "meta":  # each table right after its nn.Embedding's own draw, as
                t.init_weight(self.embeddings[t.name].weight)  # TorchRec: a seed gives TorchRec's tables
            self._feature_names.append(list(t.feature_names))
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._rows_per_feature = rows_per_feature(tables)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if torch.jit.is_scripting():
            pass
        elif not isinstance(features, torch.fx.Proxy):
            check_features(features, self._rows_per_feature)
        feature_dict = features.to_dict()
        out: Dict[str, JaggedTensor] = {}
        i = 0
        for table in self.embeddings.values():
            names = self._feature_names[i]
            for j in range(len(names)):
                f = feature_dict[names[j]]
                out[self._embedding_names_by_table[i][j]] = JaggedTensor(
                    values=table(f.values()).float(),
                    weights=f.values() if self._need_indices else None,
                    lengths=f.lengths(),
                    offsets=f.offsets(),
                )
            i += 1
        return out

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def need_indices(self) -> bool:
        """Whether the outputs carry their ids as weights."""
        return self._need_indices

    def use_gather_select(self) -> bool:
        """The constructor's ``use_gather_select``."""
        return self._use_gather_select

    def use_gather_select_per_sharding(self) -> Optional[Dict[str, bool]]:
        """The constructor's ``use_gather_select_per_sharding`` (a sharding type's entry overrides
        ``use_gather_select``)."""
        return self._use_gather_select_per_sharding

    @property
    def device(self) -> torch.device:
        """Where the tables are (TorchRec's: the constructor's ``device``, which they are on until moved)."""
        return _tables_device(self.embeddings)

    def embedding_dim(self) -> int:
        """The tables' common width (TorchRec's EmbeddingCollection requires one); ValueError if they differ."""
        dims = {t.embedding_dim for t in self._embedding_configs}
        if len(dims) != 1:
            raise ValueError(f"the tables' widths differ ({sorted(dims)}): an EmbeddingCollection has no one embedding_dim")
        return dims.pop()

    def embedding_names_by_table(self) -> List[List[str]]:
        """Each table's output names, in table order: its features' names, ``feature@table`` for a feature several
        tables look up (TorchRec's)."""
        return [list(names) for names in self._embedding_names_by_table]

    def reset_parameters(self) -> None:
        for t in self._embedding_configs:
            t.init_weight(self.embeddings[t.name].weight)


def _expand(pooled: List[torch.Tensor], names: List[str], inverse_indices: Tuple[List[str], torch.Tensor]) -> List[torch.Tensor]:
    """Feature j's [B_j, D] rows picked by its row of the inverse indices [F', B]: [B, D] each."""
    row_of: Dict[str, int] = {}
    for r, name in enumerate(inverse_indices[0]):
        row_of[name] = r
    out: List[torch.Tensor] = []
    for j, name in enumerate(names):
        if name not in row_of:
            raise ValueError(f"the KeyedJaggedTensor's inverse_indices have no row for feature '{name}' (they name {inverse_indices[0]})")
        rows = inverse_indices[1][row_of[name]]
        if rows.numel() > 0:
            lowest, highest = int(rows.min()), int(rows.max())  # index_select's own error would not name the feature
            if lowest < 0 or highest >= pooled[j].shape[0]:
                raise ValueError(f"inverse_indices of feature '{name}' pick rows {lowest}..{highest} of its "
                                 f"{pooled[j].shape[0]} examples")
        out.append(pooled[j].index_select(0, rows.to(torch.int64)))
    return out


def _check_one_batch(pooled: List[torch.Tensor], names: List[str]) -> None:
    """Without inverse indices, the features of a variable-batch KJT must still share one batch size (TorchRec
    concatenates them as they are)."""
    for j in range(len(pooled)):
        if pooled[j].shape[0] != pooled[0].shape[0]:
            raise ValueError(f"a variable-batch KeyedJaggedTensor without inverse_indices: feature '{names[j]}' has "
                             f"{pooled[j].shape[0]} examples, '{names[0]}' {pooled[0].shape[0]}; give inverse_indices to "
                             "expand them to one batch")


def _tables_device(tables: nn.ModuleDict) -> torch.device:
    weight = next(iter(tables.values())).weight
    assert isinstance(weight, torch.Tensor)
    return weight.device


def _meta_weight(t: BaseEmbeddingConfig, device: Optional[Union[str, torch.device]]) -> Optional[torch.Tensor]:
    """On meta, the table's weight handed to nn.EmbeddingBag/nn.Embedding so that they skip their own
    init: torch's normal_ on meta costs ~1.5 s the first time (it loads its Python decompositions)."""
    if torch.device(device or "cpu").type != "meta":
        return None  # allocated by the module; reset_parameters then applies the config's init
    return torch.empty(t.num_embeddings, t.embedding_dim, device="meta", dtype=t.data_type.to_torch_dtype())


def materialize(module: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Allocates a meta-device module on ``device`` and initialises it; returns it.

    Embedding collections initialise their tables from their configs; any other
    submodule with a ``reset_parameters`` (nn.Linear, ...) uses its own.
    """
    module.to_empty(device=device)
    collections = (EmbeddingBagCollection, EmbeddingCollection)
    inside_collection: List[str] = []
    with torch.no_grad():
        for name, sub in module.named_modules():
            if any(prefix == "" or name.startswith(prefix + ".") for prefix in inside_collection):
                continue  # an nn.EmbeddingBag's own reset would override the config's init
            if isinstance(sub, collections):
                inside_collection.append(name)
                sub.reset_parameters()
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
    return module
