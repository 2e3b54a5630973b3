"""The distributed vocabulary TorchRec users know: ShardingEnv, LazyAwaitable, ModuleSharder.

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan.plan[""], env, torch.device("cpu"))
    kt = sharded(kjt).wait()          # or use the awaitable directly: sharded(kjt).values()

recship runs the three sharded stages (input_dist, lookups, output_dist) inside
forward, so the awaitable it returns is already complete: ``wait()`` never blocks
and never issues a collective. It exists so TorchRec code that waits (or doesn't)
runs unchanged.
"""

import abc
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, List, Optional, Type, TypeVar

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from recship.names import TRAINING_SHARDING_TYPES

W = TypeVar("W")
M = TypeVar("M", bound=nn.Module)

# TorchRec's fused_params keys (torchrec.distributed.fused_params) that configure sharding rather than the optimizer.
# recship's inference sharders (recship.quantize.sharders) take them; its training sharders refuse them by name.
FUSED_PARAM_REGISTER_TBE_BOOL = "__register_tbes_in_named_modules"  # the TBEs' buffers join state_dict
FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS = "__register_quant_state_dict_split_scale_bias"  # rows, scale, bias apart
# fbgemm's BoundsCheckMode for the TBEs: recship checks every id against its table first (fbgemm's FATAL), whatever the mode
FUSED_PARAM_BOUNDS_CHECK_MODE = "__register_tbe_bounds_check_mode"
# TorchRec converts lengths to offsets before the quantized lookup (a speed choice); recship's results are the same either way
FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP = "__register_lengths_to_offsets_lookup"


def set_propogate_device(val: bool) -> None:
    """TorchRec's switch (``torchrec.distributed.global_settings``, its spelling) for its inference sharding to place
    lookups and outputs on the device passed (the CPU when none) instead of assuming CUDA. recship's inference sharding
    always does so, so True is accepted and False is a ValueError."""
    if not val:
        raise ValueError("set_propogate_device(False): recship's inference sharding always uses the device it is given "
                         "(the CPU when none); it has no CUDA-by-default mode to switch to")


def get_propogate_device() -> bool:
    """Always True in recship (see ``set_propogate_device``)."""
    return True


@dataclass
class ShardingEnv:
    """Where a sharded module lives: ``world_size`` ranks, this one ``rank``, their process group.

    ``pg`` is None for a local environment (inference sharding over the devices of one process).
    """

    world_size: int
    rank: int
    pg: Optional[dist.ProcessGroup] = None
    output_dtensor: bool = False  # TorchRec's: sharded state as DTensor; recship gives ShardedTensor (True refused)

    def __post_init__(self) -> None:
        if self.output_dtensor:
            raise ValueError("ShardingEnv(output_dtensor=True): recship's sharded state_dict holds ShardedTensors "
                             "(TorchRec's default layout, which torch.distributed.checkpoint reshards), never DTensor")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardingEnv needs 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")

    @classmethod
    def from_process_group(cls, pg: Optional[dist.ProcessGroup]) -> "ShardingEnv":
        """The environment of an initialised process group (None: the default group)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ShardingEnv.from_process_group needs torch.distributed.init_process_group first")
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> "ShardingEnv":
        """A process-group-free environment of ``world_size`` local devices (inference sharding)."""
        return cls(world_size, rank, None)


class Awaitable(abc.ABC, Generic[W]):
    """A result that may not be ready yet; ``wait()`` returns it (computed once)."""

    def __init__(self) -> None:
        self._done = False
        self._result: Any = None

    @abc.abstractmethod
    def _wait_impl(self) -> W:
        """Computes the result (called once, by the first ``wait``)."""

    def wait(self) -> W:
        if not self._done:
            self._result = self._wait_impl()
            self._done = True
        return self._result


class LazyAwaitable(Awaitable[W]):
    """An Awaitable that can also be used as its result: attribute access, calls on it, indexing,
    arithmetic and comparisons, and torch functions taking it wait first (TorchRec's LazyAwaitable
    semantics: ``ebc(features)["f"]`` is ``ebc(features).wait()["f"]``).

    Subclass it and implement ``_wait_impl``; ``awaitable.values()`` is then
    ``awaitable.wait().values()``.
    """

    def __getattr__(self, name: str) -> Any:
        # only reached for names the awaitable itself does not have
        if name.startswith("__") or name in ("_done", "_result"):
            raise AttributeError(name)
        return getattr(self.wait(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args = torch.utils._pytree.tree_map_only(LazyAwaitable, lambda a: a.wait(), args)
        kwargs = torch.utils._pytree.tree_map_only(LazyAwaitable, lambda a: a.wait(), kwargs or {})
        return func(*args, **kwargs)


def _waited(value: Any) -> Any:
    return value.wait() if isinstance(value, LazyAwaitable) else value


def _forward_operator(name: str, reflected: bool) -> Callable[..., Any]:
    """LazyAwaitable's ``__<name>__`` (or ``__r<name>__``): the operator applied to the waited result."""
    op = getattr(operator, name)
    if reflected:
        return lambda self, other: op(_waited(other), self.wait())
    return lambda self, *args: op(self.wait(), *map(_waited, args))


# the operators torch.fx records (indexing, arithmetic, comparisons), as TorchRec's LazyAwaitable forwards them
for _name in torch.fx.graph.magic_methods:
    if hasattr(operator, _name):
        setattr(LazyAwaitable, f"__{_name.strip('_')}__", _forward_operator(_name, reflected=False))
for _name in torch.fx.graph.reflectable_magic_methods:
    if hasattr(operator, _name) and _name != "getitem":
        setattr(LazyAwaitable, f"__r{_name.strip('_')}__", _forward_operator(_name, reflected=True))


class NoWait(LazyAwaitable[W]):
    """A LazyAwaitable holding a result that is already computed."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._result = obj
        self._done = True

    def _wait_impl(self) -> W:
        return self._result


class ModuleSharder(abc.ABC, Generic[M]):
    """Turns one kind of module into its sharded form (TorchRec's sharder interface)."""

    @property
    @abc.abstractmethod
    def module_type(self) -> Type[M]:
        """The unsharded module class this sharder handles."""

    @abc.abstractmethod
    def shard(self, module: M, params: Dict[str, Any], env: ShardingEnv, device: Optional[torch.device] = None) -> nn.Module:
        """The sharded module for ``module`` under ``params`` (table name -> ParameterSharding)."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        """Names of the sharding types this sharder can produce on ``compute_device_type``."""
        return [st.value for st in TRAINING_SHARDING_TYPES]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """Names of the compute kernels usable for ``sharding_type``."""
        return ["dense"] if sharding_type == "data_parallel" else ["fused"]
