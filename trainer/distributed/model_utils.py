"""TorchRec's helpers around a DistributedModelParallel model (``torchrec.distributed.model_parallel`` /
``torchrec.distributed.utils``): unwrapping it, naming its unsharded parts, deep-copying it.

    inner = get_module(dmp)                 # the model DMP wraps (DDP kept: its overrides still apply)
    bare = get_unwrapped_module(dmp)        # DMP, DDP and FSDP all peeled off
    dense_names = get_unsharded_module_names(get_unwrapped_module(dmp))
    with sharded_model_copy(device="cpu"):
        snapshot = copy.deepcopy(dmp)       # tensors copied to the CPU, process groups shared
    encoder_sd = filter_state_dict(model.state_dict(), "encoder")   # keys under "encoder.", the prefix stripped
"""

import copy
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Set, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recship.trainer.distributed.sharded_module import ShardedModule
from recship.trainer.model_parallel import DistributedModelParallel

try:
    from torch.distributed.fsdp import FullyShardedDataParallel
except ImportError:  # a torch build without distributed FSDP: no such wrapper to take off
    FullyShardedDataParallel = None  # type: ignore[assignment, misc]


def get_module(module: nn.Module) -> nn.Module:
    """``module`` without its DistributedModelParallel wrappers. A DistributedDataParallel inside stays (TorchRec's:
    the data-parallel wrapper's overrides of forward, state_dict, ... keep working)."""
    while isinstance(module, DistributedModelParallel):
        module = module._dmp_wrapped_module
    return module


def get_unwrapped_module(module: nn.Module) -> nn.Module:
    """``module`` without any DistributedModelParallel, DistributedDataParallel or FullyShardedDataParallel wrapper."""
    while True:
        if isinstance(module, DistributedModelParallel):
            module = module._dmp_wrapped_module
        elif FullyShardedDataParallel is not None and isinstance(module, FullyShardedDataParallel):
            module = module._fsdp_wrapped_module  # type: ignore[assignment]
        elif isinstance(module, DistributedDataParallel):
            module = module.module  # type: ignore[assignment]  # DDP's module is typed loosely
        else:
            return module


def _collect_unsharded(module: nn.Module, path: str, out: Set[str]) -> bool:
    """Adds the children of ``module`` holding no sharded module, where a sibling does; True if ``module`` holds one."""
    holds_sharded = set()
    for name, child in module.named_children():
        if isinstance(child, ShardedModule) or _collect_unsharded(child, f"{path}{name}.", out):
            holds_sharded.add(name)
    if holds_sharded:
        out.update(path + name for name, _ in module.named_children() if name not in holds_sharded)
    return bool(holds_sharded)


def get_unsharded_module_names(model: nn.Module) -> List[str]:
    """The fully qualified names of the largest submodules without a sharded module inside (TorchRec's): for a
    sharded DLRM, ``["dense_arch", "inter_arch", "over_arch"]`` (in no particular order, as TorchRec's). Pass the
    unwrapped model (``get_unwrapped_module(dmp)``); a model without sharded modules gives []."""
    out: Set[str] = set()
    _collect_unsharded(model, "", out)
    return list(out)


class sharded_model_copy:
    """A context in which ``copy.deepcopy`` copies a sharded model (TorchRec's): every tensor is detached and copied
    to ``device`` (cloned where it already is), parameters keep ``requires_grad``, and process groups and pending
    collectives are shared rather than copied (they cannot be). With ``device=None`` tensors are shared too.

    It patches ``torch.Tensor.__deepcopy__`` (and Parameter's) for the duration of the ``with`` block, process-wide,
    as TorchRec's does: copy nothing else concurrently.
    """

    def __init__(self, device: Optional[Union[str, int, torch.device]]) -> None:
        self.device = torch.device(device) if isinstance(device, (str, int)) else device

    def __enter__(self) -> None:
        self._saved_tensor_copy = torch.Tensor.__deepcopy__
        self._saved_param_copy = torch.nn.Parameter.__deepcopy__
        device = self.device

        def copy_tensor(tensor: torch.Tensor, memo: Any) -> torch.Tensor:
            return tensor.detach().to(device) if tensor.device != device else tensor.detach().clone()

        def share(obj: Any, memo: Any) -> Any:
            return obj

        copy_or_share = copy_tensor if device is not None else share

        def copy_parameter(param: torch.nn.Parameter, memo: Any) -> torch.nn.Parameter:
            return torch.nn.Parameter(copy_or_share(param, memo), requires_grad=param.requires_grad)

        torch.Tensor.__deepcopy__ = copy_or_share  # type: ignore[method-assign,assignment]
        torch.nn.Parameter.__deepcopy__ = copy_parameter  # type: ignore[method-assign,assignment]
        self._shared = [dist.ProcessGroup, torch._C._distributed_c10d.Work]
        for name in ("ProcessGroupGloo", "ProcessGroupNCCL"):
            if hasattr(torch._C._distributed_c10d, name):
                self._shared.append(getattr(torch._C._distributed_c10d, name))
        self._saved_shared = [cls.__dict__.get("__deepcopy__") for cls in self._shared]
        for cls in self._shared:
            cls.__deepcopy__ = share  # type: ignore[attr-defined]

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        torch.Tensor.__deepcopy__ = self._saved_tensor_copy  # type: ignore[method-assign]
        torch.nn.Parameter.__deepcopy__ = self._saved_param_copy  # type: ignore[method-assign]
        for cls, saved in zip(self._shared, self._saved_shared):
            if saved is None:
                del cls.__deepcopy__  # type: ignore[attr-defined]
            else:
                cls.__deepcopy__ = saved  # type: ignore[attr-defined]



def filter_state_dict(state_dict: Mapping[str, Any], name: str) -> "OrderedDict[str, Any]":
    """The entries of ``state_dict`` under ``name.`` with that prefix stripped (TorchRec's), in their order."""
    prefix = name + "."
    return OrderedDict((key[len(prefix):], value) for key, value in state_dict.items() if key.startswith(prefix))


def add_prefix_to_state_dict(state_dict: Dict[str, Any], prefix: str) -> None:
    """Prepends ``prefix`` to every key of ``state_dict``, in place (TorchRec's; a ``state_dict()``'s ``_metadata``
    attribute is not a key and stays as it is)."""
    for key in sorted(state_dict):
        state_dict[prefix + key] = state_dict.pop(key)


def copy_to_device(module: nn.Module, current_device: torch.device, to_device: torch.device) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers on ``current_device`` are moved to ``to_device`` (TorchRec's).
    Tensors elsewhere, and tensors already on ``to_device``, are shared with ``module``, not copied; process groups
    are shared."""
    with sharded_model_copy(device=None):
        copied = copy.deepcopy(module)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(to_device) if t.device == torch.device(current_device) else t

    return copied._apply(move)
