"""Feature processors and the FeatureProcessedEmbeddingBagCollection (TorchRec's
``torchrec.modules.feature_processor_`` and ``torchrec.modules.fp_embedding_modules``).

A feature processor turns a feature's ids into (ids, per-id weights) before a weighted
EmbeddingBagCollection pools them. The one TorchRec ships, position weighting, learns one
weight per position in a bag: id j of an example's bag (j = 0, 1, ...) is scaled by
``position_weight[j]``, so the pooled embedding is ``sum_j position_weight[j] * table[id_j]``.

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8,
                                 num_embeddings=100, feature_names=["history"])], is_weighted=True)
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"history": 20}))
    fp_ebc(kjt)  # KeyedTensor ["history"]: [B, 8]

State-dict keys are TorchRec's: ``_embedding_bag_collection.embedding_bags.<table>.weight`` and
``_feature_processors.position_weights.<feature>`` (a PositionWeightedModuleCollection) or
``_feature_processors.<feature>.position_weight`` (a dict of PositionWeightedModules).

Positions are computed in plain torch (``bag_positions``), not with fbgemm's ``offsets_range``
(same numbers), so a traced model needs no fbgemm op beyond its lookups. The position weights
are dense parameters: under DistributedModelParallel the collection's tables are sharded as
any EmbeddingBagCollection's and the position weights train with the dense optimizer.
"""

import abc
from typing import Dict, List, Mapping, Optional, Set, Tuple, Union

import torch
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_modules import EmbeddingBagCollection

__all__ = [
    "CopyMixIn", "EmbeddingBagCollection", "FeatureProcessedEmbeddingBagCollection", "FeatureProcessor",
    "FeatureProcessorDictWrapper", "FeatureProcessorsCollection", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor",
    "PositionWeightedModule", "PositionWeightedModuleCollection", "apply_feature_processors_to_kjt", "bag_positions",
    "get_stride_per_key_per_rank", "get_weights_list", "is_non_strict_exporting",
]


class CopyMixIn:
    """TorchRec's ``torchrec.types.CopyMixIn``: a module that moves itself with ``copy(device)``."""

    @abc.abstractmethod
    def copy(self, device: torch.device) -> nn.Module: ...


def is_non_strict_exporting() -> bool:
    """True while ``torch.export`` traces in non-strict mode (TorchRec's ``torchrec.pt2.checks``)."""
    if torch.jit.is_scripting():
        return False
    return bool(torch.compiler.is_compiling()) and not torch.compiler.is_dynamo_compiling()


def bag_positions(offsets: torch.Tensor, num_values: int) -> torch.Tensor:
    """[N] int64: each value's position in its bag (0 for the first id of a bag), given offsets [B + 1].

    fbgemm's ``offsets_range`` in plain torch: value i lies in bag b with offsets[b] <= i < offsets[b + 1].
    """
    offsets = offsets.long()
    index = torch.arange(num_values, device=offsets.device, dtype=torch.int64)
    bag = torch.bucketize(index, offsets[1:], right=True)
    return index - offsets[bag]


class FeatureProcessor(nn.Module):
    """Abstract: one feature's JaggedTensor in, the same ids with ``weights`` filled out."""

    @abc.abstractmethod
    def forward(self, features: JaggedTensor) -> JaggedTensor:
        pass


class PositionWeightedModule(FeatureProcessor):
    """Weights each id of a bag by ``position_weight[its position in the bag]``.

    Args:
        max_feature_length: the longest bag (truncation size): ``position_weight`` is
            [max_feature_length] float32, initialised to 1. A longer bag fails at gather.
        device: where to allocate.
    """

    def __init__(self, max_feature_length: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        if max_feature_length <= 0:
            raise ValueError(f"PositionWeightedModule: max_feature_length must be positive, got {max_feature_length}")
        self.position_weight = nn.Parameter(torch.empty([max_feature_length], device=device), requires_grad=True)
        self._pre_processed = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        """features: one feature's ids [N] with lengths [B]; returns them with weights [N] float32."""
        if self._pre_processed:  # positions already in the weights (pre_process_input)
            seq = features.weights().clone().to(torch.int64)
        else:
            seq = bag_positions(features.offsets(), torch.numel(features.values()))
        return JaggedTensor(
            values=features.values(),
            lengths=features.lengths(),
            offsets=features.offsets(),
            weights=torch.gather(self.position_weight, dim=0, index=seq),
        )

    def pre_process_input(self, features: JaggedTensor) -> None:
        """Writes each id's position into ``features``' weights (in place); forward then reads them from there."""
        self._pre_processed = True
        features.weights().copy_(bag_positions(features.offsets(), torch.numel(features.values())).to(torch.float32))


class FeatureProcessorsCollection(nn.Module):
    """Abstract: a KeyedJaggedTensor in, the same ids with ``weights`` filled out for every key."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        pass


@torch.fx.wrap
def get_weights_list(
    cat_seq: torch.Tensor, features: KeyedJaggedTensor, position_weights: Dict[str, torch.Tensor]
) -> Optional[torch.Tensor]:
    """[N] weights of every id of ``features``: its key's position weight at its position (``cat_seq`` [N]),
    1 for keys without position weights."""
    weights_list: List[torch.Tensor] = []
    seqs = torch.split(cat_seq, features.length_per_key())
    for key, seq in zip(features.keys(), seqs):
        if key in position_weights.keys():
            weights_list.append(torch.gather(position_weights[key], dim=0, index=seq))
        else:
            weights_list.append(torch.ones(seq.shape[0], device=features.values().device))
    return torch.cat(weights_list) if len(weights_list) > 0 else features.weights_or_none()


@torch.fx.wrap
def get_stride_per_key_per_rank(kjt: KeyedJaggedTensor) -> Optional[List[List[int]]]:
    """The KJT's variable batch (``stride_per_key_per_rank``), or None for one batch size."""
    if not kjt.variable_stride_per_key():
        return None
    return kjt.stride_per_key_per_rank()


@torch.fx.wrap
def _position_weighted(features: KeyedJaggedTensor, position_weights: Dict[str, torch.Tensor], pre_processed: bool) -> KeyedJaggedTensor:
    """``features`` with every id weighted by its key's position weight (1 for other keys): one fx node."""
    if pre_processed:
        cat_seq = features.weights().clone().to(torch.int64)
    else:
        cat_seq = bag_positions(features.offsets(), torch.numel(features.values()))
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        weights=get_weights_list(cat_seq, features, position_weights),
        lengths=features.lengths(),
        offsets=features.offsets(),
        stride=features.stride(),
        length_per_key=features.length_per_key(),
        stride_per_key_per_rank=get_stride_per_key_per_rank(features),
        inverse_indices=features.inverse_indices_or_none(),  # (TorchRec drops them: its EBC then cannot expand a variable batch)
    )


class _PositionWeights(nn.ParameterDict):
    """The ParameterDict of position weights, with its own ``reset_parameters`` (all 1): DistributedModelParallel
    materialises a model built on meta module by module and resets the ones that hold meta tensors."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.values():
                p.fill_(1.0)


class PositionWeightedModuleCollection(FeatureProcessorsCollection, CopyMixIn):
    """Position weights for several features of a KeyedJaggedTensor.

    Args:
        max_feature_lengths: feature -> its longest bag; ``position_weights.<feature>`` is
            [length] float32, initialised to 1. Keys of the input without an entry get weight 1.
        device: where to allocate.

    Example: ``PositionWeightedModuleCollection({"f": 3})`` on f = [[7, 8], [9]] gives weights
    [w[0], w[1], w[0]].
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        bad = {k: v for k, v in self.max_feature_lengths.items() if v <= 0}
        if bad:
            raise ValueError(f"PositionWeightedModuleCollection: max_feature_lengths must be positive, got {bad}")
        self._pre_processed = False
        self.position_weights: nn.ParameterDict = _PositionWeights()
        # a plain dict beside the ParameterDict: TorchScript cannot index a ParameterDict by a variable key
        self.position_weights_dict: Dict[str, torch.Tensor] = {}
        for key, length in self.max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device))
            self.position_weights_dict[key] = self.position_weights[key]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for key in self.max_feature_lengths:
                self.position_weights[key].fill_(1.0)
                self.position_weights_dict[key] = self.position_weights[key]

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """features: [F, B] ids; returns the same ids, lengths and keys with weights [N] float32."""
        if torch.jit.is_scripting():
            return _position_weighted(features, self.position_weights_dict, self._pre_processed)
        # eager, fx and torch.export read the ParameterDict itself: a to_empty or load of the ParameterDict alone
        # (DistributedModelParallel's materialisation, export from a checkpoint) leaves the plain dict behind
        return _position_weighted(features, dict(self.position_weights.items()), self._pre_processed)

    def copy(self, device: torch.device) -> nn.Module:
        self.position_weights = self.position_weights.to(device=device)
        self._sync()
        return self

    @torch.jit.unused
    def _sync(self) -> None:
        for key, param in self.position_weights.items():
            self.position_weights_dict[key] = param

    def _apply(self, *args, **kwargs) -> nn.Module:  # type: ignore[no-untyped-def]
        # .to(), .to_empty() and the like replace the parameters: keep the plain dict on them
        super()._apply(*args, **kwargs)
        self._sync()
        return self

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):  # type: ignore[no-untyped-def, override]
        result = super().load_state_dict(state_dict, strict, assign)
        self._sync()
        return result

    def pre_process_input(self, features: KeyedJaggedTensor) -> None:
        """Writes each id's position into ``features``' weights (in place); forward then reads them from there."""
        self._pre_processed = True
        features.weights().copy_(bag_positions(features.offsets(), torch.numel(features.values())).to(torch.float32))


@torch.fx.wrap
def apply_feature_processors_to_kjt(features: KeyedJaggedTensor, feature_processors: Dict[str, nn.Module]) -> KeyedJaggedTensor:
    """``features`` with each key's weights from its processor in ``feature_processors`` (1 for the others)."""
    processed_weights: List[torch.Tensor] = []
    features_dict = features.to_dict()
    for key in features.keys():
        jt = features_dict[key]
        if key in feature_processors:
            processed_weights.append(feature_processors[key](jt).weights())
        else:
            processed_weights.append(torch.ones(jt.values().shape[0], device=jt.values().device))
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        weights=torch.cat(processed_weights) if processed_weights else features.weights_or_none(),
        lengths=features.lengths(),
        offsets=features.offsets(),
        stride=features.stride(),
        length_per_key=features.length_per_key(),
    )


class FeatureProcessorDictWrapper(FeatureProcessorsCollection):
    """A dict of per-feature FeatureProcessors as one FeatureProcessorsCollection (``FeatureProcessedEmbeddingBagCollection.split``)."""

    def __init__(self, feature_processors: nn.ModuleDict) -> None:
        super().__init__()
        self._feature_processors = feature_processors

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return apply_feature_processors_to_kjt(features, dict(self._feature_processors.items()))


@torch.fx.wrap
def _processed_kjt(
    keys: List[str], values: List[torch.Tensor], lengths: List[torch.Tensor], weights: List[torch.Tensor]
) -> KeyedJaggedTensor:
    """The processed features as one KeyedJaggedTensor (one fx node, so a traced collection gets a KJT proxy)."""
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights))


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """A weighted EmbeddingBagCollection whose per-id weights come from feature processors.

    Args:
        embedding_bag_collection: an EmbeddingBagCollection built with ``is_weighted=True``.
        feature_processors: a FeatureProcessorsCollection (``PositionWeightedModuleCollection``), or
            feature -> FeatureProcessor for every feature of the collection's tables.

    forward(features: KeyedJaggedTensor [F, B]) -> KeyedTensor: the collection's output, [B, sum of dims].
    Raises ValueError (TorchRec: AssertionError) for an unweighted collection or a dict whose features
    are not exactly the collection's.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: Union[Dict[str, FeatureProcessor], FeatureProcessorsCollection],
    ) -> None:
        super().__init__()
        self._embedding_bag_collection = embedding_bag_collection
        # config order (TorchRec: a set's order); the output's order is the collection's either way
        names: List[str] = []
        for config in embedding_bag_collection.embedding_bag_configs():
            names += [f for f in config.feature_names if f not in names]
        self._feature_processors: Union[nn.ModuleDict, FeatureProcessorsCollection]
        if isinstance(feature_processors, FeatureProcessorsCollection):
            self._feature_processors = feature_processors
        else:
            if set(names) != set(feature_processors.keys()):
                raise ValueError(
                    f"FeatureProcessedEmbeddingBagCollection: the feature processors' features {sorted(feature_processors)} "
                    f"are not the collection's features {sorted(names)}"
                )
            self._feature_processors = nn.ModuleDict(feature_processors)
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                "FeatureProcessedEmbeddingBagCollection: the EmbeddingBagCollection must be built with is_weighted=True "
                "(the feature processors give it per-id weights)"
            )
        self._feature_names: List[str] = names

    def split(self) -> Tuple[FeatureProcessorsCollection, EmbeddingBagCollection]:
        """(the feature processors as one FeatureProcessorsCollection, the EmbeddingBagCollection)."""
        if isinstance(self._feature_processors, nn.ModuleDict):
            return FeatureProcessorDictWrapper(self._feature_processors), self._embedding_bag_collection
        return self._feature_processors, self._embedding_bag_collection

    def is_weighted(self) -> bool:
        return self._embedding_bag_collection.is_weighted()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if isinstance(self._feature_processors, FeatureProcessorsCollection):
            fp_features = self._feature_processors(features)
        else:
            features_dict = features.to_dict()
            values: List[torch.Tensor] = []
            lengths: List[torch.Tensor] = []
            weights: List[torch.Tensor] = []
            for key in self._feature_names:
                jt = self._feature_processors[key](features_dict[key])
                values.append(jt.values())
                lengths.append(jt.lengths())
                weights.append(jt.weights())
            fp_features = _processed_kjt(self._feature_names, values, lengths, weights)
        return self._embedding_bag_collection(fp_features)


def feature_processed_features(module: nn.Module) -> Set[str]:
    """The features that the FeatureProcessedEmbeddingBagCollections inside ``module`` weight themselves."""
    return {
        f
        for m in module.modules()
        if isinstance(m, FeatureProcessedEmbeddingBagCollection)
        for f in m._feature_names
    }
