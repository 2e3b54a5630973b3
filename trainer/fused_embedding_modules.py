"""Unsharded embedding collections whose optimizer runs inside backward (TorchRec's fused_embedding_modules).

``FusedEmbeddingBagCollection`` and ``FusedEmbeddingCollection`` take the tables of an EmbeddingBagCollection /
EmbeddingCollection plus a torch optimizer class and its arguments (``torch.optim.SGD``, ``torch.optim.Adagrad``,
``RowWiseAdagrad``, ``torch.optim.Adam``); the tables live in fbgemm training kernels (one
``SplitTableBatchedEmbeddingBagsCodegen`` per group of tables with the same pooling and data type), and
``backward()`` updates them in place: no embedding gradient is materialised, no optimizer step is needed.
``fused_optimizer()`` exposes the kernels' learning rate and state as a keyed optimizer (TorchRec's keys:
``{"t1.weight": {"t1.weight.momentum_1": ...}}``); changing a param group's "lr" and calling ``step()`` or
``zero_grad()`` sets the rate of the next backward.

state_dict keys are the plain collections' (``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``):
the parameters are views of the kernels' weights, so ``load_state_dict`` writes into the kernels.

On CPU fbgemm has kernels for EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD (Adam is CUDA-only) and ignores
weight decay: both are refused on CPU rather than trained without. Where TorchRec differs:
``FusedEmbeddingCollection`` also runs on CPU (TorchRec's asserts CUDA); outputs follow the config's table order
when tables of different pooling interleave (TorchRec concatenates by group); optimizer arguments fbgemm's kernels
would ignore (SGD's momentum, ...) are a ValueError; a weighted MEAN table trains with the gradient of what it computes
(fbgemm 1.8.0's CPU kernel, and TorchRec's module with it, leaves out the 1 / bag length in backward: recship pools
such a table with SUM over weights already divided by the length); ``fuse_embedding_optimizer`` keeps the replaced collections'
weights and ``is_weighted`` (TorchRec re-initialises the tables and drops ``is_weighted``).
"""

import copy
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, Union

from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
import torch
from torch import nn

from recship.names import EmbOptimType
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import (EmbeddingBagCollection, EmbeddingCollection, _check_tables, check_features,
                                               get_embedding_names_by_table, rows_per_feature)
from recship.trainer.fused_optim import CombinedOptimizer, FusedOptimizer, FusedOptimizerConfig, KeyedOptimizer, RowWiseAdagrad
from recship.modules.types import DataType, PoolingType

_FUSABLE: Dict[type, EmbOptimType] = {
    torch.optim.SGD: EmbOptimType.EXACT_SGD,
    torch.optim.Adagrad: EmbOptimType.EXACT_ADAGRAD,
    RowWiseAdagrad: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    torch.optim.Adam: EmbOptimType.ADAM,
}
# the fbgemm kernel arguments a fused collection takes (FusedOptimizerConfig's fields, fbgemm's defaults)
_KERNEL_ARGS = ("learning_rate", "eps", "weight_decay", "beta1", "beta2")


def convert_optimizer_type_and_kwargs(
    optimizer_type: Type[torch.optim.Optimizer], optimizer_kwargs: Dict[str, Any]
) -> Optional[Tuple[Any, Dict[str, Any]]]:
    """The fbgemm optimizer (fbgemm's ``EmbOptimType``) and kernel arguments of a torch optimizer, as TorchRec's.

    ``optimizer_kwargs`` is copied with "lr" renamed "learning_rate"; None for an optimizer class with no fused
    kernel (anything but SGD, Adagrad, RowWiseAdagrad, Adam).
    """
    kwargs = copy.deepcopy(dict(optimizer_kwargs))
    if "lr" in kwargs:
        kwargs["learning_rate"] = kwargs.pop("lr")
    ours = _FUSABLE.get(optimizer_type)
    if ours is None:
        return None
    return FbgemmOptim[ours.name], kwargs


def _kernel_config(optimizer_type: type, optimizer_kwargs: Dict[str, Any], device: torch.device) -> FusedOptimizerConfig:
    """The fused optimizer's settings; unset ones take fbgemm's defaults (Adagrad's eps is 1e-8, as in TorchRec)."""
    converted = convert_optimizer_type_and_kwargs(optimizer_type, optimizer_kwargs)
    if converted is None:
        supported = ", ".join(c.__name__ for c in _FUSABLE)
        raise ValueError(f"Cannot fuse optimizer_type={optimizer_type} with kwargs {optimizer_kwargs}: recship fuses {supported}")
    optim, kwargs = converted
    if "betas" in kwargs:  # torch's Adam spelling
        kwargs["beta1"], kwargs["beta2"] = kwargs.pop("betas")
    unknown = sorted(set(kwargs) - set(_KERNEL_ARGS))
    if unknown:
        raise ValueError(
            f"{optimizer_type.__name__} arguments {unknown} cannot be fused: fbgemm's {optim.name} kernel takes "
            f"{list(_KERNEL_ARGS)} ('lr' for learning_rate, 'betas' for beta1/beta2)"
        )
    config = FusedOptimizerConfig(optimizer=EmbOptimType[optim.name], **kwargs)
    config.check_device(device.type)
    return config


def _device(device: Optional[Union[str, torch.device]], location: Any) -> torch.device:
    """The compute device; ``location`` (fbgemm's EmbeddingLocation) must be where the device keeps tables."""
    device = torch.device(device if device is not None else "cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"a fused embedding collection holds its tables in fbgemm kernels on cpu or cuda, not {device}")
    if location is not None:
        if location != EmbeddingLocation.HOST and device.type != "cuda":
            raise ValueError(f"location={location} needs device=cuda, got {device}")
    return device


def _training_kernel(
    tables: List[BaseEmbeddingConfig], pooling: PoolingType, data_type: DataType, config: FusedOptimizerConfig,
    device: torch.device, location: Any,
) -> Any:  # fbgemm's SplitTableBatchedEmbeddingBagsCodegen (untyped)
    """One fbgemm training kernel over ``tables`` (feature i reads table feature_table_map[i]), tables initialised."""
    for t in tables:
        if t.embedding_dim % 4 != 0:
            raise ValueError(f"table {t.name!r}: fbgemm's training kernels take an embedding_dim that is a multiple of 4, "
                             f"got {t.embedding_dim}")
    if location is None:
        location = EmbeddingLocation.DEVICE if device.type == "cuda" else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if device.type == "cuda" else ComputeDevice.CPU
    kernel = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(t.num_embeddings, t.embedding_dim, location, compute) for t in tables],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        pooling_mode=PoolingMode[pooling.name],
        weights_precision=data_type.to_sparse_type(),
        optimizer=FbgemmOptim[config.optimizer.name],
        learning_rate=config.learning_rate,
        eps=config.eps,
        weight_decay=config.weight_decay,
        beta1=config.beta1,
        beta2=config.beta2,
        bounds_check_mode=BoundsCheckMode.FATAL,  # ids were checked (eager); a traced call still fails loudly
        device=device,
    )
    for t, weight in zip(tables, kernel.split_embedding_weights()):
        t.init_weight(weight)  # TorchRec's uniform_(weight_init_min, weight_init_max), in kernel order
    return kernel


class EmbeddingFusedOptimizer(FusedOptimizer):
    """The optimizer fused into one fbgemm kernel, as a keyed optimizer (TorchRec's).

    Args:
        tables: the kernel's tables, in its order.
        emb_module: the fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` holding them.

    Parameters are ``<table>.weight`` ([rows, dim] views of the kernel's weights); each one's state is the kernel's
    own, ``{"<table>.weight.momentum_1": ..., "<table>.weight.momentum_2": ...}`` (none for SGD; [rows, dim] for
    Adagrad, [rows] for row-wise Adagrad). One param group, whose "lr" ``step()`` / ``zero_grad()`` hand to the kernel.
    """

    def __init__(self, tables: List[BaseEmbeddingConfig], emb_module: Any) -> None:
        self._emb_module = emb_module
        params: Dict[str, torch.Tensor] = OrderedDict()
        state: Dict[Any, Dict[str, torch.Tensor]] = {}
        for table, weight, states in zip(tables, emb_module.split_embedding_weights(), emb_module.split_optimizer_states()):
            key = f"{table.name}.weight"
            params[key] = weight
            state[weight] = {f"{key}.momentum_{i + 1}": s for i, s in enumerate(states[:2])}
        super().__init__(params, state, [{"params": list(params.values()), "lr": emb_module.get_learning_rate()}])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """No update (backward made it); the kernel takes the param group's "lr" from the next backward on."""
        self._emb_module.set_learning_rate(self.param_groups[0]["lr"])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Fused tables keep no gradients; hands the "lr" to the kernel, as ``step``."""
        self._emb_module.set_learning_rate(self.param_groups[0]["lr"])


class _FusedTables(nn.Module):
    """What the two collections share: tables grouped by (pooling, data type) into fbgemm kernels, their weights
    registered as ``<attr>.<table>.weight`` views, and the combined fused optimizer."""

    def _build(
        self, attr: str, tables: List[Any], pooling_of: Any, weighted: bool, optimizer_type: type,
        optimizer_kwargs: Dict[str, Any], device: Optional[Union[str, torch.device]], location: Any,
    ) -> None:
        self._device = _device(device, location)
        self._optimizer_type = optimizer_type
        self._optimizer_kwargs = optimizer_kwargs
        config = _kernel_config(optimizer_type, optimizer_kwargs, self._device)
        groups: Dict[Tuple[PoolingType, DataType], List[Any]] = OrderedDict()
        for t in tables:
            groups.setdefault((pooling_of(t), t.data_type), []).append(t)
        self._groups: List[List[Any]] = list(groups.values())
        self._names_by_table = dict(zip((t.name for t in tables), get_embedding_names_by_table(tables)))
        # each kernel's output names, table by table (feature@table for a shared feature), and all of them in table order
        self._group_names: List[List[str]] = [[n for t in g for n in self._names_by_table[t.name]] for g in self._groups]
        self._output_order: List[str] = [n for t in tables for n in self._names_by_table[t.name]]
        # a plain list, as TorchRec's: the kernels are not submodules (state_dict and parameters are the views below)
        # a weighted MEAN group pools with SUM, its weights divided by the bag length in forward (see the module docstring)
        self._divide: List[bool] = [p == PoolingType.MEAN and weighted for p, _ in groups]
        self._kernels: List[Any] = [
            _training_kernel(g, PoolingType.SUM if divide else p, d, config, self._device, location)
            for ((p, d), g), divide in zip(groups.items(), self._divide)
        ]
        self._optim = CombinedOptimizer([("", EmbeddingFusedOptimizer(g, k)) for g, k in zip(self._groups, self._kernels)])
        setattr(self, attr, nn.ModuleDict())
        holder = getattr(self, attr)
        for group, kernel in zip(self._groups, self._kernels):
            for t, weight in zip(group, kernel.split_embedding_weights()):
                holder[t.name] = nn.Module()
                holder[t.name].register_parameter("weight", nn.Parameter(weight))
        self._attr = attr

    def _views(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        holder = getattr(self, self._attr)
        for group, kernel in zip(self._groups, self._kernels):
            for t, weight in zip(group, kernel.split_embedding_weights()):
                yield holder[t.name].weight, weight

    def _apply(self, fn: Any, recurse: bool = True) -> "_FusedTables":
        # .to(other device / dtype) would copy the parameters away from the kernels, which go on training the old ones
        super()._apply(fn, recurse)
        for param, weight in self._views():
            if param.data_ptr() != weight.data_ptr() or param.dtype != weight.dtype:
                raise ValueError(
                    f"{type(self).__name__}'s tables live in fbgemm kernels on {self._device} and cannot be moved or "
                    "cast; build it on the device you need (fuse_embedding_optimizer(model, ..., device=...))"
                )
        return self

    def _ids(self, features: KeyedJaggedTensor, group: List[Any], weighted: bool, divide: bool = False):
        """The kernel's input for one group: ids [n], offsets [F_g * B + 1], per-id weights [n] or None (``divide``:
        each divided by its bag's length)."""
        feature_dict = features.to_dict()
        jts = [feature_dict[f] for t in group for f in t.feature_names]
        ids = torch.cat([jt.values() for jt in jts]).long()
        lengths = torch.cat([jt.lengths() for jt in jts]).long()
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        weights = torch.cat([jt.weights() for jt in jts]).float() if weighted else None
        if weights is not None and divide:
            weights = weights / torch.repeat_interleave(lengths, lengths).to(weights.dtype)
        return ids, offsets, weights, jts


    @property
    def device(self) -> torch.device:
        return self._device

    def optimizer_type(self) -> Type[torch.optim.Optimizer]:
        return self._optimizer_type

    def optimizer_kwargs(self) -> Dict[str, Any]:
        return self._optimizer_kwargs

    def fused_optimizer(self) -> KeyedOptimizer:
        """The kernels' optimizer: a CombinedOptimizer of one EmbeddingFusedOptimizer per kernel."""
        return self._optim


class FusedEmbeddingBagCollection(_FusedTables):
    """An EmbeddingBagCollection whose optimizer runs in backward: KJT [F x B x L] in, KeyedTensor [B, sum dims] out.

    Args:
        tables: one EmbeddingBagConfig per table.
        optimizer_type: torch.optim.SGD, torch.optim.Adagrad, RowWiseAdagrad or torch.optim.Adam (CUDA only).
        optimizer_kwargs: its arguments ("lr", "eps", "weight_decay" (CUDA only), "betas"); unset ones take fbgemm's
            defaults (learning rate 0.01, eps 1e-8), as TorchRec's.
        is_weighted: use the KJT's weights as per-id scores.
        device: cpu or cuda.
        location: fbgemm's EmbeddingLocation (HOST on cpu; DEVICE, MANAGED, MANAGED_CACHING need cuda).

    Example::

        ebc = FusedEmbeddingBagCollection([EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                          feature_names=["f1"])], torch.optim.SGD, {"lr": 0.1})
        kt = ebc(KeyedJaggedTensor(["f1"], torch.tensor([0, 1, 2]), lengths=torch.tensor([2, 1])))  # [2, 4]
        kt.values().sum().backward()  # rows 0, 1, 2 moved by -0.1 each
    """

    embedding_bags: nn.ModuleDict  # set by _build: <table>.weight, views of the kernels' rows

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        optimizer_type: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        location: Optional[Any] = None,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingBagConfig)
        self._embedding_bag_configs = list(tables)
        self._is_weighted = bool(is_weighted)
        self._build("embedding_bags", self._embedding_bag_configs, lambda t: t.pooling, self._is_weighted, optimizer_type, optimizer_kwargs, device, location)
        self._embedding_names = list(self._output_order)
        self._length_per_key = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._rows_per_feature = rows_per_feature(tables)
        # the kernels' output columns in config order, when grouping reordered the tables
        group_order = [name for names in self._group_names for name in names]
        self._reorder = None if group_order == self._embedding_names else [group_order.index(f) for f in self._embedding_names]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: [F, B] ids (every table's features, one batch size). Returns keys = the features, table by table;
        values [B, sum of their dims] float32."""
        check_features(features, self._rows_per_feature)
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError("this FusedEmbeddingBagCollection is weighted (is_weighted=True): the KeyedJaggedTensor needs weights")
        pooled: List[torch.Tensor] = []
        for group, kernel, divide in zip(self._groups, self._kernels, self._divide):
            ids, offsets, weights, _ = self._ids(features, group, self._is_weighted, divide)
            out = kernel(indices=ids, offsets=offsets, per_sample_weights=weights)
            if self._reorder is None:
                pooled.append(out)
            else:
                dims = [t.embedding_dim for t in group for _ in t.feature_names]
                pooled.extend(torch.split(out, dims, dim=1))
        if self._reorder is None:
            values = torch.cat(pooled, dim=1)
        else:
            values = torch.cat([pooled[i] for i in self._reorder], dim=1)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values, key_dim=1)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _get_name(self) -> str:
        return "FusedEmbeddingBagCollection"


class FusedEmbeddingCollection(_FusedTables):
    """An EmbeddingCollection whose optimizer runs in backward: KJT in, {feature: JaggedTensor of [N_f, dim] rows} out.

    Args:
        tables: one EmbeddingConfig per table, all of one embedding_dim.
        optimizer_type, optimizer_kwargs: as FusedEmbeddingBagCollection's.
        device: cpu or cuda (TorchRec's takes cuda only).
        need_indices: each output JaggedTensor carries its ids as ``weights``, as EmbeddingCollection's.
        location: fbgemm's EmbeddingLocation, as FusedEmbeddingBagCollection's.
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        optimizer_type: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        location: Optional[Any] = None,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingConfig)
        dims = sorted({t.embedding_dim for t in tables})
        if len(dims) != 1:
            raise ValueError(f"the tables of a FusedEmbeddingCollection need one embedding_dim, got {dims}")
        self._embedding_configs = list(tables)
        self._embedding_dim = dims[0]
        self._need_indices = bool(need_indices)
        self._build("embeddings", self._embedding_configs, lambda t: PoolingType.NONE, False, optimizer_type, optimizer_kwargs, device, location)
        self._rows_per_feature = rows_per_feature(tables)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """features: [F, B] ids. Returns {feature: JaggedTensor(values [N_f, dim] float32, the feature's lengths)}."""
        check_features(features, self._rows_per_feature)
        out: Dict[str, JaggedTensor] = {}
        for group, kernel, names in zip(self._groups, self._kernels, self._group_names):
            ids, offsets, _, jts = self._ids(features, group, False)
            rows = kernel(indices=ids, offsets=offsets)
            for name, jt, part in zip(names, jts, torch.split(rows, [int(jt.values().numel()) for jt in jts])):
                out[name] = JaggedTensor(values=part, lengths=jt.lengths(), weights=jt.values() if self._need_indices else None)
        return {name: out[name] for name in self._output_order}

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> List[List[str]]:
        """Each table's output names (``feature@table`` for a shared feature), as EmbeddingCollection's."""
        return [list(self._names_by_table[t.name]) for t in self._embedding_configs]

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices

    def _get_name(self) -> str:
        return "FusedEmbeddingCollection"


def fuse_embedding_optimizer(
    model: nn.Module,
    optimizer_type: Type[torch.optim.Optimizer],
    optimizer_kwargs: Dict[str, Any],
    device: torch.device,
    location: Optional[Any] = None,
) -> nn.Module:
    """Replaces every EmbeddingBagCollection / EmbeddingCollection in ``model`` (or ``model`` itself) by its fused
    counterpart on ``device``, with the same tables, weights and ``is_weighted``; returns the model.

    Example::

        model = fuse_embedding_optimizer(model, torch.optim.Adagrad, {"lr": 0.05}, torch.device("cpu"))
        loss = model(batch); loss.backward()  # the tables are updated; optimize the dense part as usual
    """

    def fused(module: nn.Module) -> Optional[nn.Module]:
        if isinstance(module, EmbeddingBagCollection):
            new: nn.Module = FusedEmbeddingBagCollection(
                module.embedding_bag_configs(), optimizer_type, optimizer_kwargs, is_weighted=module.is_weighted(),
                device=device, location=location,
            )
        elif isinstance(module, EmbeddingCollection):
            new = FusedEmbeddingCollection(
                module.embedding_configs(), optimizer_type, optimizer_kwargs, device=device,
                need_indices=module.need_indices(), location=location,
            )
        else:
            return None
        if module.device.type != "meta":
            new.load_state_dict(module.state_dict())
        return new

    top = fused(model)
    if top is not None:
        return top

    def replace(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            new = fused(child)
            if new is None:
                replace(child)
            else:
                setattr(parent, name, new)

    replace(model)
    return model
