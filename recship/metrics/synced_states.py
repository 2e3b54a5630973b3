"""Metric states that add up across ranks: the part of a metric computation that torchmetrics' ``Metric`` gives
TorchRec, written for recship on ``torch.distributed`` alone.

A state is a tensor (reset to a copy of its default) or a list of tensors (reset to []), registered with
``add_state(name, default, dist_reduce_fx, persistent)``. ``sync()`` replaces every state by its reduction over the
ranks of the process group and keeps the local values; ``unsync()`` puts them back. The gather carries tensors of
different lengths on different ranks (AUC's buffers), so a rank may hold more samples than another.

Reductions: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` act on the ranks' tensors stacked on a new dim 0; ``"cat"``
concatenates along dim 0; a callable gets the stacked tensor (tensor states) or the flat list of the ranks'
tensors (list states); None leaves the stacked tensor / list as gathered.
"""

from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

State = Union[torch.Tensor, List[torch.Tensor]]

MAX_BUFFER_COUNT = 1000  # a window keeps at most this many batches


def dim_zero_cat(x: Union[torch.Tensor, List[torch.Tensor]]) -> torch.Tensor:
    """Tensors (0-d ones as [1]) concatenated along dim 0."""
    parts = [x] if isinstance(x, torch.Tensor) else list(x)
    if not parts:
        raise ValueError("dim_zero_cat: no tensors to concatenate")
    return torch.cat([p.unsqueeze(0) if p.ndim == 0 else p for p in parts], dim=0)


_REDUCTIONS: Dict[str, Callable[[Any], torch.Tensor]] = {
    "sum": lambda x: torch.sum(x, dim=0),
    "mean": lambda x: torch.mean(x, dim=0),
    "max": lambda x: torch.max(x, dim=0).values,
    "min": lambda x: torch.min(x, dim=0).values,
    "cat": dim_zero_cat,
}


def gather_all_tensors(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> List[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, on every rank; the ranks' shapes may differ in any dim (each is
    padded to the largest for the collective and cut back after)."""
    world_size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    if tensor.ndim == 0:
        out = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(out, tensor, group=group)
        return out
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world_size)]
    dist.all_gather(shapes, shape, group=group)
    if all(bool((s == shape).all()) for s in shapes):
        out = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(out, tensor, group=group)
        return out
    largest = torch.stack(shapes).max(dim=0).values.tolist()
    padded = tensor.new_zeros(largest)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded, group=group)
    return [t[tuple(slice(0, n) for n in s.tolist())] for t, s in zip(out, shapes)]


class SyncedStates(nn.Module):
    """An ``nn.Module`` whose metric states are registered with ``add_state`` and reduced across ranks by
    ``sync()``. Persistent states are in ``state_dict()`` under their names; ``.to(device)`` moves the states."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.process_group = process_group
        self._defaults: Dict[str, State] = {}
        self._persistent: Dict[str, bool] = {}
        self._reductions: Dict[str, Optional[Callable[[Any], Any]]] = {}
        self._device = torch.device("cpu")
        self._is_synced = False
        self._to_sync = True  # False: compute() uses the states as they are (already gathered elsewhere)
        self._cache: Optional[Dict[str, State]] = None
        self._update_count = 0
        self._computed: Any = None

    @property
    def device(self) -> torch.device:
        return self._device

    def __getattr__(self, name: str) -> Any:  # states are plain attributes of any registered name
        return super().__getattr__(name)

    def add_state(
        self,
        name: str,
        default: State,
        dist_reduce_fx: Optional[Union[str, Callable[[Any], Any]]] = None,
        persistent: bool = False,
    ) -> None:
        """Register state ``name`` (reachable as ``self.<name>``), a tensor or an empty list."""
        if not isinstance(default, torch.Tensor) and default != []:
            raise ValueError(f"state {name!r}: the default must be a tensor or [], got {default!r}")
        if isinstance(dist_reduce_fx, str):
            if dist_reduce_fx not in _REDUCTIONS:
                raise ValueError(f"state {name!r}: dist_reduce_fx {dist_reduce_fx!r} is not one of {sorted(_REDUCTIONS)}")
            dist_reduce_fx = _REDUCTIONS[dist_reduce_fx]
        elif dist_reduce_fx is not None and not callable(dist_reduce_fx):
            raise TypeError(f"state {name!r}: dist_reduce_fx must be a string, a callable or None")
        value: State = default.detach().clone() if isinstance(default, torch.Tensor) else []
        setattr(self, name, value)
        self._defaults[name] = default.detach().clone() if isinstance(default, torch.Tensor) else []
        self._persistent[name] = persistent
        self._reductions[name] = dist_reduce_fx

    # -- distribution ---------------------------------------------------------------------------------------------

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized()

    def _sync_dist(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Replace each state by its reduction over the ranks. A list state with several tensors is gathered one
        tensor at a time and flattened element-major (all ranks' first tensors, then their second ...); metrics whose
        list states must stay in sample order concatenate them first (see AUC)."""
        group = process_group or self.process_group
        for name, reduce_fx in self._reductions.items():
            value = getattr(self, name)
            if isinstance(value, list):
                if reduce_fx is dim_zero_cat and len(value) > 1:
                    value = [dim_zero_cat(value)]
                if not value:
                    setattr(self, name, [])
                    continue
                gathered: Any = [t for v in value for t in gather_all_tensors(v, group)]
            else:
                gathered = torch.stack(gather_all_tensors(value, group))
            setattr(self, name, reduce_fx(gathered) if reduce_fx is not None else gathered)

    def sync(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """States := their reduction over the ranks (the local ones are kept for ``unsync``). A no-op outside an
        initialized process group."""
        if self._is_synced:
            raise RuntimeError(f"{type(self).__name__}: the states are already synced")
        if not self._distributed():
            return
        self._cache = {name: getattr(self, name) for name in self._defaults}
        self._sync_dist(process_group)
        self._is_synced = True

    def unsync(self) -> None:
        """Put back the local states that ``sync`` replaced."""
        if not self._is_synced or self._cache is None:
            raise RuntimeError(f"{type(self).__name__}: the states are not synced")
        for name, value in self._cache.items():
            setattr(self, name, value)
        self._is_synced = False
        self._cache = None

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Every state back to its default (tensors on the module's device)."""
        self._update_count = 0
        self._computed = None
        self._is_synced = False
        self._cache = None
        for name, default in self._defaults.items():
            if isinstance(default, torch.Tensor):
                setattr(self, name, default.detach().clone().to(self._device))
            else:
                setattr(self, name, [])

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "SyncedStates":
        super()._apply(fn, recurse)
        for name, default in self._defaults.items():
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, fn(value))
            else:
                setattr(self, name, [fn(v) for v in value])
            if isinstance(default, torch.Tensor):
                self._defaults[name] = fn(default)
        self._device = fn(torch.zeros(1, device=self._device)).device
        return self

    # the states keep their dtypes (an NE sum stays float64 whatever the model's dtype); as torchmetrics does
    def float(self) -> "SyncedStates":
        return self

    def double(self) -> "SyncedStates":
        return self

    def half(self) -> "SyncedStates":
        return self

    def bfloat16(self) -> "SyncedStates":
        return self

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._defaults:
            if not self._persistent[name]:
                continue
            value = getattr(self, name)
            if not keep_vars:
                value = value.detach() if isinstance(value, torch.Tensor) else [v.detach() for v in value]
            destination[prefix + name] = value

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        for name in self._defaults:
            key = prefix + name
            if key in state_dict:
                value = state_dict.pop(key)
                if isinstance(value, torch.Tensor):
                    value = value.detach().clone().to(self._device)
                setattr(self, name, value)
            elif strict and self._persistent[name]:
                missing_keys.append(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


class WindowBuffer:
    """The per-batch contributions to one window state, newest last: ``aggregate_state`` adds a batch's
    ``curr_state`` (of ``size`` samples) to ``window_state`` in place and subtracts the oldest batches while the
    window holds more than ``max_size`` samples or ``max_buffer_count`` batches."""

    def __init__(self, max_size: int, max_buffer_count: int) -> None:
        self._max_size = max_size
        self._max_buffer_count = max_buffer_count
        self._buffers: Deque[torch.Tensor] = deque(maxlen=max_buffer_count)
        self._used_sizes: Deque[int] = deque(maxlen=max_buffer_count)
        self._window_used_size = 0

    def _drop_oldest(self, window_state: torch.Tensor) -> None:
        window_state -= self._buffers.popleft()
        self._window_used_size -= self._used_sizes.popleft()

    def aggregate_state(self, window_state: torch.Tensor, curr_state: torch.Tensor, size: int) -> None:
        if len(self._buffers) == self._max_buffer_count:
            self._drop_oldest(window_state)
        self._buffers.append(curr_state.clone())
        self._used_sizes.append(size)
        window_state += curr_state
        self._window_used_size += size
        while self._window_used_size > self._max_size:
            self._drop_oldest(window_state)

    @property
    def buffers(self) -> Deque[torch.Tensor]:
        return self._buffers
