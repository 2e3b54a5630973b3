"""TorchRec's older feature-processor module (``torchrec.modules.feature_processor``, which TorchRec marks as
to be deprecated): ``PositionWeightedModule`` over a dict of features and ``PositionWeightedProcessor`` over a
KeyedJaggedTensor. New code uses ``recship.trainer.feature_processors`` (TorchRec's ``feature_processor_``).

Both learn one weight per position in a bag, as there: id j of an example's bag gets ``position_weights[f][j]``.
State-dict keys are TorchRec's: ``position_weights.<feature>``.
"""

import abc
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer.feature_processors import bag_positions

__all__ = [
    "BaseFeatureProcessor", "BaseGroupedFeatureProcessor", "JaggedTensor", "KeyedJaggedTensor", "PositionWeightedModule",
    "PositionWeightedProcessor", "is_fx_tracing", "offsets_to_range_traceble", "position_weighted_module_update_features",
]


def is_fx_tracing() -> bool:
    """True while torch.fx traces, torch.export's tracing included (TorchRec's ``torchrec.fx.tracer.is_fx_tracing``:
    torch's flag, read without the warning ``torch.fx._symbolic_trace.is_fx_tracing()`` gives)."""
    if torch.jit.is_scripting():
        return False
    return bool(torch.fx._symbolic_trace._is_fx_tracing_flag)


class BaseFeatureProcessor(nn.Module):
    """Abstract: {feature: JaggedTensor} in, the same with weights filled out."""

    @abc.abstractmethod
    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        pass


@torch.fx.wrap
def position_weighted_module_update_features(
    features: Dict[str, JaggedTensor], weighted_features: Dict[str, JaggedTensor]
) -> Dict[str, JaggedTensor]:
    """``features`` updated in place with ``weighted_features`` (and returned)."""
    features.update(weighted_features)
    return features


@torch.fx.wrap
def offsets_to_range_traceble(offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[N] int64: each value's position in its bag (fbgemm's ``offsets_range``; ``bag_positions``)."""
    return bag_positions(offsets, torch.numel(values))


class PositionWeightedModule(BaseFeatureProcessor):
    """Position weights for the features of a dict of JaggedTensors.

    Args:
        max_feature_lengths: feature -> its longest bag; ``position_weights.<feature>`` is [length] float32, all 1.
        device: where to allocate.
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        _check_lengths(self.max_feature_lengths, type(self).__name__)
        self.position_weights: nn.ParameterDict = nn.ParameterDict()
        for key, length in self.max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for key in self.max_feature_lengths:
                self.position_weights[key].fill_(1.0)

    def forward(self, features: Dict[str, JaggedTensor]) -> Dict[str, JaggedTensor]:
        """features: feature -> JaggedTensor; those with position weights come back with weights [N] float32."""
        weighted: Dict[str, JaggedTensor] = {}
        for key, position_weight in self.position_weights.items():
            seq = offsets_to_range_traceble(features[key].offsets(), features[key].values())
            weighted[key] = JaggedTensor(
                values=features[key].values(),
                lengths=features[key].lengths(),
                offsets=features[key].offsets(),
                weights=torch.gather(position_weight, dim=0, index=seq),
            )
        return position_weighted_module_update_features(features, weighted)


class BaseGroupedFeatureProcessor(nn.Module):
    """Abstract: a KeyedJaggedTensor in, a KeyedJaggedTensor with weights out."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        pass


class PositionWeightedProcessor(BaseGroupedFeatureProcessor):
    """Position weights applied to a KeyedJaggedTensor; keeps only the keys it has weights for.

    Args:
        max_feature_lengths: feature -> its longest bag; ``position_weights.<feature>`` is [length] float32, all 1.
        device: where to allocate.

    forward: a KJT whose keys all have position weights comes back with the same keys and weights [N] (TorchRec:
    the sharded, pipelined case; weights already present are read as positions, as row-wise sharding leaves them);
    one that mixes them with other keys comes back with the position-weighted keys only; one without any as it is.
    """

    def __init__(self, max_feature_lengths: Dict[str, int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        _check_lengths(self.max_feature_lengths, type(self).__name__)
        self.position_weights: nn.ParameterDict = nn.ParameterDict()
        for key, length in self.max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device).fill_(1.0))

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if is_fx_tracing():
            return _traced_processor(features, dict(self.position_weights.items()))
        keys = features.keys()
        weights = features.weights_or_none()
        if weights is None:
            cat_seq = bag_positions(features.offsets(), torch.numel(features.values()))
        else:  # row-wise sharding carries each id's position as its weight
            cat_seq = weights.long()
        seqs = torch.split(cat_seq, features.length_per_key())
        fp = [k in self.max_feature_lengths for k in keys]
        if not any(fp):
            return features
        if all(fp):
            return KeyedJaggedTensor(
                keys=keys,
                values=features.values(),
                weights=torch.cat([torch.gather(self.position_weights[k], 0, seqs[i]) for i, k in enumerate(keys)]),
                lengths=features.lengths(),
                offsets=features.offsets(),
                stride=features.stride(),
                length_per_key=features.length_per_key(),
                stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
            )
        values = features.values().split(features.length_per_key())
        lengths = features._per_key_lengths()
        names, out_values, out_lengths, out_weights, strides = [], [], [], [], []
        for i, k in enumerate(keys):
            if fp[i]:
                names.append(k)
                out_values.append(values[i])
                out_lengths.append(lengths[i])
                out_weights.append(torch.gather(self.position_weights[k], 0, seqs[i]))
                if features.variable_stride_per_key():
                    strides.append(features.stride_per_key_per_rank()[i])
        return KeyedJaggedTensor(
            keys=names, values=torch.cat(out_values), lengths=torch.cat(out_lengths), weights=torch.cat(out_weights),
            stride_per_key_per_rank=strides if features.variable_stride_per_key() else None,
        )

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[no-untyped-def]
        """None (TorchRec's: the position weights are parameters only)."""
        yield from ()

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False):  # type: ignore[no-untyped-def, override]
        """``position_weights.<feature>`` for each feature (TorchRec's)."""
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        for name, param in self.position_weights.items():
            destination[prefix + f"position_weights.{name}"] = param if keep_vars else param.detach()
        return destination


@torch.fx.wrap
def _traced_processor(features: KeyedJaggedTensor, position_weights: Dict[str, torch.Tensor]) -> KeyedJaggedTensor:
    """The traced form (TorchRec's fx branch): the position-weighted keys only, in the weights' order."""
    features_dict = features.to_dict()
    names: List[str] = []
    values: List[torch.Tensor] = []
    lengths: List[torch.Tensor] = []
    weights: List[torch.Tensor] = []
    for key, position_weight in position_weights.items():
        jt = features_dict[key]
        names.append(key)
        values.append(jt.values())
        lengths.append(jt.lengths())
        weights.append(torch.gather(position_weight, 0, bag_positions(jt.offsets(), torch.numel(jt.values()))))
    return KeyedJaggedTensor(keys=names, values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights))


def _check_lengths(lengths: Dict[str, int], owner: str) -> None:
    bad = {k: v for k, v in lengths.items() if v <= 0}
    if bad:
        raise ValueError(f"{owner}: max_feature_lengths must be positive, got {bad}")
