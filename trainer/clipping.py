"""TorchRec's gradient clipping (``torchrec.optim.clipping``): clip, then step the wrapped optimizer.

    opt = GradientClippingOptimizer(KeyedOptimizerWrapper(dict(model.named_parameters()), make_adam),
                                    clipping=GradientClipping.NORM, max_gradient=1.0)

``NORM`` scales every gradient by ``min(1, max_gradient / (total_norm + 1e-6))``, where ``total_norm`` is the
``norm_type`` norm of all the gradients together (``torch.nn.utils.clip_grad_norm_``); ``VALUE`` clamps each value to
[-max_gradient, max_gradient]; ``NONE`` only steps. Gradients fused into a sharded table's backward never reach a
dense optimizer, so they are not clipped here (as in TorchRec).

Global clipping (``enable_global_grad_clip=True`` with ``param_to_pgs``): a parameter whose gradient is sharded over
process groups (each rank holding part of it) contributes its local |g|^p summed over those groups (the maximum for
the inf-norm), so every rank clips by the norm of the whole gradient, as if one process held it. Parameters not in
``param_to_pgs`` are replicated: their local norm counts once.
"""

from collections import defaultdict
from enum import Enum, unique
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recship.trainer.fused_optim import KeyedOptimizer, OptimizerWrapper


@unique
class GradientClipping(Enum):
    NORM = "norm"
    VALUE = "value"
    NONE = "none"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _grads(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """The local gradients of ``params`` that exist and are not empty."""
    return [_local(p.grad) for p in params if p.grad is not None and p.grad.numel() > 0]


def _powered_norm(grads: List[torch.Tensor], norm_type: float, groups: Tuple[Any, ...] = ()) -> torch.Tensor:
    """sum |g|^p over ``grads`` (their max |g| for the inf-norm), reduced over each process group in ``groups``."""
    inf = norm_type == float("inf")
    if not grads:
        local = torch.tensor(float("-inf") if inf else 0.0)
    else:
        local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
        local = local if inf else local**norm_type
    for pg in groups:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pg)
    return local


class GradientClippingOptimizer(OptimizerWrapper):
    """Clips the wrapped optimizer's gradients, then steps it (TorchRec's; see the module docstring).

    Args:
        optimizer: the keyed optimizer to wrap.
        clipping: NORM, VALUE or NONE.
        max_gradient: the norm bound (NORM) or value bound (VALUE), >= 0.
        norm_type: the p of the p-norm; ``"inf"`` or ``float("inf")`` for the max-norm.
        enable_global_grad_clip: clip by the norm over every rank's shard of the parameters in ``param_to_pgs``.
        param_to_pgs: parameter -> the process groups its gradient is sharded over (global clipping only).
        track_grad_norm: also compute the total norm under VALUE and NONE (``last_total_grad_norm``).
    """

    def __init__(self, optimizer: KeyedOptimizer, clipping: GradientClipping = GradientClipping.NONE, max_gradient: float = 0.1,
                 norm_type: Union[float, str] = 2.0, enable_global_grad_clip: bool = False,
                 param_to_pgs: Optional[Dict[torch.nn.Parameter, List[dist.ProcessGroup]]] = None,
                 track_grad_norm: bool = False) -> None:
        super().__init__(optimizer)
        self._clipping = GradientClipping(clipping)
        if not max_gradient >= 0:
            raise ValueError(f"max_gradient must be >= 0, got {max_gradient}")
        self._max_gradient = max_gradient
        self._norm_type = float(norm_type)
        if not self._norm_type > 0:
            raise ValueError(f"norm_type must be > 0 (or 'inf'), got {norm_type!r}")
        self._enable_global_grad_clip = enable_global_grad_clip
        self._track_grad_norm = track_grad_norm
        self._last_total_grad_norm: Optional[torch.Tensor] = None
        self._check_meta = True
        self._replicate_params: List[torch.Tensor] = []
        self._sharded_params: Dict[Tuple[Any, ...], List[torch.Tensor]] = defaultdict(list)
        for group in self.param_groups:
            for p in group["params"]:
                pgs = (param_to_pgs or {}).get(p) if enable_global_grad_clip else None
                if pgs:
                    self._sharded_params[tuple(pgs)].append(p)
                else:
                    self._replicate_params.append(p)
        if self._clipping == GradientClipping.VALUE and self._sharded_params:
            raise ValueError("GradientClipping.VALUE clips each value where it is: it takes no sharded parameters "
                             "(param_to_pgs with enable_global_grad_clip); use NORM for global clipping")

    @property
    def last_total_grad_norm(self) -> Optional[torch.Tensor]:
        """The total gradient norm of the last step (NORM, or with ``track_grad_norm``); None before any."""
        return self._last_total_grad_norm

    def compute_total_grad_norm(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """(the total ``norm_type`` norm of every gradient, sharded ones over their groups; the local gradients)."""
        inf = self._norm_type == float("inf")
        combine = torch.maximum if inf else torch.add
        total = _powered_norm(_grads(self._replicate_params), self._norm_type)
        grads = _grads(self._replicate_params)
        for pgs, params in self._sharded_params.items():
            sharded = _grads(params)
            total = combine(total, _powered_norm(sharded, self._norm_type, pgs).to(total.device))
            grads.extend(sharded)
        return (total if inf else total.pow(1.0 / self._norm_type)), grads

    def clip_grad_norm_(self) -> torch.Tensor:
        """Scales every gradient by min(1, max_gradient / (total norm + 1e-6)); returns the total norm."""
        total, grads = self.compute_total_grad_norm()
        if grads:
            torch._foreach_mul_(grads, torch.clamp(self._max_gradient / (total + 1e-6), max=1.0))
        return total

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._check_meta:
            # parameters still on the meta device (before DMP materialises them) have nothing to clip
            if any(p.device.type == "meta" for ps in [self._replicate_params, *self._sharded_params.values()] for p in ps):
                self._last_total_grad_norm = None
                return super().step(closure)
            self._check_meta = False
        if self._clipping == GradientClipping.NORM:
            if self._sharded_params:
                self._last_total_grad_norm = self.clip_grad_norm_()
            else:
                with_grad = [_local(p) for p in self._replicate_params if p.grad is not None and p.grad.numel() > 0]
                self._last_total_grad_norm = (torch.nn.utils.clip_grad_norm_(with_grad, self._max_gradient, norm_type=self._norm_type)
                                              if with_grad else None)
        else:
            if self._track_grad_norm:
                self._last_total_grad_norm = self.compute_total_grad_norm()[0]
            if self._clipping == GradientClipping.VALUE:
                torch.nn.utils.clip_grad_value_(self._replicate_params, self._max_gradient)
        return super().step(closure)
